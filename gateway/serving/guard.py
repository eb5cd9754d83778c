"""The limits a public endpoint needs that uvicorn's own HTTP/1.1 protocol lacks, kept around
it rather than in a protocol of the gateway's own.

uvicorn's httptools protocol (0.55) arms no timer on a connection until its first answer, the
first byte of a request cancels its keep-alive timer, and its parser bounds no head. So a
caller could hold a connection for ever by sending nothing, or a byte now and then, and send a
head of any size; and uvicorn's own concurrency cap counts idle connections, so enough of them
held every request at its 503. Two guards close that:

- at the socket, `ConnectionGuard` (around uvicorn's protocol, which sees every byte as
  before): a request's head comes whole within `header_timeout_s` of the connection's opening,
  or of its first byte after an answer, else a 408 (a silent close where nothing came); a head
  is at most `max_header_bytes`, else a 431. Both in OpenAI's error shape, after which what
  still comes is read and dropped for `LINGER_S` (closing with unread bytes resets the
  connection, and the caller could lose the answer) and the connection closes. While a request
  is served, what comes on its connection (its body, requests pipelined behind it, whose heads
  uvicorn's parser gathers unbounded) is cut past `max_header_bytes + max_body_bytes`;
- at ASGI, `GuardedApp` (around the app): it tells the socket guard when a request starts and
  when its answer ends (the next bytes are a new head), adds `connection: close` to an answer
  that starts before the request's body has all come (uvicorn then closes the connection
  rather than read a rest that may never come), and answers past `max_requests` in flight
  with a 503 in OpenAI's shape, counting requests, not connections.

What uvicorn does itself: an idle keep-alive connection closes after `timeout_keep_alive`; a
request or body it cannot parse (a bad chunk size) is its own 400 (text/plain, "Invalid HTTP
request received.") and a close, and the app waiting in `receive()` gets `http.disconnect`.
The body's time is the app's (the gateway's `server.body_timeout_s`, a 408).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_local_addr, get_remote_addr

from gateway.wire.openai import error_body, retry_headers

# After a refusal of its own, how long the guard reads and drops what still comes before it
# closes the connection.
LINGER_S = 1.0

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
# (the server's address, the caller's), as uvicorn puts them in each request's scope.
ConnectionKey = tuple[object, object]


def error_answer(status: int, message: str, code: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's error shape, after which the connection closes."""
    body = error_body(message, "invalid_request_error" if status < 500 else "server_error",
                      None, code)
    extra = b"".join(b"%s: %s\r\n" % (n, v) for n, v in headers or ())
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            % (status, HTTPStatus(status).phrase.encode())
            + extra + b"content-length: %d\r\n\r\n" % len(body) + body)


class ConnectionGuard(asyncio.Protocol):
    """One connection: uvicorn's protocol inside, the head's clock and size outside."""

    __slots__ = ("_awaiting_head", "_head_bytes", "_inner", "_key", "_limits", "_refused",
                 "_since_head", "_tail", "_timer", "_transport")

    def __init__(self, inner: asyncio.Protocol, limits: Limits) -> None:
        self._inner = inner
        self._limits = limits
        self._transport: asyncio.Transport | None = None
        self._key: ConnectionKey | None = None
        self._awaiting_head = True
        self._head_bytes = 0
        self._since_head = 0
        self._tail = b""  # the last bytes of a head read so far: its end may span two reads
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False

    # --- asyncio's protocol, passed on ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's registers as asyncio's rather than deriving from it).
        self._transport = transport = cast("asyncio.Transport", transport)
        self._key = key = (get_local_addr(transport), get_remote_addr(transport))
        self._limits.open[key] = self
        self._arm(self._limits.header_timeout_s)
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._key is not None and self._limits.open.get(self._key) is self:
            del self._limits.open[self._key]
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped until the close
        if self._awaiting_head:
            if self._timer is None:  # the first byte after an answer: the head's clock starts
                self._arm(self._limits.header_timeout_s)
            end = self._head_end(data)
            self._head_bytes += len(data) if end < 0 else end
            if self._head_bytes > self._limits.max_header_bytes:
                self._refuse(431, "The request line and headers exceed "
                             f"{self._limits.max_header_bytes} bytes.",
                             "request_header_fields_too_large")
                return
            if end < 0:
                self._tail = (self._tail + data)[-3:] if len(data) < 3 else data[-3:]
            else:
                self.started()
                self._since_head = len(data) - end  # the body's first bytes
        else:
            self._since_head += len(data)
            if self._since_head > self._limits.max_request_bytes:
                assert self._transport is not None
                self._transport.close()
                return
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused and self._transport is not None:
            self._transport.close()  # the caller has read the refusal and closed its end
            return None
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _head_end(self, data: bytes) -> int:
        """Where in `data` the head ends (past its blank line), or -1."""
        if self._tail:  # the blank line may begin in the last read
            at = (self._tail + data[:3]).find(b"\r\n\r\n")
            if at >= 0:
                return at + 4 - len(self._tail)
        at = data.find(b"\r\n\r\n")
        return -1 if at < 0 else at + 4

    # --- what the ASGI guard tells ---------------------------------------------------------------

    def started(self) -> None:
        """A request's head is whole: the time is the app's until its answer ends."""
        self._awaiting_head = False
        self._head_bytes = self._since_head = 0
        self._tail = b""
        self._disarm()

    def answered(self) -> None:
        """An answer ended: what comes next is a new head (uvicorn times the idle wait)."""
        self._awaiting_head = True

    # --- the guard's own -------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._head_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        if self._head_bytes == 0 and not self._tail:
            assert self._transport is not None
            self._transport.close()  # nothing of a request came: nothing to answer
            return
        self._refuse(408, "The request's head did not arrive within "
                     f"{self._limits.header_timeout_s:g}s.", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        transport = self._transport
        assert transport is not None
        self._refused = True
        self._disarm()
        transport.write(error_answer(status, message, code))
        if transport.can_write_eof():
            transport.write_eof()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(LINGER_S, transport.close)


class Limits:
    """What the guards enforce, and the connections open under them."""

    def __init__(self, max_header_bytes: int, header_timeout_s: float, max_body_bytes: int,
                 max_requests: int | None) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_request_bytes = max_header_bytes + max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.max_requests = max_requests
        self.in_flight = 0
        # How a request finds its connection's guard.
        self.open: dict[ConnectionKey, ConnectionGuard] = {}

    def protocol(self, **uvicorn_kwargs: Any) -> ConnectionGuard:
        """The factory uvicorn's `Config(http=...)` is given: its own httptools protocol, made
        with the arguments uvicorn passes, inside a guard."""
        return ConnectionGuard(HttpToolsProtocol(**uvicorn_kwargs), self)


_UNAVAILABLE = (b"content-type", b"application/json"), (b"connection", b"close")
_BUSY_BODY = error_body("The gateway has too many requests open; retry shortly.",
                        "server_error", None, "server_busy")


class GuardedApp:
    """The app, with each request's start and end told to its connection's guard."""

    def __init__(self, app: App, limits: Limits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        guard = limits.open.get((scope.get("server"), scope.get("client")))
        if guard is not None:
            guard.started()
        exchange = _Exchange(guard, receive, send, scope["headers"])
        if limits.max_requests is not None and limits.in_flight >= limits.max_requests:
            await _busy(send)
            return
        limits.in_flight += 1
        try:
            await self.app(scope, exchange.receive, exchange.send)
        finally:
            limits.in_flight -= 1


async def _busy(send: Send) -> None:
    """The backstop behind the gateway's own 503: more requests open than the server's cap."""
    await send({"type": "http.response.start", "status": 503,
                "headers": [*_UNAVAILABLE, *retry_headers(1.0),
                            (b"content-length", b"%d" % len(_BUSY_BODY))]})
    await send({"type": "http.response.body", "body": _BUSY_BODY, "more_body": False})


class _Exchange:
    """One request's receive and send, watched for the body's end and the answer's."""

    __slots__ = ("_body_pending", "_guard", "_receive", "_send")

    def __init__(self, guard: ConnectionGuard | None, receive: Receive, send: Send,
                 headers: list[tuple[bytes, bytes]]) -> None:
        self._guard = guard
        self._receive = receive
        self._send = send
        self._body_pending = _declares_body(headers)

    def receive(self) -> Awaitable[Message]:
        if not self._body_pending:  # past the body (a wait for the disconnect): uvicorn's own
            return self._receive()
        return self._receive_body()

    async def _receive_body(self) -> Message:
        message = await self._receive()
        if not message.get("more_body", False):
            self._body_pending = False  # all of it came, or the caller left
        return message

    def send(self, message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            if self._body_pending:
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"connection", b"close")]}
        elif not message.get("more_body", False) and self._guard is not None:
            self._guard.answered()
        return self._send(message)


def _declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False
