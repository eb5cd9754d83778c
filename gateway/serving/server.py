"""Serving: uvicorn (uvloop + httptools) with the limits a public endpoint needs.

uvicorn's httptools protocol puts no bound on a request's head, in size or in time: a client
can send megabytes of headers, every byte buffered, or send them a byte a minute (its
keep-alive timer stops at the first byte and never restarts). `BoundedHttpToolsProtocol`
bounds both, whatever the reads look like:

- size: the request line and headers, as the parser hands them over and as raw bytes while the
  head is incomplete, past `max_header_bytes` answer 431 in OpenAI's error shape;
- time: the head must be complete `header_timeout_s` after the connection opens or after the
  first byte of a later request on it; past that the connection is closed (408 if part of a
  request had come). An idle keep-alive connection is closed after `keep_alive_timeout_s`.

`run` serves the gateway, and the admin API on an address and port of its own when a port is
given, from one event loop, with SIGHUP reloading the policy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.protocol import error_body

# The GIL's hand-off interval: how long the loop may wait for it while a counting thread runs
# Python (the template's render, piece lookups, block hashes). CPython's default, 5 ms, unless
# the environment says otherwise (benchmarks/proxy_overhead.py measures both).
SWITCH_INTERVAL_ENV = "GATEWAY_SWITCH_INTERVAL_S"
SWITCH_INTERVAL_S = 0.005

# Method, spaces, "HTTP/1.1" and the line ends the parser does not hand over.
_REQUEST_LINE_OVERHEAD = 20

# The scope extension under which a request finds its `DisconnectNotice`.
DISCONNECT_EXTENSION = "gateway.disconnect"


class Listener(Protocol):
    def lost(self) -> None:
        """The caller's connection was lost before its response was complete."""


class DisconnectNotice:
    """Tells one request that its caller's connection was lost before its response was
    complete: the server calls the listener's `lost` (set by the app) from `connection_lost`.

    ASGI's own way is a task per request awaiting `receive()` until it yields
    `http.disconnect`: a task, its coroutine and an event waiter held for as long as the
    request lives, and a loop turn to start it just as the request is about to be forwarded.
    The notice holds nothing of the request (the scope holds it): no cycle for the collector.
    It holds the listener, not a bound method of it: one object fewer a stream for the
    collector's sweep to walk (gateway/serving/heap.py).
    """

    __slots__ = ("_flow", "listener")

    def __init__(self, flow: Any) -> None:
        self._flow = flow
        self.listener: Listener | None = None

    def watch(self, listener: Listener | None) -> None:
        """Call `listener.lost()` on a disconnect from now on (None: no more)."""
        self.listener = listener
        if listener is not None:
            # A body that came in one read past uvicorn's high-water mark leaves reading
            # paused, and a connection that is not read reports no loss; `receive()` resumes
            # it the same way.
            self._flow.resume_reading()

    def _lost(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.lost()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024
    header_timeout_s = 10.0
    keep_alive_timeout_s = 75.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's Config takes whole seconds; its timer (loop.call_later) takes any.
        self.timeout_keep_alive = self.keep_alive_timeout_s  # type: ignore[assignment]
        # This head's size as the parser handed it over: exact, but a header comes only
        # once whole, so a head that never ends is seen only in the bytes received meanwhile.
        self._head_bytes = 0
        self._head_raw = 0
        self._in_head = False
        self._in_message = False
        self._begun = 0  # requests begun in the read being parsed
        self._discarding = False
        self._head_timer: asyncio.TimerHandle | None = None
        # The requests on this connection not yet answered in full, with their notices.
        self._notices: list[tuple[Any, DisconnectNotice]] = []

    # --- time -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
        notices, self._notices = self._notices, []
        for cycle, notice in notices:
            if not cycle.response_complete:
                notice._lost()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        responding = self.cycle is not None and not self.cycle.response_complete
        if not self._in_head and responding:
            return  # stray blank lines during a response: the keep-alive timer follows it
        if not self._in_head:  # nothing of a request came (or only blank lines)
            self._discarding = True
            self.transport.close()
            return
        self._refuse(408, b"Request Timeout", "The request line and headers did not arrive "
                     f"within {self.header_timeout_s:g}s.", "request_timeout")

    # --- size -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return  # after a refusal: read and drop the rest, so closing sends FIN, not RST
        if not self._in_message:
            # A request's clock starts at its first byte: uvicorn's keep-alive timer has just
            # stopped for good.
            self._arm_head_timer()
        continuing, idle = self._in_head, not self._in_message
        self._begun = 0
        super().data_received(data)
        if self._discarding or not self._in_head or self.transport.is_closing():
            return
        if (continuing and self._begun == 0) or (idle and self._begun == 1):
            self._head_raw += len(data)  # the whole read was this head's
        else:
            # The read also finished an earlier request: of this one, only what the parser
            # handed over is known.
            self._head_raw = self._head_bytes
        if max(self._head_raw, self._head_bytes) > self.max_header_bytes:
            self._refuse_too_large()

    def on_message_begin(self) -> None:
        if self._discarding:
            return
        super().on_message_begin()
        self._begun += 1
        self._in_head = self._in_message = True
        self._head_bytes, self._head_raw = _REQUEST_LINE_OVERHEAD, 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        if self._discarding:
            return
        self._head_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._discarding:
            return
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._discarding:
            return
        self._in_head = False
        self._cancel_head_timer()
        # A head that arrived in one read is whole by now: this is the only check it meets.
        if self._head_bytes > self.max_header_bytes:
            self._refuse_too_large()
            return  # the app never sees it
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope and not self.transport.is_closing():
            # The request's task is made, not started: the scope can still take the notice.
            # Answered requests' notices go (a keep-alive connection serves many).
            notice = DisconnectNotice(self.flow)
            notices = [n for n in self._notices if not n[0].response_complete]
            notices.append((cycle, notice))
            self._notices = notices
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[DISCONNECT_EXTENSION] = notice

    def on_body(self, body: bytes) -> None:
        if not self._discarding:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._discarding:
            return
        self._in_message = False
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._discarding:  # the refusal already answered; the rest is not parsed
            super().send_400_response(msg)

    def _refuse_too_large(self) -> None:
        self._refuse(431, b"Request Header Fields Too Large", "The request line and headers "
                     f"exceed {self.max_header_bytes} bytes.", "request_header_fields_too_large")

    def _refuse(self, status: int, reason: bytes, message: str, code: str) -> None:
        self._discarding = True
        self._in_head = False
        self._cancel_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier request's response is still going out on this connection: an answer
            # now would land inside it. Let it finish; the connection closes after it.
            self.cycle.keep_alive = False
            return
        body = error_body(message, "invalid_request_error", None, code)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % (status, reason, len(body)) + body)
        # Closing with unread bytes in the socket would reset the connection and the client
        # might never read the answer; drain for a moment, then close.
        self.loop.call_later(1.0, self.transport.close)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What the protocol enforces on each connection: the policy's `server:` keys."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 75.0


def server_config(app: Any, host: str, port: int, max_concurrency: int | None,
            limits: ConnectionLimits) -> uvicorn.Config:
    protocol = type("GatewayHttpProtocol", (BoundedHttpToolsProtocol,),
                    {"max_header_bytes": limits.max_header_bytes,
                     "header_timeout_s": limits.header_timeout_s,
                     "keep_alive_timeout_s": limits.keep_alive_timeout_s})
    return uvicorn.Config(
        app, host=host, port=port, loop="uvloop", http=protocol, lifespan="auto",
        log_level="warning", access_log=False, timeout_graceful_shutdown=5, backlog=4096,
        # The gateway reads neither the caller's address nor its scheme, so uvicorn's
        # X-Forwarded-* middleware was only a coroutine more held by every stream, and a scan
        # of every request's headers.
        proxy_headers=False,
        # uvicorn's own cap is the backstop behind the gateway's OpenAI-shaped 503.
        limit_concurrency=max_concurrency)


def run(app: Any, host: str, port: int, *, limits: ConnectionLimits,
        max_concurrency: int | None, admin_app: Any | None = None,
        admin_host: str = "127.0.0.1", admin_port: int | None = None,
        on_sighup: Any | None = None, sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGTERM/SIGINT; `sockets`: listen on these (bound by serving/workers.py)."""
    main = uvicorn.Server(server_config(app, host, port, max_concurrency, limits))
    servers = [main]
    if admin_app is not None and admin_port is not None:
        admin = uvicorn.Server(server_config(admin_app, admin_host, admin_port, 64, limits))
        admin.config.lifespan = "off"
        servers.append(admin)

    async def serve_all() -> None:
        loop = asyncio.get_running_loop()
        if on_sighup is not None:
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(on_sighup()))
        tasks = [asyncio.create_task(s.serve(sockets if s is main else None))
                 for s in servers]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for s in servers:  # one stopped (signal): stop the other too
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)

    import uvloop

    sys.setswitchinterval(float(os.environ.get(SWITCH_INTERVAL_ENV, SWITCH_INTERVAL_S)))
    uvloop.run(serve_all())
