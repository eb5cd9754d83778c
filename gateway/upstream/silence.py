"""The longest an engine may stay silent mid-stream, watched by one timer for every stream.

A per-read timeout re-arms a timer on every read of the connection (aiohttp's `sock_read`:
under uvloop a TimerHandle and a libuv timer made, and the previous pair closed, for each
streamed chunk, 3.9-5.2 us of CPU a chunk at 300 streams). A stream that is flowing never comes
near its timeout (600 s by default), so one timer of the forwarder's, ticking every second (a
quarter of the timeout where that is shorter) while any stream is open, ends each stream whose
relay has waited on the engine past the timeout: late by a tick at most. The client's own read
timeout still bounds the wait for the answer's head (a long prefill is silent there); the watch
turns it off for the body where the client lets it (the gateway's own client does; on
aiohttp's, `sock_read` goes on watching each read and no watch is kept).

The relay marks when it starts waiting for the engine's next read (`since`) and that it stopped
(`since = NOT_WAITING`), so time spent writing to a slow caller (the ASGI server's drain) is not
taken for the engine's silence.
"""

from __future__ import annotations

import asyncio
import math

from gateway.upstream.base import Answer
from gateway.upstream.errors import Silent

NOT_WAITING = math.inf
TICK_S = 1.0  # the most a silent stream outlives its timeout


class SilenceWatch:
    """One stream's body: `since` is when its relay began waiting for the engine's next read."""

    __slots__ = ("answer", "since")

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.since = NOT_WAITING


class Silences:
    """Ends a watched body with `Silent` once its relay has waited `timeout_s` for a read;
    `close` each watch when its stream ends."""

    __slots__ = ("_handle", "_loop", "_open", "_tick", "_timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._timeout = timeout_s
        self._tick = min(TICK_S, timeout_s / 4)
        self._open: set[SilenceWatch] = set()
        self._handle: asyncio.TimerHandle | None = None  # set while any watch is open

    def watch(self, answer: Answer) -> SilenceWatch:
        watch = SilenceWatch(answer)
        if answer.stop_read_timeout():
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
            watch.answer.fail(Silent(f"no read from the engine within {self._timeout:g}s"))
        self._handle = self._loop.call_later(self._tick, self._check) if self._open else None
