"""The forwarder's own HTTP/1.1 client (gateway/http1.py) against engines that misbehave.

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

import aiohttp
import pytest
import uvloop

from gateway.engine_errors import public
from gateway.http1 import HIGH_WATER, EnginePool, Response, Target, target_of

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
    uvloop.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


def target(port: int, auth: str | None = None) -> Target:
    t = target_of(f"http://127.0.0.1:{port}/v1/chat/completions", auth)
    assert t is not None
    return t


class Pool(EnginePool):
    """The pool with the timeouts a test gives it, as the forwarder passes the policy's."""

    def __init__(self, limit: int, read_timeout_s: float) -> None:
        super().__init__(limit, keepalive_s=4.0)
        self.read_timeout_s = read_timeout_s

    async def post(self, target: Target, request_id: str, body: bytes,  # type: ignore[override]
                   connect_timeout_s: float = 2.0, read_timeout_s: float | None = None
                   ) -> Response:
        return await super().post(target, request_id, body, connect_timeout_s,
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
        with pytest.raises(aiohttp.ClientConnectorError) as err:
            await p.post(target(port), "r", b"{}")
        assert public(err.value) == "connection refused or unreachable"
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
            with pytest.raises(aiohttp.ServerDisconnectedError) as err:
                await p.post(target(port), "r", b"{}")
            assert public(err.value) == "the engine closed the connection"
        async with engine(reset) as (port, _):
            with pytest.raises(aiohttp.ClientOSError) as os_err:
                await p.post(target(port), "r", b"{}")
            assert not isinstance(os_err.value, aiohttp.ServerDisconnectedError)
            assert public(os_err.value) == "the engine reset the connection"
        await p.close()
    run(main())


def test_cut_body_and_malformed_answer() -> None:
    async def main() -> None:
        cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this"
        async with engine(replies(cut, then_close=True)) as (port, _):
            p = pool()
            resp = await p.post(target(port), "r", b"{}")
            with pytest.raises(aiohttp.ClientPayloadError) as err:
                await resp.read()
            assert public(err.value) == "the answer was cut off"
        async with engine(replies(b"NOT HTTP AT ALL\r\n\r\n")) as (port, _):
            with pytest.raises(aiohttp.ClientError):
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
            with pytest.raises(TimeoutError) as err:
                await p.post(target(port), "r", b"{}")
            assert isinstance(err.value, aiohttp.SocketTimeoutError)
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
