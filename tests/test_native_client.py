"""The forwarder's own HTTP/1.1 client (gateway/upstream/native.py) against engines that misbehave.

Each engine here is a real listening socket on loopback that answers with the bytes a test
scripts (chunked, sized, read to close, cut, reset, silent, malformed), so the client meets on
the wire what a real engine can send; the whole gateway over the client is the rest of the
suite's (it is the forwarder's default).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from gateway.upstream.errors import (
    BrokeOff,
    ClosedBeforeAnswer,
    CutBody,
    EngineFailure,
    Malformed,
    Silent,
    Unreachable,
)
from gateway.upstream.native import HIGH_WATER, EnginePool, Response, Target, target_of

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK_CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
              b"transfer-encoding: chunked\r\n\r\n"
              b"7\r\ndata: 1\r\n7\r\ndata: 2\r\n0\r\n\r\n")
OK_SIZED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request, head and body (it always has a content-length here)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head + await reader.readexactly(length)


@contextlib.asynccontextmanager
async def engine(handler: Handler) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A scripted engine on a free loopback port: (port, the requests it read)."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def recording(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def read() -> bytes:
            request = await read_request(reader)
            seen.append(request)
            return request
        writer.read_request = read  # type: ignore[attr-defined]
        await serve(reader, writer)

    server = await asyncio.start_server(recording, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, seen
    finally:
        server.close()


def replies(*answers: bytes, then_close: bool = False) -> Handler:
    """An engine that answers each request on a connection with the next of `answers`."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await writer.read_request()  # type: ignore[attr-defined]
            writer.write(answer)
            await writer.drain()
        if not then_close:
            await reader.read()  # keep the connection until the client closes it
    return handle


def run(coro: Awaitable[None]) -> None:
    uvloop.run(asyncio.wait_for(coro, 20))


def target(port: int, auth: str | None = None) -> Target:
    t = target_of(f"http://127.0.0.1:{port}/v1/chat/completions", auth)
    assert t is not None
    return t


class Pool(EnginePool):
    """The pool with the timeouts a test gives it, as the forwarder passes the policy's."""

    def __init__(self, limit: int, read_timeout_s: float) -> None:
        super().__init__(limit, keepalive_s=4.0)
        self.read_timeout_s = read_timeout_s

    async def post(self, target: Target, request_id: str, body: bytes,
                   connect_timeout_s: float = 2.0, read_timeout_s: float | None = None
                   ) -> Response:
        return await super().post_target(target, request_id, body, connect_timeout_s,
                                  read_timeout_s or self.read_timeout_s)


def pool(limit: int = 8, read_timeout_s: float = 5.0) -> Pool:
    return Pool(limit, read_timeout_s)


def test_which_urls_it_serves() -> None:
    assert target_of("http://engine:8000/v1/chat/completions", None) is not None
    assert target_of("http://[::1]:8000/v1/completions", None) is not None
    for url in ("https://engine/v1/chat/completions", "http://user:pw@engine/v1/completions",
                "unix:///tmp/s", "not a url"):
        assert target_of(url, None) is None, url


def test_request_on_the_wire_and_keepalive_reuse() -> None:
    async def main() -> None:
        async with engine(replies(OK_CHUNKED, OK_SIZED)) as (port, seen):
            p = pool()
            resp = await p.post(target(port, "Bearer k"), "req-1", b'{"a":1}')
            assert resp.status == 200
            # Names in lower case, as the engine's `Content-Type` or `content-type` may come.
            assert resp.headers["content-type"] == "text/event-stream"
            chunks = []
            async with resp:
                while chunk := await resp.content.readany():
                    chunks.append(chunk)
            assert b"".join(chunks) == b"data: 1data: 2"
            second = await p.post(target(port, "Bearer k"), "req-2", b"{}")
            assert await second.read() == b"{}"
            # Both on one connection, each whole and as aiohttp would have sent it.
            assert len(seen) == 2
            head, _, body = seen[0].partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
            assert set(lines[1:]) == {f"Host: 127.0.0.1:{port}".encode(),
                                      b"content-type: application/json",
                                      b"accept-encoding: identity", b"authorization: Bearer k",
                                      b"x-request-id: req-1", b"content-length: 7"}
            assert body == b'{"a":1}'
            await p.close()
    run(main())


def test_a_caller_who_leaves_closes_the_connection() -> None:
    """A stream released before its end is not reused: closing it is how the engine learns to
    stop (vLLM aborts a request whose connection closes)."""
    async def main() -> None:
        closed = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await writer.read_request()  # type: ignore[attr-defined]
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"7\r\ndata: 1\r\n")
            await writer.drain()
            await reader.read()
            closed.set()

        async with engine(handle) as (port, _):
            p = pool()
            resp = await p.post(target(port), "r", b"{}")
            assert await resp.content.readany() == b"data: 1"
            resp.release()
            await asyncio.wait_for(closed.wait(), 5)
            await p.close()
    run(main())


def test_answer_read_to_close_and_interim_answers() -> None:
    async def main() -> None:
        answer = (b"HTTP/1.1 100 Continue\r\n\r\n"
                  b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"x\": 1}")
        async with engine(replies(answer, then_close=True)) as (port, _):
            p = pool()
            resp = await p.post(target(port), "r", b"{}")
            assert resp.status == 200
            assert await resp.read() == b'{"x": 1}'
            await p.close()
    run(main())


def test_refused_connect() -> None:
    async def main() -> None:
        async with engine(replies()) as (port, _):
            pass  # closed: nothing listens there now
        p = pool()
        with pytest.raises(Unreachable) as err:
            await p.post(target(port), "r", b"{}")
        assert err.value.public == "connection refused or unreachable"
        assert f"127.0.0.1:{port}" in str(err.value)
        await p.close()
    run(main())


def test_closed_before_answering_and_reset() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await writer.read_request()  # type: ignore[attr-defined]

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await writer.read_request()  # type: ignore[attr-defined]
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # with linger 0: a reset, not a close

    async def main() -> None:
        async with engine(close_at_once) as (port, _):
            p = pool()
            with pytest.raises(ClosedBeforeAnswer) as err:
                await p.post(target(port), "r", b"{}")
            assert err.value.public == "the engine closed the connection"
        async with engine(reset) as (port, _):
            with pytest.raises(BrokeOff) as os_err:
                await p.post(target(port), "r", b"{}")
            assert os_err.value.public == "the engine reset the connection"
        await p.close()
    run(main())


def test_cut_body_and_malformed_answer() -> None:
    async def main() -> None:
        cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this"
        async with engine(replies(cut, then_close=True)) as (port, _):
            p = pool()
            resp = await p.post(target(port), "r", b"{}")
            with pytest.raises(CutBody) as err:
                await resp.read()
            assert err.value.public == "the answer was cut off"
        async with engine(replies(b"NOT HTTP AT ALL\r\n\r\n")) as (port, _):
            with pytest.raises(EngineFailure):
                await p.post(target(port), "r", b"{}")
        await p.close()
    run(main())


def test_silent_engine_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await writer.read_request()  # type: ignore[attr-defined]
        await reader.read()

    async def main() -> None:
        async with engine(silent) as (port, _):
            p = pool(read_timeout_s=0.3)
            started = asyncio.get_running_loop().time()
            with pytest.raises(Silent):
                await p.post(target(port), "r", b"{}")
            assert 0.25 < asyncio.get_running_loop().time() - started < 3
            await p.close()
    run(main())


def test_idle_connection_the_engine_closed_is_not_reused() -> None:
    async def main() -> None:
        async with engine(replies(OK_SIZED, then_close=True)) as (port, seen):
            p = pool()
            assert await (await p.post(target(port), "a", b"{}")).read() == b"{}"
            await asyncio.sleep(0.2)  # the engine has closed it meanwhile
            assert await (await p.post(target(port), "b", b"{}")).read() == b"{}"
            assert len(seen) == 2
            await p.close()
    run(main())


def test_flow_control_pauses_the_engine() -> None:
    """A caller that does not read holds the engine back at the high-water mark, rather than
    the gateway buffering the engine's whole answer."""
    async def main() -> None:
        sent = 0
        stuck = asyncio.Event()

        async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal sent
            await writer.read_request()  # type: ignore[attr-defined]
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            piece = b"%x\r\n%s\r\n" % (1 << 14, b"x" * (1 << 14))
            for _ in range(2000):  # 32 MiB if nothing held it back
                writer.write(piece)
                try:
                    await asyncio.wait_for(writer.drain(), 0.5)
                except TimeoutError:
                    stuck.set()
                    return
                sent += 1 << 14

        async with engine(flood) as (port, _):
            p = pool()
            resp = await p.post(target(port), "r", b"{}")
            await asyncio.wait_for(stuck.wait(), 10)
            # What was sent sits in the client's buffer and both kernels' socket buffers.
            assert sent < 64 * HIGH_WATER
            assert len(await resp.content.readany()) <= 2 * HIGH_WATER
            resp.close()
            await p.close()
    run(main())


def test_connection_limit_queues_requests() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        active = 0
        most = 0

        async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal active, most
            while True:
                await writer.read_request()  # type: ignore[attr-defined]
                active += 1
                most = max(most, active)
                await gate.wait()
                active -= 1
                writer.write(OK_SIZED)
                await writer.drain()

        async with engine(slow) as (port, seen):
            p = pool(limit=2)

            async def one(i: int) -> bytes:
                return await (await p.post(target(port), f"r{i}", b"{}")).read()

            tasks = [asyncio.create_task(one(i)) for i in range(5)]
            await asyncio.sleep(0.3)
            assert len(seen) == 2  # the other three wait for a connection
            gate.set()
            assert await asyncio.gather(*tasks) == [b"{}"] * 5
            assert most <= 2
            await p.close()
    run(main())


def test_request_id_with_a_line_break_is_refused() -> None:
    async def main() -> None:
        async with engine(replies(OK_SIZED)) as (port, seen):
            p = pool()
            with pytest.raises(ValueError):
                await p.post(target(port), "a\r\nx-evil: 1", b"{}")
            assert await (await p.post(target(port), "ok", b"{}")).read() == b"{}"
            assert len(seen) == 1
            await p.close()
    run(main())


def test_bytes_after_the_answer_end_its_connection() -> None:
    """An answer followed by more than it said (here the start of another) leaves the
    connection at an unknown point of the engine's output: a later request on it would read
    the rest as its own answer's start, and fail. It is closed instead; the caller keeps its
    answer, and the next request gets a fresh connection."""
    async def main() -> None:
        connections = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            await replies(OK_SIZED + b"HTTP/1.1 2", OK_SIZED)(reader, writer)

        async with engine(handle) as (port, seen):
            p = pool()
            assert await (await p.post(target(port), "a", b"{}")).read() == b"{}"
            assert await (await p.post(target(port), "b", b"{}")).read() == b"{}"
            assert len(seen) == 2
            assert connections == 2
            await p.close()
    run(main())


def flood_head(lines: Callable[[int], bytes], size: int,
               sent: list[int], finished: asyncio.Event) -> Handler:
    """An engine that answers with a head of `size` bytes made of `lines(i)` (as much as a
    client will read of it), counting in `sent` what it wrote."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.read_request()  # type: ignore[attr-defined]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n")
            i = 0
            while sent[0] < size:
                piece = b"".join(lines(i + j) for j in range(256))
                i += 256
                writer.write(piece)
                await writer.drain()
                sent[0] += len(piece)
            writer.write(b"\r\n{}")
            await writer.drain()
            await reader.read()
        finally:
            finished.set()
    return handle


def test_a_head_past_aiohttps_limits_is_refused() -> None:
    """A head past what aiohttp's ClientSession takes (8190 bytes a header, 128 headers) fails
    the request as a malformed answer, and reading stops there: a head without end (one
    header of 10 MB, 50 MB of distinct names) is not gathered in memory."""
    async def main() -> None:
        one_header = b"x-big: " + b"a" * (10 << 20) + b"\r\n"
        for lines, size, why in (
                (lambda i: one_header[i * 4096:(i + 1) * 4096], len(one_header), "a line longer"),
                (lambda i: b"x-h-%08d: 1\r\n" % i, 50 << 20, "more than 128 headers")):
            sent, finished = [0], asyncio.Event()
            async with engine(flood_head(lines, size, sent, finished)) as (port, _):
                p = pool()
                with pytest.raises(Malformed) as err:
                    await p.post(target(port), "r", b"{}")
                assert why in str(err.value)
                assert err.value.public == "a malformed answer"
                await asyncio.wait_for(finished.wait(), 5)
                assert sent[0] < size  # cut off, not read to its end
                await p.close()
    run(main())


def test_a_head_at_aiohttps_limits_is_taken() -> None:
    """aiohttp's limits exactly: a header's name and value 8190 bytes together, 128 headers
    (the content-length among them); one byte or one header more is refused."""
    def answer(count: int, extra: int) -> bytes:
        fields = [b"x-%03d: " % i + b"v" * (8190 - 5) for i in range(count - 1)]
        fields[0] += b"v" * extra
        return b"HTTP/1.1 200 OK\r\n" + b"\r\n".join(fields) + b"\r\ncontent-length: 2\r\n\r\n{}"

    async def main() -> None:
        async with engine(replies(answer(128, 0))) as (port, _):
            p = pool()
            resp = await p.post(target(port), "r", b"{}")
            assert len(resp.headers) == 128 and len(resp.headers["x-000"]) == 8190 - 5
            assert await resp.read() == b"{}"
        for count, extra, why in ((129, 0, "more than 128 headers"),
                                  (128, 1, "a header longer than 8190 bytes")):
            async with engine(replies(answer(count, extra))) as (port, _):
                with pytest.raises(Malformed) as err:
                    await p.post(target(port), "r", b"{}")
                assert why in str(err.value)
        await p.close()
    run(main())


def test_a_protocol_switch_or_unknown_interim_answer_ends_its_connection() -> None:
    """An engine does not switch protocols, nor send an interim answer other than 100
    Continue and 103 Early Hints. Such a status is handed over as the answer, with no body, as
    aiohttp hands over a 101, for the forwarder to refuse (a 502 in OpenAI's shape, nothing
    relayed); what follows it is not read, the connection is closed at once, and no traceback
    is logged."""
    async def main() -> None:
        errors: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        switch = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                  b"Connection: upgrade\r\n\r\nnot http any more")
        processing = b"HTTP/1.1 102 Processing\r\n\r\n" + OK_SIZED
        for status, answer in ((101, switch), (102, processing)):
            closed = asyncio.Event()

            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             answer: bytes = answer, closed: asyncio.Event = closed) -> None:
                await writer.read_request()  # type: ignore[attr-defined]
                writer.write(answer)
                await reader.read()
                closed.set()

            async with engine(handle) as (port, _):
                p = pool()
                resp = await p.post(target(port), "r", b"{}")
                assert resp.status == status
                await asyncio.wait_for(closed.wait(), 5)  # before the caller is done with it
                assert await resp.read() == b""
                await p.close()
        assert errors == []
        # The interim answers an engine may send still pass.
        early = b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n" + OK_SIZED
        async with engine(replies(early)) as (port, _):
            p = pool()
            resp = await p.post(target(port), "r", b"{}")
            assert resp.status == 200 and "link" not in resp.headers
            assert await resp.read() == b"{}"
            await p.close()
    run(main())


def test_answer_headers_are_exposed_for_the_forwarder() -> None:
    """An encoding the client did not ask for (it sends `accept-encoding: identity`) shows in
    the headers, for the forwarder to refuse."""
    async def main() -> None:
        gzip = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\ncontent-length: 2\r\n\r\n{}"
        async with engine(replies(gzip)) as (port, _):
            p = pool()
            resp = await p.post(target(port), "r", b"{}")
            assert resp.headers.get("content-encoding") == "gzip"
            await resp.read()
            await p.close()
    run(main())
