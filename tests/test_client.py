"""The streaming load client against the benchmark stub engine, a real subprocess on loopback.

Timing checks are loose on purpose: they catch a client that times the wrong thing (headers
instead of the first token, a read instead of an event), not a slow machine.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from loadtest.client import (
    RequestSpec,
    StreamClient,
    chat_request,
    completion_request,
    run_closed,
    run_open,
)
from loadtest.stats import median, percentile
from tests.servers import Server, free_port, run_server

pytestmark = pytest.mark.timeout(60)

TTFT_S = 0.05
ITL_S = 0.01


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("stub")
    args = [sys.executable, "benchmarks/stub_engine.py", "--port", "{port}",
            "--ttft-ms", str(TTFT_S * 1e3), "--itl-ms", str(ITL_S * 1e3)]
    with run_server(args, "/health", tmp, "stub") as server:
        yield server




def test_chat_stream_counts_every_event_and_times_the_first_token(stub: Server) -> None:
    async def go() -> None:
        async with StreamClient(stub.url) as client:
            r = await client.send(chat_request("bench-model", "hello", 20))
        assert r.ok, r.error
        # vLLM's shape: role frame, 20 tokens, usage, [DONE].
        assert r.events == 23
        assert r.usage is not None and r.usage.completion_tokens == 20
        assert r.ttft_s is not None and TTFT_S * 0.9 <= r.ttft_s < TTFT_S + 0.5
        # Tokens may share a read on a busy machine, never arrive as more reads than tokens.
        assert 1 <= len(r.gaps_s) <= 19
        assert r.max_gap_s == max(r.gaps_s)
        assert 0.5 * ITL_S <= median(r.gaps_s) < 10 * ITL_S
        assert r.e2e_s >= TTFT_S + 19 * ITL_S * 0.9
        assert client.events_total == 23
    asyncio.run(go())


def test_completions_stream_without_usage(stub: Server) -> None:
    async def go() -> None:
        async with StreamClient(stub.url) as client:
            r = await client.send(completion_request("bench-model", "hello", 5,
                                                     include_usage=False))
        assert r.ok, r.error
        assert r.events == 6  # 5 tokens and [DONE]; completions have no role frame
        assert r.usage is None
        assert r.ttft_s is not None and r.ttft_s >= TTFT_S * 0.9
    asyncio.run(go())


def test_non_stream_response_reads_usage_from_the_body(stub: Server) -> None:
    async def go() -> None:
        async with StreamClient(stub.url) as client:
            r = await client.send(chat_request("bench-model", "hello", 4, stream=False))
        assert r.ok, r.error
        assert r.events == 0
        assert r.usage is not None and r.usage.completion_tokens == 4
        assert r.e2e_s >= TTFT_S + 3 * ITL_S * 0.9
    asyncio.run(go())


def test_error_status_keeps_the_openai_message(stub: Server) -> None:
    async def go() -> None:
        async with StreamClient(stub.url) as client:
            r = await client.send(chat_request("bench-model", "hello", 0,
                                               extra={"max_tokens": -1}))
        assert r.status == 400
        assert r.error == "max_tokens must be at least 1"
        assert not r.ok and r.ttft_s is None
    asyncio.run(go())


def test_connection_refused_is_a_result_not_an_exception() -> None:
    async def go() -> None:
        async with StreamClient(f"http://127.0.0.1:{free_port()}", timeout_s=5) as client:
            r = await client.send(chat_request("bench-model", "hello", 4))
        assert r.status == 0
        assert r.error is not None and "Connect" in r.error
    asyncio.run(go())


def test_closed_loop_holds_concurrency_and_stops_at_count(stub: Server) -> None:
    async def go() -> None:
        async with StreamClient(stub.url) as client:
            run = await run_closed(client, chat_request("bench-model", "hi", 5),
                                   concurrency=10, count=30, duration_s=10)
        assert len(run.results) == 30 and not run.errors()
        assert run.events == 30 * 8
        # Three rounds of ~0.09 s each with 10 in flight, not 30 sequential requests (~2.7 s).
        assert run.wall_s < 2.0
        assert 0.0 <= run.cpu_fraction <= 2.0
        assert len(run.ttfts()) == 30
    asyncio.run(go())


def test_closed_loop_stops_at_the_deadline(stub: Server) -> None:
    async def go() -> None:
        async with StreamClient(stub.url) as client:
            run = await run_closed(client, chat_request("bench-model", "hi", 5),
                                   concurrency=2, count=10_000, duration_s=0.3)
        # Each request takes ~0.09 s: a handful per worker, then the in-flight ones finish.
        assert 2 <= len(run.results) <= 20
        assert run.wall_s < 1.5
    asyncio.run(go())


def test_open_loop_sends_at_the_rate_whatever_finishes(stub: Server) -> None:
    async def go() -> None:
        async with StreamClient(stub.url) as client:
            run = await run_open(client, lambda i: chat_request("bench-model", f"q{i}", 30),
                                 rate=50, count=10_000, duration_s=0.5)
        # 0.5 s at 50/s: 26 arrivals (t = 0, 0.02 .. 0.5); each stream lasts ~0.34 s, so a
        # closed loop could not have started them all.
        assert 24 <= len(run.results) <= 26 and not run.errors()
        starts = sorted(r.start_s for r in run.results)
        assert starts[-1] - starts[0] == pytest.approx(0.5, abs=0.1)
        assert run.dropped == 0
    asyncio.run(go())


def test_open_loop_drops_arrivals_over_the_in_flight_cap(stub: Server) -> None:
    async def go() -> None:
        async with StreamClient(stub.url) as client:
            run = await run_open(client, chat_request("bench-model", "hi", 50), rate=100,
                                 count=20, duration_s=5, max_in_flight=5)
        # Streams last ~0.54 s and arrive every 10 ms: only the first 5 find room.
        assert len(run.results) == 5
        assert run.dropped == 15
    asyncio.run(go())


# A stand-in for a gateway that refuses, and for an engine that fails mid-stream.
async def _odd_server(port: int) -> web.AppRunner:
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
        # Events cut at awkward places, and an empty role frame 50 ms before the first token.
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for part in (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n',
                     b'\n', b'data: {"choices":[{"delta":{"content":"a"}}]}\n',
                     b'\ndata: {"choices":[{"delta":{"cont',
                     b'ent":"b"}}]}\n\ndata: [DONE]\n\n'):
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


def test_retry_after_queue_header_stream_errors_and_split_events() -> None:
    async def go() -> None:
        port = free_port()
        runner = await _odd_server(port)
        try:
            async with StreamClient(f"http://127.0.0.1:{port}") as client:
                busy = await client.send(RequestSpec("/busy", b"{}"))
                broken = await client.send(RequestSpec("/broken", b"{}"))
                cut = await client.send(RequestSpec("/cut", b"{}"))
                split = await client.send(RequestSpec("/split", b"{}"))
        finally:
            await runner.cleanup()
        assert (busy.status, busy.error) == (429, "pool default is full")
        assert busy.retry_after_s == 2.0 and busy.queue_ms == 12.5
        assert broken.status == 200 and broken.error == "engine died" and not broken.ok
        assert broken.ttft_s is not None and broken.events == 3
        assert cut.error == "stream ended before data: [DONE]"
        assert split.ok and split.events == 4
        # The first token is in the third write, 100 ms in; the role frame does not count.
        assert split.ttft_s is not None and split.ttft_s >= 0.09
    asyncio.run(go())


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(map(float, range(101))), 99) == 99.0
    with pytest.raises(ValueError, match=r"within 0\.\.100"):
        percentile([1.0], 101)
