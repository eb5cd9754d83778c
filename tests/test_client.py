"""The streaming load client against the benchmark stub engine, a real subprocess on loopback,
and the load driver (`loadtest.runner.Runner`) pacing it.

No assertion reads the clock against a figure: on a busy machine any such bound is a guess.
Timing is checked by what must hold whatever the machine's speed (the first token is read after
the server wrote it; gaps fit between the first token and the end), and pacing by counts (the
requests a server held at once, the requests sent) and by timeouts.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import orjson
import pytest
from aiohttp import web

from loadtest.client import (
    RequestSpec,
    StreamClient,
    chat_request,
    completion_request,
)
from loadtest.runner import FixedRequests, LoadShape, Runner
from loadtest.stats import percentile
from loadtest.workload import Arrival
from tests.servers import Server, free_port, run_server

pytestmark = pytest.mark.timeout(60)

TTFT_S = 0.05
ITL_S = 0.01
CONSTANT = Arrival("constant")  # evenly spaced arrivals: the counts below follow from the rate


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("stub")
    args = [sys.executable, "benchmarks/stub_engine.py", "--port", "{port}",
            "--ttft-ms", str(TTFT_S * 1e3), "--itl-ms", str(ITL_S * 1e3)]
    with run_server(args, "/health", tmp, "stub") as server:
        yield server


class Counting:
    """An engine stand-in, in this process, that counts what the driver does to it: requests
    received and the most it held at once. It streams as the stub does (role frame, one event
    per token, usage, [DONE]), each event after a sleep, so streams overlap."""

    def __init__(self) -> None:
        self.requests = 0
        self.active = 0
        self.peak = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.requests += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}'
                             b"\n\n")
            await asyncio.sleep(TTFT_S)
            for _ in range(int(body["max_tokens"])):
                await resp.write(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
                await asyncio.sleep(ITL_S)
            await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":1,'
                             b'"completion_tokens":%d,"total_tokens":%d}}\n\ndata: [DONE]\n\n'
                             % (body["max_tokens"], body["max_tokens"] + 1))
            return resp
        finally:
            self.active -= 1


@asynccontextmanager
async def counting_server() -> AsyncIterator[tuple[str, Counting]]:
    engine = Counting()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        await runner.cleanup()


@pytest.mark.anyio
async def test_chat_stream_counts_every_event_and_times_the_first_token(stub: Server) -> None:
    async with StreamClient(stub.url) as client:
        sent = time.perf_counter()
        r = await client.send(chat_request("bench-model", "hello", 20))
        done = time.perf_counter()
    assert r.ok, r.error
    # vLLM's shape: role frame, 20 tokens, usage, [DONE].
    assert r.events == 23
    assert r.usage is not None and r.usage.completion_tokens == 20
    # That the first token (not the headers or the role frame) stops the TTFT clock is checked
    # against a server that withholds it (the split-events test); here: the figures fit together.
    assert r.ttft_s is not None and 0 < r.ttft_s < r.e2e_s
    # The longest gap began after the first token, on the clock the stall tracer shares.
    assert sent + r.ttft_s <= r.max_gap_at_s < done
    # Tokens may share a read on a busy machine, never arrive as more reads than tokens.
    assert 1 <= len(r.gaps_s) <= 19
    assert r.max_gap_s == max(r.gaps_s)
    # Gaps are measured from the first token on, between reads of this one request.
    assert min(r.gaps_s) > 0
    assert r.ttft_s + sum(r.gaps_s) <= r.e2e_s
    assert client.events_total == 23


@pytest.mark.anyio
async def test_completions_stream_without_usage(stub: Server) -> None:
    async with StreamClient(stub.url) as client:
        r = await client.send(completion_request("bench-model", "hello", 5,
                                                 include_usage=False))
    assert r.ok, r.error
    assert r.events == 6  # 5 tokens and [DONE]; completions have no role frame
    assert r.usage is None
    # `text` is a first token too: 4 gaps after it, for the 4 tokens that follow at most.
    assert r.ttft_s is not None and r.ttft_s < r.e2e_s
    assert 1 <= len(r.gaps_s) <= 4


@pytest.mark.anyio
async def test_non_stream_response_reads_usage_from_the_body(stub: Server) -> None:
    async with StreamClient(stub.url) as client:
        r = await client.send(chat_request("bench-model", "hello", 4, stream=False))
    assert r.ok, r.error
    assert r.events == 0
    # The whole body was read before the clock stopped: its usage counts all 4 tokens.
    assert r.usage is not None and r.usage.completion_tokens == 4
    assert r.ttft_s is not None and r.ttft_s <= r.e2e_s


@pytest.mark.anyio
async def test_error_status_keeps_the_openai_message(stub: Server) -> None:
    async with StreamClient(stub.url) as client:
        r = await client.send(chat_request("bench-model", "hello", 0,
                                           extra={"max_tokens": -1}))
    assert r.status == 400
    assert r.error == "max_tokens must be at least 1"
    assert not r.ok and r.ttft_s is None


@pytest.mark.anyio
async def test_connection_refused_is_a_result_not_an_exception() -> None:
    async with StreamClient(f"http://127.0.0.1:{free_port()}", timeout_s=5) as client:
        r = await client.send(chat_request("bench-model", "hello", 4))
    assert r.status == 0
    assert r.error is not None and "Connect" in r.error


@pytest.mark.anyio
async def test_closed_loop_holds_concurrency_and_stops_at_count() -> None:
    async with counting_server() as (url, engine):
        run = await Runner([url], FixedRequests(chat_request("bench-model", "hi", 5)),
                           LoadShape(concurrency=10, max_requests=30, duration_s=10,
                                     ramp_s=0)).run()
    assert len(run.results) == 30 and not run.failed()
    assert run.chunks == 30 * 8
    # 10 in flight together, never more, and not 30 one after another; 30 sent, no more.
    assert engine.peak == 10
    assert engine.requests == 30
    assert 0.0 <= run.cpu_fraction <= 2.0
    assert len(run.ttfts()) == 30


@pytest.mark.anyio
async def test_closed_loop_stops_at_the_deadline(stub: Server) -> None:
    # 10,000 requests of ~0.09 s two at a time would take ~450 s: ending within the timeout
    # means the deadline, not the count, stopped the run.
    with anyio.fail_after(10):
        run = await Runner([stub.url], FixedRequests(chat_request("bench-model", "hi", 5)),
                           LoadShape(concurrency=2, max_requests=10_000, duration_s=0.3,
                                     ramp_s=0)).run()
    # Each request takes ~0.09 s: a handful per worker, then the in-flight ones finish.
    assert 2 <= len(run.results) <= 20


@pytest.mark.anyio
async def test_open_loop_sends_at_the_rate_whatever_finishes() -> None:
    async with counting_server() as (url, engine):
        run = await Runner(
            [url], FixedRequests(lambda i: chat_request("bench-model", f"q{i}", 30)),
            LoadShape(rate=50, arrival=CONSTANT, max_requests=10_000, duration_s=0.5)).run()
    # 0.5 s at 50/s: 26 arrivals (t = 0, 0.02 .. 0.5); each stream lasts at least 0.35 s
    # (the engine sleeps), so ~17 are running when the 18th is sent: sending never waited
    # for an answer, as a closed loop would.
    assert 24 <= len(run.results) <= 26 and not run.failed()
    assert engine.requests == len(run.results)
    assert engine.peak >= 10
    assert run.dropped == 0


@pytest.mark.anyio
async def test_open_loop_drops_arrivals_over_the_in_flight_cap(stub: Server) -> None:
    run = await Runner([stub.url], FixedRequests(chat_request("bench-model", "hi", 50)),
                       LoadShape(rate=100, arrival=CONSTANT, max_requests=20, duration_s=5,
                                 max_in_flight=5)).run()
    # Streams last ~0.54 s and arrive every 10 ms: only the first 5 find room.
    assert len(run.results) == 5
    assert run.dropped == 15


# A stand-in for a gateway that refuses, and for an engine that fails mid-stream. `/split`
# sends its role frame, sets `role_sent`, and withholds its first token until `release`.
async def _odd_server(port: int, role_sent: asyncio.Event,
                      release: asyncio.Event) -> web.AppRunner:
    async def busy(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "pool default is full", "type": "overloaded",
                       "param": None, "code": "queue_full"}},
            status=429, headers={"Retry-After": "2", "x-gateway-queue-ms": "12.5"})

    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
        await resp.write(b'data: {"error":{"message":"engine died","type":"upstream",'
                         b'"param":null,"code":502}}\n\ndata: [DONE]\n\n')
        return resp

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
        return resp

    async def split(request: web.Request) -> web.StreamResponse:
        # Events cut at awkward places (each part its own read, the sleeps see to that), and an
        # empty role frame before the first token.
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i, part in enumerate((
                b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n',
                b'\n', b'data: {"choices":[{"delta":{"content":"a"}}]}\n',
                b'\ndata: {"choices":[{"delta":{"cont',
                b'ent":"b"}}]}\n\ndata: [DONE]\n\n')):
            if i == 2:
                role_sent.set()
                await release.wait()
            await resp.write(part)
            await asyncio.sleep(0.05)
        return resp

    app = web.Application()
    app.router.add_post("/split", split)
    app.router.add_post("/busy", busy)
    app.router.add_post("/broken", broken)
    app.router.add_post("/cut", cut)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.mark.anyio
async def test_retry_after_queue_header_stream_errors_and_split_events() -> None:
    port = free_port()
    role_sent, release = asyncio.Event(), asyncio.Event()
    runner = await _odd_server(port, role_sent, release)
    try:
        async with StreamClient(f"http://127.0.0.1:{port}") as client:
            busy = await client.send(RequestSpec("/busy", b"{}"))
            broken = await client.send(RequestSpec("/broken", b"{}"))
            cut = await client.send(RequestSpec("/cut", b"{}"))
            sent_at = time.perf_counter()
            pending = asyncio.create_task(client.send(RequestSpec("/split", b"{}"),
                                                      run_start=sent_at))
            with anyio.fail_after(10):
                await role_sent.wait()
            released_at = time.perf_counter()
            release.set()
            split = await pending
    finally:
        await runner.cleanup()
    assert (busy.status, busy.error) == (429, "pool default is full")
    assert busy.retry_after_s == 2.0 and busy.queue_ms == 12.5
    assert broken.status == 200 and broken.error == "engine died" and not broken.ok
    assert broken.ttft_s is not None and broken.events == 3
    assert cut.error == "stream ended before data: [DONE]"
    assert split.ok and split.events == 4
    # The first token is in the third write, which the server sent only once released: the
    # clock stopped after that, not at the role frame before it.
    assert split.ttft_s is not None
    assert sent_at + split.start_s + split.ttft_s >= released_at


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(map(float, range(101))), 99) == 99.0
    with pytest.raises(ValueError, match=r"within 0\.\.100"):
        percentile([1.0], 101)
