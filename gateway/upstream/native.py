"""The forwarder's HTTP/1.1 client to the engines: a connection pool and a protocol on httptools.

aiohttp's request path cost more than the gateway's whole pipeline: from `session.post` to
the request's bytes on the socket, ~300 us back to back and 360-400 us after 35 ms idle on this
machine, against 17-18 and 56-61 us for this client; to the engine's receipt 381 against 90-95
us hot, 524-567 against 245-268 cold (benchmarks/engine_client.py, three runs; the script is
in git history). Each
request builds a ClientRequest (its URL, headers, auto headers, cookies, body payload, writer
task), a connection key and a timer context. Here the
request line and the headers that do not change are one `bytes` per backend endpoint, made
once; a request is that, its id, its length and its body in one `transport.write`, on a
connection taken from a per-endpoint stack. The answer is parsed by httptools (llhttp, as
uvicorn parses requests), and its body handed to the relay as it comes, as aiohttp's
`readany` does.

What it keeps of aiohttp's behaviour, because the forwarder's failure handling stands on it:
what an engine did, raised as the gateway's own exceptions (gateway/upstream/errors.py: a
refused connect is Unreachable, a connection the engine closed before answering
ClosedBeforeAnswer, a reset BrokeOff, a cut body CutBody, a silent engine Silent), the
`read_timeout` between reads (bounding the wait for the answer's headers;
gateway/upstream/silence.py turns it off for a stream's body), flow control (the engine's
socket is paused while the caller has not taken what was read), keep-alive (a connection is
reused only after its answer was read to the end, with nothing after it, and the engine did
not ask to close, and not once it has been idle `keepalive_timeout_s`, which is under the
engines' own, so one the engine is about to close is not reused), and the limits on an answer's
head (aiohttp ClientSession's defaults).

Only plain `http://` backends without credentials in their URL are served here; any other goes
through aiohttp (`Forwarder`), as do the probes, the scrapes and the pass-through endpoints,
which are not on the hot path.
"""

from __future__ import annotations

import asyncio
import collections
import errno as errnos

import httptools
from yarl import URL

from gateway.upstream.errors import (
    BrokeOff,
    ClosedBeforeAnswer,
    ConnectTimeout,
    CutBody,
    EngineFailure,
    Malformed,
    Silent,
    Unreachable,
)

# The engine's socket is paused when this much of its answer waits for the caller, and read
# again under half of it (aiohttp's StreamReader: twice its 64 KiB limit).
HIGH_WATER = 1 << 17
LOW_WATER = 1 << 16

# The most of an answer's head taken, as aiohttp's ClientSession takes it (its defaults for
# max_line_size, max_field_size and max_headers): a header's name and value at most 8190 bytes
# together, at most 128 headers. An engine past them is broken, and its head is not gathered.
MAX_LINE_SIZE = 8190
MAX_FIELD_SIZE = 8190
MAX_HEADERS = 128
# httptools holds a header back until the next one begins (the status line until the second),
# so bytes read with nothing handed over are at most two lines' worth (with their separators
# and some blank space): past that, reading stops before the end of such a line is waited for.
MAX_PENDING = MAX_LINE_SIZE + MAX_FIELD_SIZE + 1024


class _Malformed(Exception):
    """An answer not to take, seen in a parser callback: raised there, it stops httptools,
    which raises its HttpParserCallbackError with this as the context."""


class Target:
    """One engine endpoint, worked out once: where to connect, and the request's fixed head."""

    __slots__ = ("head", "host", "key", "port")

    def __init__(self, url: URL, auth_header: str | None) -> None:
        assert url.host is not None and url.port is not None
        self.host = url.host
        self.port = url.port
        self.key = (self.host, self.port)
        lines = [b"POST " + (url.raw_path_qs or "/").encode("ascii") + b" HTTP/1.1",
                 b"Host: " + url.raw_authority.encode("ascii"),
                 b"content-type: application/json", b"accept-encoding: identity"]
        if auth_header:
            lines.append(b"authorization: " + _header_value(auth_header))
        self.head = b"\r\n".join(lines) + b"\r\nx-request-id: "


def target_of(url: str, auth_header: str | None) -> Target | None:
    """`url`'s Target, or None where this client does not serve it (not plain http, or with
    credentials or an odd form in it)."""
    try:
        u = URL(url)
    except ValueError:
        return None
    if u.scheme != "http" or u.user is not None or u.password is not None \
            or not u.host or u.port is None or u.fragment:
        return None
    try:
        return Target(u, auth_header)
    except (UnicodeEncodeError, ValueError):
        return None


def _header_value(value: str) -> bytes:
    raw = value.encode("latin-1")
    if b"\r" in raw or b"\n" in raw:
        raise ValueError("a header value holds a line break")
    return raw


class Body:
    """An answer's body as the engine sends it (`readany`, `read`, `set_exception`), over a
    bytearray the protocol feeds; a stream's reads take one event at a time, so the copy out
    is of a few hundred bytes."""

    __slots__ = ("_buffer", "_conn", "_eof", "_exc", "_waiter")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._buffer = bytearray()
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[bytes] | None = None

    def feed(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        if self._exc is None:  # the first cause stands (a timeout, then the close it makes)
            self._exc = exc
        self._wake()

    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # else its reader was cancelled: what came stays
                self._settle(waiter)

    def readany(self) -> asyncio.Future[bytes]:
        """What has come since the last read (b"" at the end), once something has."""
        answer: asyncio.Future[bytes] = self._conn.loop.create_future()
        if self._buffer or self._exc is not None or self._eof:
            self._settle(answer)
        else:
            self._waiter = answer
        return answer

    def _settle(self, answer: asyncio.Future[bytes]) -> None:
        if self._buffer:
            data = bytes(self._buffer)
            self._buffer.clear()
            self._conn.resume()
            answer.set_result(data)
        elif self._exc is not None:
            answer.set_exception(self._exc)
        else:
            answer.set_result(b"")

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)


class Response:
    """The engine's answer (gateway/upstream/base.py's `Answer`)."""

    __slots__ = ("_released", "connection", "content", "headers", "status")

    def __init__(self, conn: Connection, status: int, headers: dict[str, str]) -> None:
        self.connection = conn
        self.status = status
        # Names in lower case, the first of a repeated header.
        self.headers = headers
        self.content = Body(conn)
        self._released = False

    async def read(self) -> bytes:
        try:
            return await self.content.read()
        finally:
            self.release()

    def readany(self) -> asyncio.Future[bytes]:
        return self.content.readany()

    def stop_read_timeout(self) -> bool:
        """The connection's own read timeout off for the rest of this answer: its silence is
        watched elsewhere (gateway/upstream/silence.py)."""
        self.connection.read_timeout = None
        return True

    def fail(self, exc: EngineFailure) -> None:
        """End the body's reads with `exc`."""
        self.content.set_exception(exc)

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the answer was read whole
        and the engine keeps it open, and is closed otherwise (so an engine generating for a
        caller who left stops: vLLM aborts a request whose connection closes)."""
        if not self._released:
            self._released = True
            self.connection.done(self.content.at_eof())

    def close(self) -> None:
        """Done with it, and its connection closed whatever was read."""
        self.connection.close()
        self.release()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Connection(asyncio.Protocol):
    """One keep-alive connection to an engine: one request at a time, parsed by httptools."""

    def __init__(self, pool: EnginePool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        # The parser holds this protocol and this protocol the parser: the pair is broken when
        # the connection goes (connection_lost), so reference counts free it.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._answer: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._headers: dict[str, str] = {}
        self._framed = False  # the answer has a length or is chunked (else: read to close)
        self._complete = False
        self._keep = False
        self._fields = 0  # the headers of the answer's head, then its trailers
        self._pending = 0  # bytes read since the parser last handed something over
        self._paused = False
        self._active = False  # a request is out on it and its response not yet released
        self._timeout: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self.idle_since = 0.0

    # The longest the engine may stay silent, from the request to the end of the answer
    # (aiohttp's sock_read): set None to stop watching (gateway/upstream/silence.py does, for a
    # stream's body). One timer a request, moved only when it fires, not at every read.
    @property
    def read_timeout(self) -> float | None:
        return self._timeout

    @read_timeout.setter
    def read_timeout(self, value: float | None) -> None:
        self._timeout = value
        if value is None and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _watch(self) -> None:
        self._timer = None
        if self._timeout is None or self.transport is None:
            return
        due = self._last_read + self._timeout
        now = self.loop.time()
        if now < due:
            self._timer = self.loop.call_at(due, self._watch)
            return
        self._fail(Silent(f"no read from the engine within {self._timeout:g}s"))
        self.close()

    # --- one request ------------------------------------------------------------------------

    def send(self, data: bytes, read_timeout: float) -> asyncio.Future[Response]:
        assert self.transport is not None
        self._active = True
        self._answer = self.loop.create_future()
        self._response = None
        self._headers = {}
        self._framed = self._complete = self._keep = False
        self._fields = self._pending = 0
        self._timeout = read_timeout
        self._last_read = self.loop.time()
        self._timer = self.loop.call_at(self._last_read + read_timeout, self._watch)
        self.transport.write(data)
        return self._answer

    def done(self, whole: bool) -> None:
        """The response was released (`whole`: its body read to the end)."""
        self._active = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        reusable = whole and self._complete and self._keep and self.transport is not None \
            and not self.transport.is_closing()
        self._response = None  # the answer refers to this connection: no cycle kept
        if not reusable:
            self.close()
        self.pool.give_back(self, reusable)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _fail(self, exc: BaseException) -> None:
        answer, self._answer = self._answer, None
        if answer is not None and not answer.done():
            answer.set_exception(exc)
        elif self._response is not None and not self._complete:
            self._response.content.set_exception(exc)

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport does not subclass asyncio.Transport, but has its methods.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self._active:  # bytes no request asked for: the connection is of no use
            self.close()
            return
        if self._timeout is not None:  # a stream's body has its own watch (silence.py)
            self._last_read = self.loop.time()
        assert self._parser is not None
        self._pending += len(data)  # the callbacks zero it as the parser hands things over
        try:
            self._parser.feed_data(data)
            if self._pending > MAX_PENDING:
                raise _Malformed("a line longer than any taken")
        # HttpParserUpgrade: bytes after a 101, which was handed over whole already.
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, _Malformed) as exc:
            self._refuse(exc)

    def _refuse(self, exc: Exception) -> None:
        """Fail the request (its body, once its head was in), and stop reading at once."""
        if isinstance(exc.__context__, _Malformed):
            exc = exc.__context__
        self._fail(Malformed(f"Malformed answer from the engine: {exc}"))
        self.close()

    def eof_received(self) -> bool:
        return False  # close: a half-closed engine connection is of no further use

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.pool.lost(self)
        self._parser = None
        answer, self._answer = self._answer, None
        response, self._response = self._response, None
        if answer is not None and not answer.done():
            answer.set_exception(_lost_before_answer(exc))
        elif response is not None and not self._complete:
            if exc is None and not self._framed:  # an answer that ends where its connection does
                self._complete = True
                response.content.feed_eof()
            else:
                response.content.set_exception(CutBody(
                    "Response payload is not completed" + (f": {exc!r}" if exc else "")))

    # --- httptools ----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # Another message after the answer's end: what the engine sent is not what it said,
        # and a later request on this connection would read the rest as its own answer. The
        # connection goes (the answer read stands).
        if self._complete:
            raise _Malformed("more bytes than the answer said")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._pending = 0
        self._fields += 1
        if self._fields > MAX_HEADERS:
            raise _Malformed(f"more than {MAX_HEADERS} headers")
        if len(name) + len(value) > MAX_FIELD_SIZE:
            raise _Malformed(f"a header longer than {MAX_FIELD_SIZE} bytes")
        self._headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self._pending = 0
        status = self._parser.get_status_code()
        if status in (100, 103):  # an interim answer (100 Continue, 103 Early Hints): the next
            self._headers = {}
            self._fields = 0
            return
        headers = self._headers
        self._framed = "content-length" in headers or \
            "chunked" in headers.get("transfer-encoding", "").lower()
        self._keep = self._parser.should_keep_alive()
        self._response = Response(self, status, headers)
        answer = self._answer
        self._answer = None
        if answer is not None and not answer.done():
            answer.set_result(self._response)
        # Any other 1xx is handed over as the answer (with no body), as aiohttp hands over a
        # 101, for the forwarder to refuse: no engine sends one to a POST. After a 101 (the
        # only switch of protocols llhttp makes on an answer) nothing on the connection is
        # HTTP, and after another the rest is unread: either way the connection goes now.
        if status < 200:
            self.close()

    def on_body(self, body: bytes) -> None:
        self._pending = 0
        if self._response is not None:
            self._response.content.feed(body)

    def on_message_complete(self) -> None:
        if self._response is None:  # the end of an interim answer
            return
        self._complete = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._response.content.feed_eof()


class EnginePool:
    """Keep-alive connections per engine endpoint, at most `limit` in use at once. Built at
    start-up and kept across reloads, like aiohttp's session; the timeouts come with each
    request, from the policy in force."""

    def __init__(self, limit: int, keepalive_s: float) -> None:
        self._targets: dict[tuple[str, str | None], Target | None] = {}
        self.loop = asyncio.get_running_loop()
        self.limit = limit
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._busy = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._open: set[Connection] = set()
        self._closed = False

    def serves(self, url: str, auth_header: str | None) -> bool:
        """Whether this client takes requests to `url` (plain http://, no credentials)."""
        key = (url, auth_header)
        try:
            return self._targets[key] is not None
        except KeyError:
            target = self._targets[key] = target_of(url, auth_header)
            return target is not None

    async def post(self, url: str, request_id: str, body: bytes, auth_header: str | None,
                   connect_timeout_s: float, read_timeout_s: float) -> Response:
        """The seam's `Client.post`, for a `url` it `serves`."""
        if not self.serves(url, auth_header):
            raise Unreachable(f"not a plain http:// URL: {url}", "not reachable over http")
        target = self._targets[url, auth_header]
        assert target is not None
        return await self.post_target(target, request_id, body, connect_timeout_s,
                                      read_timeout_s)

    async def post_target(self, target: Target, request_id: str, body: bytes,
                          connect_timeout_s: float, read_timeout_s: float) -> Response:
        """POST `body` to `target`: the answer once its headers are in."""
        data = b"".join((target.head, _header_value(request_id), b"\r\ncontent-length: ",
                         b"%d" % len(body), b"\r\n\r\n", body))
        conn = await self._acquire(target, connect_timeout_s)
        try:
            return await conn.send(data, read_timeout_s)
        except BaseException:
            conn.close()
            self.give_back(conn, False)
            raise

    async def _acquire(self, target: Target, connect_timeout_s: float) -> Connection:
        while self._busy >= self.limit:
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if not waiter.cancelled() and waiter.done():
                    self._wake()  # handed a turn it will not take: on to the next
                raise
        if self._closed:
            raise Unreachable("the gateway is shutting down")
        self._busy += 1
        idle = self._idle.get(target.key)
        now = self.loop.time()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closing
            if conn.transport is not None and not conn.transport.is_closing() \
                    and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        try:
            return await self._connect(target, connect_timeout_s)
        except BaseException:
            self._busy -= 1
            self._wake()
            raise

    async def _connect(self, target: Target, timeout_s: float) -> Connection:
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self, target.key), target.host, target.port)
        except TimeoutError:
            raise ConnectTimeout(f"Connection timeout to host {target.host}:{target.port}") \
                from None
        except OSError as exc:
            raise Unreachable(f"Cannot connect to host {target.host}:{target.port} "
                              f"[{exc.strerror}]") from None
        self._open.add(conn)
        return conn

    def give_back(self, conn: Connection, reusable: bool) -> None:
        """A request is done with `conn`: idle for the next if `reusable`."""
        self._busy -= 1
        if reusable and not self._closed:
            conn.idle_since = self.loop.time()
            self._idle.setdefault(conn.key, []).append(conn)
        self._wake()

    def lost(self, conn: Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


def _lost_before_answer(exc: Exception | None) -> EngineFailure:
    """A connection lost with the request out and no answer's head in."""
    if exc is None:  # closed: a kept-alive connection the engine had let go
        return ClosedBeforeAnswer("Server disconnected")
    errno = getattr(exc, "errno", None) or errnos.ECONNRESET
    return BrokeOff(f"[Errno {errno}] {exc}", "the engine reset the connection"
                    if errno == errnos.ECONNRESET else None)
