"""The longest an engine may stay silent mid-stream, watched by one timer for every stream.

aiohttp's `sock_read` timeout re-arms a timer on every read of the connection: under uvloop a
TimerHandle and a libuv timer made, and the previous pair closed, for each streamed chunk
(3.9-5.2 us of CPU a chunk at 300 streams, benchmarks/read_timer.py: its heap holds a timer
per stream; 15,000 chunks a second there). A stream that is flowing never comes near its
timeout (600 s by default), so one timer of the forwarder's, ticking every second (a quarter of
the timeout where that is shorter) while any stream is open, ends each stream whose relay has
waited on the engine past the timeout: late by a tick at most. A timer of each stream's own
kept four objects alive per stream (the handle, libuv's timer, its callback and context)
that the garbage collector's sweep walks (gateway/serving/heap.py). The client's own read
timeout (aiohttp's, or gateway/http1.py's) still bounds the wait for the answer's headers (a
long prefill is silent there); the watch turns it off for the body.

The relay marks when it starts waiting for the engine's next read (`since`) and that it stopped
(`since = NOT_WAITING`), so time spent writing to a slow caller (the ASGI server's drain) is not
taken for the engine's silence, as aiohttp does not count a read it paused itself.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
from aiohttp.client_exceptions import SocketTimeoutError

from gateway.http1 import Body, Response

NOT_WAITING = math.inf
TICK_S = 1.0  # the most a silent stream outlives its timeout


class SilenceWatch:
    """One stream's body: `since` is when its relay began waiting for the engine's next read."""

    __slots__ = ("content", "since")

    def __init__(self, content: aiohttp.StreamReader | Body) -> None:
        self.content = content
        self.since = NOT_WAITING


class Silences:
    """Ends a watched body with aiohttp's own read timeout error once its relay has waited
    `timeout_s` for a read; `close` each watch when its stream ends. A body with no connection
    left to read (all of it here already) is not watched."""

    __slots__ = ("_handle", "_loop", "_open", "_tick", "_timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._timeout = timeout_s
        self._tick = min(TICK_S, timeout_s / 4)
        self._open: set[SilenceWatch] = set()
        self._handle: asyncio.TimerHandle | None = None  # set while any watch is open

    def watch(self, resp: aiohttp.ClientResponse | Response) -> SilenceWatch:
        watch = SilenceWatch(resp.content)
        conn = resp.connection
        protocol = conn.protocol if conn is not None else None
        if protocol is not None:
            # aiohttp's per-read timer off for the rest of this body (the connection's next
            # request sets it again). The one armed by the last read still runs; the next
            # read cancels it and, with no timeout, arms none.
            protocol.read_timeout = None
            self._open.add(watch)
            if self._handle is None:
                self._handle = self._loop.call_later(self._tick, self._check)
        return watch

    def close(self, watch: SilenceWatch) -> None:
        self._open.discard(watch)  # the timer stops itself once none is open

    def _check(self) -> None:
        limit = self._loop.time() - self._timeout
        silent = [w for w in self._open if w.since <= limit]
        for watch in silent:
            self._open.discard(watch)
            watch.content.set_exception(SocketTimeoutError("Timeout on reading data from socket"))
        self._handle = self._loop.call_later(self._tick, self._check) if self._open else None
