"""The gateway's server (uvicorn's httptools protocol inside gateway/serving/guard.py) as ASGI
apps see it: keep-alive, pipelining, Expect: 100-continue, HEAD, request bodies chunked and past
the read buffer, flow control toward a slow reader, disconnects, apps that fail, and request
bodies that never come or are malformed (issue 43), all through the guard.

A small ASGI app stands in for the gateway, served on a loopback socket in this process, and
raw sockets talk to it: the point is the bytes on the wire. The head's limits (size, time) are
tested against the gateway itself in tests/test_edge_limits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.serving.guard import LINGER_S, ConnectionGuard
from gateway.serving.server import ConnectionLimits
from tests.in_process import served as in_process

BIG = 4 * 1024 * 1024


class App:
    """Answers by path; remembers what it saw."""

    def __init__(self) -> None:
        self.saw_disconnect = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("a bug")
        if path == "/silent":
            return
        if path == "/echo":
            body = b""
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.saw_disconnect.set()
                    return
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"%d" % len(body))]})
            await send({"type": "http.response.body", "body": body})
            return
        if path == "/big":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"%d" % BIG)]})
            for _ in range(BIG // 65536):
                await send({"type": "http.response.body", "body": b"x" * 65536,
                            "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/early":
            # The gateway's 401 for a bad key: answered before the body is read.
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"no"})
            return
        if path == "/late":
            # The gateway's 408 for a body that trickles: its own timer, its own answer.
            try:
                async with asyncio.timeout(0.3):
                    while (await receive()).get("more_body"):
                        pass
            except TimeoutError:
                await send({"type": "http.response.start", "status": 408,
                            "headers": [(b"content-length", b"4")]})
                await send({"type": "http.response.body", "body": b"late"})
            return
        if path == "/hold":
            # A stream that lasts until its caller leaves, told through receive().
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass  # the (empty) body, then nothing until the caller leaves
            self.saw_disconnect.set()
            return
        # A stream of three events, chunked.
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if path == "/half":
            await send({"type": "http.response.body", "body": b"data: 1\n\n",
                        "more_body": True})
            raise RuntimeError("a bug mid-stream")
        for i in range(3):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i,
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
async def served() -> AsyncIterator[tuple[App, int]]:
    async with running() as served:
        yield served


@contextlib.asynccontextmanager
async def running(max_concurrency: int | None = None, limits: ConnectionLimits | None = None
                  ) -> AsyncIterator[tuple[App, int]]:
    app = App()
    async with in_process(app, limits or ConnectionLimits(keep_alive_timeout_s=5.0),
                          max_concurrency) as (_, port):
        yield app, port


async def connect(port: int, data: bytes = b""
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the server, with `data` written on it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    return reader, writer


async def reply(reader: asyncio.StreamReader, head_only: bool = False
                ) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response: status, headers, body (by content-length or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head[:-4].split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(b":", 1) for h in lines)}
    if head_only:
        return int(status_line.split()[1]), headers, b""
    if b"content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers[b"content-length"])), 10)
    else:
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10))[:-2], 16)
            data = await asyncio.wait_for(reader.readexactly(size + 2), 10)
            if size == 0:
                break
            body += data[:-2]
    return int(status_line.split()[1]), headers, body


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: x\r\n%s\r\n" % (path.encode(), extra)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s" % (
        path.encode(), len(body), extra, body)


@pytest.mark.anyio
async def test_keep_alive_and_pipelined_requests_are_answered_in_order(
        served: tuple[App, int]) -> None:
    _, port = served
    reader, writer = await connect(port, post("/echo", b"one"))
    assert (await reply(reader))[::2] == (200, b"one")
    # Three at once: each waits for the answer before it.
    writer.write(post("/echo", b"two") + get("/stream") + post("/echo", b"three"))
    assert (await reply(reader))[::2] == (200, b"two")
    status, headers, body = await reply(reader)
    assert (status, headers[b"transfer-encoding"], body) == \
        (200, b"chunked", b"data: 0\n\ndata: 1\n\ndata: 2\n\n")
    assert (await reply(reader))[::2] == (200, b"three")
    writer.close()


@pytest.mark.anyio
async def test_request_bodies_chunked_and_past_the_read_buffer(served: tuple[App, int]) -> None:
    _, port = served
    reader, writer = await connect(port)
    writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert (await reply(reader))[::2] == (200, b"abcde")
    large = bytes(range(256)) * 1024  # 256 KiB: reading pauses past 64 KiB until taken
    writer.write(post("/echo", large))
    assert (await reply(reader))[::2] == (200, large)
    writer.close()


@pytest.mark.anyio
async def test_expect_100_continue_is_answered_when_the_app_reads(
        served: tuple[App, int]) -> None:
    _, port = served
    reader, writer = await connect(port)
    writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n"
                 b"expect: 100-continue\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hello")
    assert (await reply(reader))[::2] == (200, b"hello")
    writer.close()


@pytest.mark.anyio
async def test_head_gets_the_head_alone(served: tuple[App, int]) -> None:
    _, port = served
    reader, writer = await connect(
        port, b"HEAD /stream HTTP/1.1\r\nhost: x\r\n\r\n" + post("/echo", b"after"))
    status, headers, _ = await reply(reader, head_only=True)
    assert status == 200 and b"transfer-encoding" not in headers
    # Nothing of a body followed: the next bytes are the next answer.
    assert (await reply(reader))[::2] == (200, b"after")
    writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/boom", "/silent"])
async def test_an_app_that_fails_before_answering_gets_a_500(
        served: tuple[App, int], path: str) -> None:
    # uvicorn's own answer (text): the gateway's routes answer their own errors in OpenAI's
    # shape and do not fail this way.
    _, port = served
    reader, writer = await connect(port, get(path))
    status, headers, _ = await reply(reader)
    assert status == 500 and headers[b"connection"] == b"close"
    assert await asyncio.wait_for(reader.read(), 10) == b""  # and the connection is closed
    writer.close()


@pytest.mark.anyio
async def test_an_app_that_fails_mid_stream_cuts_the_connection(
        served: tuple[App, int]) -> None:
    _, port = served
    reader, writer = await connect(port, get("/half"))
    rest = await asyncio.wait_for(reader.read(), 10)
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and b"data: 1" in rest
    assert not rest.endswith(b"0\r\n\r\n")  # no end of the chunked body: the caller can tell
    writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("raw", [b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nbad header\r\n\r\n"])
async def test_a_malformed_request_gets_uvicorns_400(served: tuple[App, int],
                                                     raw: bytes) -> None:
    _, port = served
    reader, writer = await connect(port, raw)
    status, headers, body = await reply(reader)
    assert (status, headers[b"connection"]) == (400, b"close")
    assert body == b"Invalid HTTP request received."
    writer.close()


@pytest.mark.anyio
async def test_a_slow_reader_gets_every_byte(served: tuple[App, int]) -> None:
    # The app writes faster than the caller reads: its sends wait (flow control) rather than
    # buffer the whole answer, and nothing is lost.
    _, port = served
    reader, writer = await connect(port, get("/big"))
    await asyncio.sleep(0.3)  # the socket buffers fill; the app's sends are waiting
    status, _, body = await reply(reader)
    assert status == 200 and len(body) == BIG and body.count(b"x") == BIG
    writer.close()


@pytest.mark.anyio
async def test_a_caller_leaving_is_told_to_receive(served: tuple[App, int]) -> None:
    app, port = served
    reader, writer = await connect(port, get("/hold"))
    await asyncio.wait_for(reader.readuntil(b"data: 1\n\n"), 10)
    writer.close()
    await asyncio.wait_for(app.saw_disconnect.wait(), 10)


@pytest.mark.anyio
async def test_served_requests_leave_no_guard_behind(served: tuple[App, int]) -> None:
    # A full collection is the only way out for objects in a reference cycle, and every open
    # stream waits for it: a connection's guard must go by reference count when it closes.
    _, port = served
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            reader, writer = await connect(port)
            writer.write(post("/echo", b"x") + get("/stream"))
            await reply(reader)
            await reply(reader)
            writer.close()
            await writer.wait_closed()
        await asyncio.sleep(0.2)  # the server sees the connections go
        left = [o for o in gc.get_objects() if isinstance(o, ConnectionGuard)]
        assert left == []
    finally:
        gc.enable()


@pytest.mark.anyio
async def test_past_the_servers_own_cap_a_request_gets_a_503_in_openais_shape() -> None:
    # The backstop behind the gateway's own 503 (`server.max_concurrent_requests`): the
    # server's cap on requests in flight, twice that and more in `gateway serve`.
    async with running(max_concurrency=2) as (_, port):
        _, idle = await connect(port)  # idle connections do not count
        holding = [await connect(port, get("/hold")) for _ in range(2)]
        for r, _ in holding:
            await asyncio.wait_for(r.readuntil(b"data: 1\n\n"), 10)
        reader, writer = await connect(port, get("/stream"))
        status, headers, body = await reply(reader)
        assert status == 503 and headers[b"connection"] == b"close"
        assert headers[b"retry-after"] == b"1" and headers[b"x-should-retry"] == b"true"
        assert json.loads(body)["error"]["code"] == "server_busy"
        for w in (idle, writer, *(w for _, w in holding)):
            w.close()


# --- bodies that never come, trickle, or are malformed (issue 43) ----------------------------

# After an answer that ends the connection, the server's end is shut at once; the socket itself
# is closed once the caller closes its end, or after LINGER_S of reading and dropping what still
# comes (so that the caller is not reset before it reads the answer). With slack for a loaded
# machine.
CLOSED_WITHIN_S = 3.0


async def closed(reader: asyncio.StreamReader, within_s: float = CLOSED_WITHIN_S) -> bytes:
    """What the server sent until it closed the connection, failing if it is open past
    `within_s`."""
    try:
        return await asyncio.wait_for(reader.read(), within_s)
    except TimeoutError:
        raise AssertionError(f"the connection is still open after {within_s}s") from None


@pytest.mark.anyio
@pytest.mark.parametrize("raw, status", [
    (get("/stream", b"content-length: 10\r\n"), 200),  # a GET that declares a body
    (post("/early", b"0123456789")[:-7], 401),  # a bad key: answered before the body
], ids=["a GET declaring a body", "a 401 before the body"])
async def test_an_answer_before_the_body_has_come_closes_the_connection(
        served: tuple[App, int], raw: bytes, status: int) -> None:
    """The connection stayed open for ever: no idle timer while a body was due, and the head's
    was done. Now the answer says `connection: close`, and the connection closes."""
    _, port = served
    reader, writer = await connect(port, raw)
    got, headers, _ = await reply(reader)
    assert (got, headers[b"connection"]) == (status, b"close")
    assert await closed(reader) == b""
    writer.close()


@pytest.mark.anyio
async def test_held_connections_no_longer_keep_the_server_at_its_cap() -> None:
    """Each such connection counted against the server's cap for ever: a caller that opened
    enough of them kept every later request at 503."""
    async with running(max_concurrency=2) as (_, port):
        reader, held = await connect(port, get("/stream", b"content-length: 10\r\n"))
        assert (await reply(reader))[0] == 200
        await asyncio.sleep(LINGER_S + 0.5)  # the caller keeps its end open: the server closes
        reader, writer = await connect(port, get("/stream"))
        assert (await reply(reader))[0] == 200
        for w in (held, writer):
            w.close()


@pytest.mark.anyio
async def test_after_an_apps_408_for_a_late_body_the_connection_closes(
        served: tuple[App, int]) -> None:
    """The app's 408 went out without `connection: close` and the connection stayed open, the
    next request read as the rest of the old body. Now it closes, and nothing more is
    answered on it."""
    _, port = served
    reader, writer = await connect(port, post("/late", b"0123456789")[:-7])
    status, headers, body = await reply(reader)
    assert (status, headers[b"connection"], body) == (408, b"close", b"late")
    writer.write(get("/stream"))
    assert await closed(reader) == b""
    writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("chunks", [
    b"ffffffffffffffffff\r\n",  # the chunk size overflows
    b"0x5\r\nhello\r\n0\r\n\r\n",  # a 0x prefix
    b"-1\r\n",
    b"5\r\nhelloXX\r\n0\r\n\r\n",  # no CRLF after the chunk's data
    b"5;ext\nhello\r\n0\r\n\r\n",  # a bare LF in a chunk extension
], ids=["size overflow", "0x prefix", "negative size", "no CRLF after data",
        "bare LF in extension"])
async def test_a_malformed_chunked_body_gets_a_400_and_the_waiting_app_is_told(
        served: tuple[App, int], chunks: bytes) -> None:
    """The parser's error was swallowed while the app waited for the body: a 408 30 s later
    from the gateway, the task and the connection held meanwhile. Now uvicorn's 400 at once,
    the connection closed, and the app's `receive()` says the caller has gone."""
    app, port = served
    reader, writer = await connect(
        port, b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
    await asyncio.sleep(0.1)  # the app waits in receive()
    writer.write(chunks)
    status, headers, body = await reply(reader)
    assert (status, headers[b"connection"], body) == \
        (400, b"close", b"Invalid HTTP request received.")
    await asyncio.wait_for(app.saw_disconnect.wait(), 1)
    assert await closed(reader) == b""
    writer.close()


@pytest.mark.anyio
async def test_what_comes_behind_a_request_being_served_is_bounded() -> None:
    """uvicorn's parser gathers a pipelined request's head without bound while the one before
    it is served: a caller holding a stream open could send headers for ever. The guard cuts the
    connection past `max_header_bytes + max_body_bytes` within one request."""
    limits = ConnectionLimits(max_header_bytes=1024, max_body_bytes=4096, keep_alive_timeout_s=5)
    async with running(limits=limits) as (app, port):
        reader, writer = await connect(port, get("/hold"))
        await asyncio.wait_for(reader.readuntil(b"data: 1\n\n"), 10)
        writer.write(b"GET /stream HTTP/1.1\r\nx-endless: ")
        for _ in range(10):
            writer.write(b"a" * 1000)
        await closed(reader)
        await asyncio.wait_for(app.saw_disconnect.wait(), 1)
        writer.close()
