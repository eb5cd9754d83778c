"""The gateway in front of a real engine we did not write: llama.cpp's llama-server, built from
the pinned sources and run with a tiny random-weight Qwen2 (tests/llamacpp.py).

What a simulated engine cannot show: that llama.cpp's stream, usage, /props and /metrics are
read as llama.cpp writes them, that the gateway's token count is the engine's, that holding a
backend at its slots keeps the engine from deferring, and that a crashed engine is ejected and
taken back.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loadtest.llamacpp.server import (
    SERVED_NAME,
    BuildImpossible,
    EngineShape,
    cached_binary,
    llama_server_binary,
)
from tests.conftest import StartGateway
from tests.llamacpp import llama_server as llama_server  # the session fixture
from tests.llamacpp import llamacpp_policy, run_llamacpp, start_llamacpp
from tests.servers import (
    Reply,
    http,
    metric,
    openai_client,
    poll_metric,
    quiet,
    scrape,
)

# The first run on a machine builds llama-server inside the first test's setup (about ten
# minutes on two cores); once it is cached, the usual per-test limit holds.
pytestmark = pytest.mark.timeout(120 if cached_binary() is not None else 1800)

TWO_SLOTS = EngineShape(slots=2, slot_context=1024)
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three rivers of Europe, and say why they matter."}]


def chat(url: str, max_tokens: int, headers: dict[str, str] | None = None,
         timeout: float = 30.0) -> Reply:
    return http("POST", url + "/v1/chat/completions",
                {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": max_tokens},
                headers=headers, timeout=timeout)


def engine_gauges(engine_url: str) -> tuple[float, float]:
    """(requests_processing, requests_deferred) from llama-server's own /metrics."""
    s = scrape(engine_url)
    return (metric(s, "llamacpp:requests_processing"), metric(s, "llamacpp:requests_deferred"))


class EngineWatch:
    """The highest processing and deferred counts llama-server reports while a block runs."""

    def __init__(self, engine_url: str) -> None:
        self.url = engine_url
        self.processing = self.deferred = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                p, d = engine_gauges(self.url)
            except (OSError, AssertionError):
                continue
            self.processing, self.deferred = max(self.processing, p), max(self.deferred, d)

    def __enter__(self) -> EngineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_sdk_streaming_and_not_with_exact_prompt_tokens(
        llama_server: tuple[Path, Path],
        start_gateway: StartGateway, tmp_path: Path) -> None:
    binary, model = llama_server
    with run_llamacpp(binary, model, tmp_path, TWO_SLOTS) as engine, \
            start_gateway(llamacpp_policy([engine.url], slot_context=1024)) as gw:
        client = openai_client(gw.url)
        raw = client.chat.completions.with_raw_response.create(
            model=SERVED_NAME, messages=MESSAGES, max_tokens=12)  # type: ignore[arg-type]
        done = raw.parse()
        counted = int(raw.headers["x-gateway-prompt-tokens"])
        assert raw.headers["x-gateway-backend"] == "e0"
        assert done.usage is not None and 1 <= done.usage.completion_tokens <= 12
        # The same tokenizer files and the same (qwen2.5) template on both sides: the gateway's
        # count is the engine's, token for token.
        assert done.usage.prompt_tokens == counted
        assert done.choices[0].message.content is not None

        with client.chat.completions.with_streaming_response.create(
                model=SERVED_NAME, messages=MESSAGES, max_tokens=20,  # type: ignore[arg-type]
                stream=True, stream_options={"include_usage": True}) as resp:
            assert resp.headers["x-gateway-decision"] == "admitted"
            chunks = list(resp.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert text and usage is not None
        assert usage.prompt_tokens == counted and 1 <= usage.completion_tokens <= 20

        # The gateway read usage from both answers, llama.cpp's prompt cache included: the
        # second prompt is the first, so its slot computed only what it could not reuse
        # (usage.prompt_tokens_details.cached_tokens).
        s = poll_metric(gw.url, "gateway_tokens_total", lambda v: v > 0, kind="cached")
        cached = metric(s, "gateway_tokens_total", kind="cached")
        assert metric(s, "gateway_tokens_total", kind="input") + cached == 2 * counted
        assert 0 < cached < counted
        quiet(gw.url)


def test_engine_metrics_and_slots_in_estimate_and_metrics(
        llama_server: tuple[Path, Path],
        start_gateway: StartGateway, tmp_path: Path) -> None:
    binary, model = llama_server
    with run_llamacpp(binary, model, tmp_path, TWO_SLOTS) as engine, \
            start_gateway(llamacpp_policy([engine.url], slot_context=1024)) as gw:
        assert chat(gw.url, 8).status == 200
        deadline = time.monotonic() + 5
        while True:  # until a scrape after the request (every 0.2 s) has been read
            est = http("POST", gw.url + "/gateway/estimate",
                       {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 8}).json()
            b = est["decision"]["backends"]["e0"]
            eng = b["engine"]
            if eng["prompt_tokens_total"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert eng["slots"] == 2 and eng["slot_tokens"] == 1024
        assert eng["running"] == 0 and eng["waiting"] == 0
        assert eng["prompt_tokens_total"] > 0 and eng["predicted_tokens_total"] >= 1
        # Capacity is the slots: two slots of 1024 tokens, 64 blocks of 16 each.
        assert b["slot_blocks"] == 64 and b["capacity_blocks"] == 128
        assert b["limit_blocks"] == 128

        s = scrape(gw.url)
        assert metric(s, "gateway_engine_slots", backend="e0") == 2
        assert metric(s, "gateway_kv_capacity_blocks", backend="e0") == 128
        assert ("gateway_engine_requests",
                (("backend", "e0"), ("pool", "default"), ("state", "waiting"))) in s


def test_more_requests_than_slots_wait_in_the_gateway_not_the_engine(
        llama_server: tuple[Path, Path],
        start_gateway: StartGateway, tmp_path: Path) -> None:
    binary, model = llama_server
    with run_llamacpp(binary, model, tmp_path, TWO_SLOTS) as engine, \
            start_gateway(llamacpp_policy([engine.url], slot_context=1024)) as gw:
        # The control: six at once straight to the engine, which defers what has no slot.
        with EngineWatch(engine.url) as direct, ThreadPoolExecutor(6) as pool:
            assert all(r.status == 200 for r in pool.map(lambda _: chat(engine.url, 400),
                                                         range(6)))
        assert direct.deferred >= 2
        with EngineWatch(engine.url) as watch, ThreadPoolExecutor(8) as pool:
            # Six at once on two slots: two run, four wait in the gateway's queue.
            replies = list(pool.map(lambda _: chat(gw.url, 48), range(6)))
            assert [r.status for r in replies] == [200] * 6, replies
            decisions = sorted(r.headers["x-gateway-decision"] for r in replies)
            assert decisions.count("queued") >= 3, decisions

            # Slots busy again, and callers that will not wait: refused at once with a
            # Retry-After, instead of being deferred by the engine.
            long = [pool.submit(chat, gw.url, 900) for _ in range(2)]
            poll_metric(gw.url, "gateway_kv_reserved_blocks", lambda v: v >= 128)
            hasty = [chat(gw.url, 8, {"x-gateway-max-queue-ms": "100"}) for _ in range(3)]
            assert all(r.result().status == 200 for r in long)
        for r in hasty:
            assert r.status == 503, r
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "overloaded"), error
            assert int(r.headers["retry-after"]) >= 1
            assert r.headers["x-gateway-reason"] in ("predicted_wait", "queue_timeout",
                                                    "kv_blocks"), r.headers
        # The engine never held more than its slots and deferred nothing, or one request for
        # an instant: a slot the gateway has released that the engine has not yet (seen once
        # in the benchmark, where a cut client's slot stays busy until llama.cpp notices).
        assert 1 <= watch.processing <= 2
        assert watch.deferred <= 1
        quiet(gw.url)


def test_engine_killed_and_restarted_mid_load(
        llama_server: tuple[Path, Path],
        start_gateway: StartGateway, tmp_path: Path) -> None:
    binary, model = llama_server
    engine = start_llamacpp(binary, model, tmp_path, TWO_SLOTS)
    statuses: list[int] = []
    stop = threading.Event()

    def load(url: str) -> None:
        while not stop.is_set():
            try:
                statuses.append(chat(url, 24, timeout=15).status)
            except OSError:
                statuses.append(-1)  # the gateway itself must never drop a connection
            if statuses[-1] != 200:
                time.sleep(0.05)  # a refusal is instant: do not spin on it

    try:
        with start_gateway(llamacpp_policy([engine.url], slot_context=1024,
                                           cooldown_s=1.0)) as gw:
            workers = [threading.Thread(target=load, args=(gw.url,)) for _ in range(3)]
            for w in workers:
                w.start()
            time.sleep(1.0)
            before = len(statuses)
            engine.stop(signal.SIGKILL)  # mid-stream: a crash, not a shutdown
            poll_metric(gw.url, "gateway_backend_up", lambda v: v == 0, timeout=5,
                        backend="e0")
            time.sleep(0.5)
            engine = start_llamacpp(binary, model, tmp_path, TWO_SLOTS, port=engine.port)
            poll_metric(gw.url, "gateway_backend_up", lambda v: v == 1, timeout=15,
                        backend="e0")
            deadline = time.monotonic() + 15
            while statuses[-1:] != [200] and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)
            stop.set()
            for w in workers:
                w.join(20)
            assert not any(w.is_alive() for w in workers), "a request is stuck"
            assert chat(gw.url, 8).status == 200
            try:
                s = quiet(gw.url)
            except AssertionError as exc:
                # Seen once in a clean-clone run (one request held before its first token,
                # 5 s after every caller had its answer): say which, for the next time.
                raise AssertionError(f"{exc}; statuses {statuses}; gateway log:\n"
                                     f"{gw.log()[-6000:]}") from None
        assert metric(s, "gateway_kv_reserved_blocks") == 0
        assert 200 in statuses[:before] and statuses[-1] == 200
        # Cut streams are 502, no backend while it is down 503: never a 500, never a drop.
        assert set(statuses) <= {200, 502, 503}, sorted(set(statuses))
        assert 503 in statuses[before:] or 502 in statuses[before:]
    finally:
        stop.set()
        engine.stop()


def test_without_metrics_the_slots_still_bind(
        llama_server: tuple[Path, Path],
        start_gateway: StartGateway, tmp_path: Path) -> None:
    """A llama-server started without --metrics answers /metrics with 501: its load is
    unknown, but /props still gives its slots, so the gateway still holds it there."""
    binary, model = llama_server
    shape = EngineShape(slots=2, slot_context=1024, metrics=False)
    with run_llamacpp(binary, model, tmp_path, shape) as engine, \
            start_gateway(llamacpp_policy([engine.url], slot_context=1024)) as gw:
        assert http("GET", engine.url + "/metrics").status == 501
        est = http("POST", gw.url + "/gateway/estimate",
                   {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 8}).json()
        b = est["decision"]["backends"]["e0"]
        assert b["capacity_blocks"] == 128 and b["slot_blocks"] == 64
        assert b["engine"]["slots"] == 2 and b["engine"]["running"] is None
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: chat(gw.url, 300), range(4)))
        assert [r.status for r in replies] == [200] * 4
        assert sorted(r.headers["x-gateway-decision"] for r in replies).count("queued") >= 1
        quiet(gw.url)


def test_a_machine_without_a_compiler_is_told_why(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the build is impossible the tool says what is missing (exit 2), which the suite
    turns into a skip with that reason; nothing is downloaded."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("bash", "mkdir", "flock"):
        found = shutil.which(name)
        assert found is not None
        (tools / name).symlink_to(found)
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    with pytest.raises(BuildImpossible, match="'cmake' is not installed"):
        llama_server_binary()
    assert cached_binary() is None
