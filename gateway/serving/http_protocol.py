"""The gateway's HTTP/1.1 server protocol: httptools' parser under uvicorn's `Server`, with the
limits a public endpoint needs and no more objects per open stream than it must keep.

Why not uvicorn's own httptools protocol: every open stream waits for each full collection, and
a collection walks every object a stream keeps alive (gateway/serving/heap.py). Of the ~77 an
open stream held (issue 21's census), about 25 were its caller's connection, and a third of
those were uvicorn's machinery rather than anything a stream needs: a `FlowControl` and a
per-request `asyncio.Event`, each with its waiters' deque, a pipeline deque per connection, a
`run_asgi` coroutine wrapping the app's, a copy of the lifespan state and an `asgi` dict per
request, the disconnect notice and the list that found it. Here:

- one `Exchange` per request is the request's `receive`/`send`, its disconnect notice (found
  under `scope[DISCONNECT_KEY]`) and its task's done callback (it is callable), so the app's
  coroutine is the task's, not wrapped in one more;
- flow control is two flags on the connection and a future made only while a write waits;
- a body waiter is a future made only when the app waits for a body that has not come;
- the pipeline queue exists only on a connection that pipelines.

The limits uvicorn's protocol lacks are here too: a request's head is bounded in size (past
`max_header_bytes`, 431 in OpenAI's error shape) and in time (whole within `header_timeout_s`
of the connection's opening or of the request's first byte, else 408 or a close), and an idle
keep-alive connection is closed after `keep_alive_timeout_s`. A connection has a clock in every
state but one, so that no caller holds it by sending nothing, or a byte now and then:

- the head: `header_timeout_s`, then a 408 (or a close, if nothing of a request came);
- the body: `keep_alive_timeout_s` from the head's end to the body's last byte, then a 408
  where no answer has started, else a cut. The app has a body timeout of its own (the
  gateway's `server.body_timeout_s`, shorter by default): this is the backstop for an app that
  does not read;
- idle after an answer: `keep_alive_timeout_s`, then a close;
- after a refusal, or an answer after which the connection closes: `LINGER_S` of reading and
  dropping what still comes (or until the caller closes its end), then a close. An answer
  given before the request's body has all come (a bad key's 401, the app's own 408) says
  `connection: close` and ends the connection rather than read the rest of the body: that
  rest may never come, or be large, and keeping the connection would mean reading it within
  yet another bound; closing is simpler, and what most servers do;
- the one without: while the app holds the request (its body all read, its answer being made
  or going out), the time is the app's.

A malformed body (a bad chunk size, a chunk without its CRLF) is a 400 where no answer has
started, with a close; the app waiting for the body is told at once that the caller has gone.

What the gateway does not serve (WebSocket, HTTP/2, TLS termination) is not here: an Upgrade
request is answered as plain HTTP/1.1 and its connection closed after the answer.

uvicorn's `Server` still runs the sockets, the lifespan, signals and the graceful shutdown; this
protocol keeps the interface it calls (the constructor's keywords, `shutdown()`, the shared
`connections` and `tasks` sets, `default_headers`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
from collections import deque
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

from gateway.api.disconnect import DISCONNECT_KEY, Listener
from gateway.protocol import error_body, retry_headers

logger = logging.getLogger("gateway.http")


# A body buffered past this (not yet taken by `receive()`) pauses reading: uvicorn's figure.
HIGH_WATER = 65536

# After a refusal, or an answer after which the connection closes, how long what still comes is
# read and dropped before the connection closes: closing with unread bytes resets the
# connection, and the caller may lose the answer it has not read yet.
LINGER_S = 1.0

# Method, spaces, "HTTP/1.1" and the line ends the parser does not hand over.
_REQUEST_LINE_OVERHEAD = 20

# One dict for every request's scope: ASGI says what it holds, and nothing writes to it.
_ASGI = {"version": "3.0", "spec_version": "2.3"}

_METHODS = {m: m.decode() for m in (b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS",
                                    b"PATCH")}

# A response header's name and value, as uvicorn checks them: no control characters (a CR or
# LF would split the response), no separators in a name.
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}


def _error_response(status: int, message: str, code: str,
                    headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """A whole answer the protocol writes itself, in OpenAI's shape; the connection closes."""
    body = error_body(message, "invalid_request_error" if status < 500 else "server_error",
                      None, code)
    extra = b"".join(b"%s: %s\r\n" % (n, v) for n, v in headers or ())
    return (_STATUS_LINES[status] + b"content-type: application/json\r\nconnection: close\r\n"
            + extra + b"content-length: %d\r\n\r\n" % len(body) + body)


_INTERNAL_ERROR = _error_response(500, "The gateway failed to answer this request.",
                                  "internal_error")
# A connection or a task ends soon: a transient refusal, worth the SDK's retry.
_UNAVAILABLE = _error_response(503, "The gateway has too many requests open; retry shortly.",
                               "server_busy", retry_headers(1.0))
_DISCONNECT = {"type": "http.disconnect"}

Scope = dict[str, Any]
App = Callable[[Scope, Any, Any], Coroutine[Any, Any, None]]

# The server's own headers (date, server), rendered once per second rather than per response:
# uvicorn's `Server` replaces its list when the second turns.
_default: tuple[object, bytes] = (None, b"")


def _default_head(headers: list[tuple[bytes, bytes]]) -> bytes:
    global _default
    if _default[0] is not headers:
        _default = (headers, b"".join(b"%s: %s\r\n" % (n, v) for n, v in headers))
    return _default[1]


class Exchange:
    """One request and its response on a connection: the app's `receive` and `send`, its
    disconnect notice, and (called with its task) what runs when the app's task ends."""

    # It holds its connection but not its scope: the scope holds it (as the disconnect
    # notice), and the two holding each other would be a cycle only a collection frees.
    __slots__ = ("body", "chunked", "conn", "disconnected", "head_only", "keep_alive",
                 "listener", "more_body", "pending", "remaining", "response_complete",
                 "response_started", "waiter", "waiting_100")

    def __init__(self, conn: HttpProtocol, head_only: bool, keep_alive: bool,
                 expect_100: bool) -> None:
        self.conn = conn
        self.keep_alive = keep_alive
        self.waiting_100 = expect_100
        self.head_only = head_only
        self.body = bytearray()
        self.more_body = True
        self.pending = False  # a message (body, its end, a disconnect) is ready for receive()
        self.waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        self.listener: Listener | None = None
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self.remaining = 0  # of a content-length response

    # --- the disconnect notice ---------------------------------------------------------------

    def watch(self, listener: Listener | None) -> None:
        self.listener = listener
        if listener is not None:
            # A body that came in one read past the high-water mark left reading paused, and a
            # connection that is not read reports no loss.
            self.conn.resume_reading()

    def lost(self) -> None:
        """The connection is gone, or its request is over (called by the protocol)."""
        self.disconnected = True
        self.waiting_100 = False  # no interim answer after a final one or none
        self.wake()
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.lost()

    def wake(self) -> None:
        self.pending = True
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # --- ASGI --------------------------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        if self.waiting_100:
            self.waiting_100 = False
            if not self.conn.transport.is_closing():
                self.conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not self.disconnected and not self.response_complete:
            if not self.pending:
                self.conn.resume_reading()
                waiter = self.waiter = self.conn.loop.create_future()
                await waiter
            self.pending = False
        if self.disconnected or self.response_complete:
            return _DISCONNECT
        message = {"type": "http.request", "body": bytes(self.body),
                   "more_body": self.more_body}
        self.body.clear()
        return message

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError("Expected ASGI message 'http.response.start', but got "
                                   f"{message['type']!r}.")
            self._start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if message["type"] != "http.response.body":
                raise RuntimeError("Expected ASGI message 'http.response.body', but got "
                                   f"{message['type']!r}.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message {message['type']!r} after the "
                               "response was complete.")

    def _start(self, status: int, headers: Any) -> None:
        self.response_started = True
        self.waiting_100 = False
        if self.more_body:
            # Answered before the request's body has all come (a bad key's 401, the app's own
            # 408): the connection closes after it rather than wait for the rest.
            self.keep_alive = False
        parts = [_STATUS_LINES[status]]
        length: int | None = None
        chunked = False
        close_sent = False
        parts.append(_default_head(self.conn.server_state.default_headers))
        for name, value in headers:
            if _BAD_NAME.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if _BAD_VALUE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and length is None and not chunked:
                length = int(value)
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                chunked, length = True, None
            elif name == b"connection" and b"close" in (
                    t.strip() for t in value.lower().split(b",")):
                self.keep_alive = False
                close_sent = True
            parts.append(b"%s: %s\r\n" % (name, value))
        if not self.keep_alive and not close_sent:
            parts.append(b"connection: close\r\n")
        if length is None and not chunked and not self.head_only and status not in (204, 304):
            chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        self.chunked = chunked
        self.remaining = length or 0
        self.conn.transport.write(b"".join(parts))

    def _body(self, body: bytes, more_body: bool) -> None:
        transport = self.conn.transport
        if self.head_only:
            self.remaining = 0
        elif self.chunked:
            if body:
                if more_body:
                    transport.write(b"%x\r\n%b\r\n" % (len(body), body))
                else:
                    transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
            elif not more_body:
                transport.write(b"0\r\n\r\n")
        else:
            if len(body) > self.remaining:
                raise RuntimeError("Response content longer than Content-Length")
            self.remaining -= len(body)
            if body:
                transport.write(body)
        if not more_body:
            if self.remaining:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.wake()
            self.conn.answered(self)

    # --- the task's end ----------------------------------------------------------------------

    def __call__(self, task: asyncio.Task[None]) -> None:
        conn = self.conn
        conn.tasks.discard(task)
        self.listener = None
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            logger.error("Exception in ASGI application", exc_info=exc)
        elif self.response_complete or self.disconnected:
            return  # answered, or no one left to answer
        elif task.cancelled():
            logger.error("ASGI task cancelled before its response was complete.")
        else:
            logger.error("ASGI callable returned without %s response.",
                         "completing" if self.response_started else "starting")
        self.fail()

    def fail(self) -> None:
        """The app could not answer: a 500 if nothing was sent yet, else a cut connection."""
        transport = self.conn.transport
        self.keep_alive = False
        if not self.response_started and not self.disconnected and \
                not transport.is_closing():
            self.response_started = self.response_complete = True
            transport.write(_INTERNAL_ERROR)
            self.conn.close_soon()
            return
        self.response_complete = True
        transport.close()


class HttpProtocol(asyncio.Protocol):
    max_header_bytes = 64 * 1024
    header_timeout_s = 10.0
    keep_alive_timeout_s = 75.0

    __slots__ = ("_begun", "_body_timer", "_discarding", "_drain", "_expect_100", "_head_bytes",
                 "_head_raw", "_head_timer", "_idle_timer", "_in_head", "_in_message",
                 "_pipeline", "active", "app", "app_state", "client", "connections", "cycle",
                 "limit", "loop", "parser", "read_paused", "scheme", "scope", "server",
                 "server_state", "tasks", "transport", "url", "write_paused")

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.limit: int | None = config.limit_concurrency
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.app_state = app_state
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        # Answer the first of pipelined requests whose connection then says close.
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # httptools>=0.6.3
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.read_paused = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        # The request being answered, and the latest whose head was parsed (its body is the
        # one coming in): the same one unless the caller pipelines.
        self.active: Exchange | None = None
        self.cycle: Exchange | None = None
        self._pipeline: deque[tuple[Exchange, Scope, App]] | None = None
        # The head being parsed; its scope is let go once whole (the scope holds its exchange,
        # which holds this protocol), and with it the headers' list.
        self.url = b""
        self.scope: Scope | None = None
        self._expect_100 = False
        # The head's size as the parser handed it over: exact, but a header comes only once
        # whole, so a head that never ends is seen only in the bytes received meanwhile.
        self._head_bytes = 0
        self._head_raw = 0
        self._in_head = False
        self._in_message = False
        self._begun = 0  # requests begun in the read being parsed
        self._discarding = False  # after a refusal: what comes is read and dropped
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        # Between requests; also the linger before a close (`close_soon`).
        self._idle_timer: asyncio.TimerHandle | None = None

    # --- the connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # uvloop's transports are asyncio.Transport in all but their class.
        self.connections.add(self)
        self.transport = transport
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        if is_ssl(transport):
            self.scheme = "https"
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self._cancel_timers()
        for cycle in {self.active, self.cycle}:
            if cycle is not None and not cycle.response_complete:
                cycle.lost()
        self._pipeline = None
        self.resume_writing()
        if exc is None:
            self.transport.close()
        # The parser holds this protocol's bound callbacks and each exchange holds this
        # protocol: cycles for the collector unless let go here.
        self.parser = None
        self.active = self.cycle = None

    def eof_received(self) -> None:
        pass

    def shutdown(self) -> None:
        """The server is stopping: close when idle, else after the response in progress."""
        self._pipeline = None
        active = self.active
        if active is None or active.response_complete:
            self.transport.close()
        else:
            active.keep_alive = False

    # --- flow control ------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    async def drain(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()
        await self._drain

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    # --- time --------------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        self._cancel_idle_timer()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        responding = self.active is not None and not self.active.response_complete
        if not self._in_head and responding:
            return  # stray blank lines during a response: the keep-alive timer follows it
        if not self._in_head:  # nothing of a request came (or only blank lines)
            self._discarding = True
            self.transport.close()
            return
        self._refuse(408, "The request line and headers did not arrive within "
                     f"{self.header_timeout_s:g}s.", "request_timeout")

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self._discarding or not self._in_message:
            return
        self._refuse(408, "The request body did not arrive within "
                     f"{self.keep_alive_timeout_s:g}s.", "request_timeout")

    def _idle_timeout(self) -> None:
        self._idle_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def close_soon(self) -> None:
        """Close after `LINGER_S` of reading and dropping whatever still comes (or as soon as
        the caller closes its end): nginx's lingering close."""
        self._discarding = True
        self._pipeline = None
        self._cancel_timers()
        if self.transport.can_write_eof():
            # Nothing more is written: the caller learns it now, after what was written.
            self.transport.write_eof()
        self.resume_reading()  # reading paused (a body past HIGH_WATER) would drain nothing
        self._idle_timer = self.loop.call_later(LINGER_S, self._idle_timeout)

    # --- reading -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._discarding or self.parser is None:
            return  # after a refusal: read and drop the rest, so closing sends FIN, not RST
        self._cancel_idle_timer()
        if not self._in_message:
            # A request's clock starts at its first byte.
            self._arm_head_timer()
        continuing, idle = self._in_head, not self._in_message
        self._begun = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No protocol is served past HTTP/1.1: the request is answered as it is, and what
            # follows its head is not HTTP/1.1 for this parser to read.
            if self.cycle is not None:
                self.cycle.keep_alive = False
            self._discarding = True
            return
        except httptools.HttpParserError:
            self._refuse(400, "Invalid HTTP request received.", "invalid_http_request")
            return
        if self._discarding or self.transport.is_closing():
            return
        if not self._in_head:
            if self._in_message and self._body_timer is None:
                # A body is due: its clock starts with the head's end (this read's).
                self._body_timer = self.loop.call_later(self.keep_alive_timeout_s,
                                                        self._body_timeout)
            return
        if (continuing and self._begun == 0) or (idle and self._begun == 1):
            self._head_raw += len(data)  # the whole read was this head's
        else:
            # The read also finished an earlier request: of this one, only what the parser
            # handed over is known.
            self._head_raw = self._head_bytes
        if max(self._head_raw, self._head_bytes) > self.max_header_bytes:
            self._refuse_too_large()

    # Parser callbacks. After a refusal they do nothing: the rest is not a request served.

    def on_message_begin(self) -> None:
        if self._discarding:
            return
        self._begun += 1
        self._in_head = self._in_message = True
        self._head_bytes, self._head_raw = _REQUEST_LINE_OVERHEAD, 0
        self._arm_head_timer()
        self.url = b""
        self._expect_100 = False
        scope: Scope = {"type": "http", "asgi": _ASGI, "http_version": "1.1",
                        "server": self.server, "client": self.client, "scheme": self.scheme,
                        "root_path": "", "headers": []}
        if self.app_state:
            scope["state"] = self.app_state.copy()
        self.scope = scope

    def on_url(self, url: bytes) -> None:
        if self._discarding:
            return
        self._head_bytes += len(url)
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._discarding:
            return
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 (5.5) excludes from the value.
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_100 = True
        if self.scope is not None:  # else a chunked body's trailer: not read
            self.scope["headers"].append((name, value))

    def on_headers_complete(self) -> None:
        if self._discarding:
            return
        self._in_head = False
        self._cancel_head_timer()
        # A head that arrived in one read is whole by now: this is the only check it meets.
        if self._head_bytes > self.max_header_bytes:
            self._refuse_too_large()
            return  # the app never sees it
        parser, scope = self.parser, self.scope
        assert parser is not None and scope is not None
        self.scope = None
        version = parser.get_http_version()
        raw_method = parser.get_method()
        method = scope["method"] = _METHODS.get(raw_method) or raw_method.decode("ascii")
        if version != "1.1":
            scope["http_version"] = version
        url = httptools.parse_url(self.url)
        raw_path: bytes = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope["path"] = path
        scope["raw_path"] = raw_path
        scope["query_string"] = url.query or b""
        cycle = Exchange(self, method == "HEAD",
                         version != "1.0" and parser.should_keep_alive(), self._expect_100)
        scope[DISCONNECT_KEY] = cycle
        app: App = self.app
        if self.limit is not None and (len(self.connections) >= self.limit
                                       or len(self.tasks) >= self.limit):
            logger.warning("Exceeded concurrency limit.")
            app = _unavailable
        self.cycle = cycle
        if self.active is None or self.active.response_complete:
            self._start(cycle, scope, app)
        else:
            # Pipelined: it waits for the response before it, and reading waits with it.
            self.pause_reading()
            if self._pipeline is None:
                self._pipeline = deque()
            self._pipeline.append((cycle, scope, app))

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if self._discarding or cycle is None or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        if self._discarding:
            return
        self._in_message = False
        self._cancel_body_timer()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        cycle.more_body = False
        cycle.wake()

    # --- running the app ---------------------------------------------------------------------

    def _start(self, cycle: Exchange, scope: Scope, app: App) -> None:
        self.active = cycle
        try:
            # The app's own coroutine is the task's: no wrapper held for as long as it runs.
            task: asyncio.Task[None] = self.loop.create_task(
                app(scope, cycle.receive, cycle.send))
        except Exception:
            logger.exception("Exception in ASGI application")
            cycle.fail()
            return
        task.add_done_callback(cycle)
        self.tasks.add(task)

    def answered(self, cycle: Exchange) -> None:
        """`cycle`'s response is sent in full: start the next pipelined request or wait for
        one, at most `keep_alive_timeout_s`."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if cycle.more_body or self._discarding or not cycle.keep_alive:
            # The answer said close (its body has not all come, or the caller or the app
            # asked), or what follows it was refused: what still comes is no request to serve.
            self.close_soon()
            return
        self._cancel_idle_timer()
        self.resume_reading()
        if self._pipeline:
            self._start(*self._pipeline.popleft())
        elif not self._in_message:
            self._idle_timer = self.loop.call_later(self.keep_alive_timeout_s,
                                                    self._idle_timeout)

    # --- refusals ----------------------------------------------------------------------------

    def _refuse_too_large(self) -> None:
        self._refuse(431, f"The request line and headers exceed {self.max_header_bytes} "
                     "bytes.", "request_header_fields_too_large")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer what was read with `status` where nothing else is being answered, and close;
        what follows is not read as requests."""
        if self._discarding:
            # Refused already: the parser reads on past a refusal made in its callback (a
            # head too large) and may then fail too, but a caller gets one answer.
            return
        self._discarding = True
        self._in_head = False
        self._pipeline = None  # requests queued behind it are not answered
        self._cancel_timers()
        active = self.active
        if active is not None and not active.response_complete:
            if not active.more_body:
                # The refused bytes follow the request being answered: an answer now would
                # land inside or before its own. Let it finish; the connection closes after.
                active.keep_alive = False
                return
            # The refused bytes are its own body's. Its app waits for that body, or for the
            # caller to leave: the request is over, and the app is told so.
            answered = active.response_started
            active.response_started = active.response_complete = True
            active.lost()
            if answered:  # its answer has begun: nothing more can be said, only cut
                self.transport.close()
                return
        self.transport.write(_error_response(status, message, code))
        self.close_soon()


async def _unavailable(scope: Scope, receive: Any, send: Any) -> None:
    """The backstop behind the gateway's own 503: more requests than the server's cap."""
    cycle: Exchange = scope[DISCONNECT_KEY]
    cycle.keep_alive = False
    cycle.response_started = True
    cycle.conn.transport.write(_UNAVAILABLE)
    cycle.response_complete = True
    cycle.conn.transport.close()
