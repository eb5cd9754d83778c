"""The longest an engine may stay silent mid-stream, watched with one timer a stream.

aiohttp's `sock_read` timeout re-arms a timer on every read of the connection: under uvloop a
TimerHandle and a libuv timer made, and the previous pair closed, for each streamed chunk
(3.9-5.2 us of CPU a chunk at 300 streams, benchmarks/read_timer.py: its heap holds a timer
per stream; 15,000 chunks a second there). A stream that is flowing never comes near its
timeout (600 s by default), so the watch keeps one timer set for the whole interval and moves
it only when it fires: if the relay has not been waiting on the engine that long, the timer is
set again for when it would have been. The client's own read timeout (aiohttp's, or
gateway/http1.py's) still bounds the wait for the answer's headers (a long prefill is silent
there); the watch turns it off for the body.

The relay marks when it starts waiting for the engine's next read (`since`) and that it stopped
(`since = NOT_WAITING`), so time spent writing to a slow caller (the ASGI server's drain) is not
taken for the engine's silence, as aiohttp does not count a read it paused itself.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
from aiohttp.client_exceptions import SocketTimeoutError

from gateway.http1 import Response

NOT_WAITING = math.inf


class SilenceWatch:
    """Ends `resp`'s body with aiohttp's own read timeout error once the relay has waited
    `timeout_s` for a read; `close` when the stream ends. A body with no connection left to
    read (all of it here already) is not watched."""

    __slots__ = ("_content", "_handle", "_loop", "_timeout", "since")

    def __init__(self, loop: asyncio.AbstractEventLoop, resp: aiohttp.ClientResponse | Response,
                 timeout_s: float) -> None:
        self._loop = loop
        self._content = resp.content
        self._timeout = timeout_s
        self.since = NOT_WAITING  # when the relay began waiting for the engine's next read
        self._handle: asyncio.TimerHandle | None = None
        conn = resp.connection
        protocol = conn.protocol if conn is not None else None
        if protocol is not None:
            # aiohttp's per-read timer off for the rest of this body (the connection's next
            # request sets it again). The one armed by the last read still runs; the next
            # read cancels it and, with no timeout, arms none.
            protocol.read_timeout = None
            self._handle = loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        due = self.since + self._timeout
        if due <= now:
            self._handle = None
            self._content.set_exception(
                SocketTimeoutError("Timeout on reading data from socket"))
            return
        self._handle = self._loop.call_at(min(due, now + self._timeout), self._check)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
