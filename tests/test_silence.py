"""One timer watches every stream's silence (gateway/silence.py): it ends the silent streams
only, by a tick at most late, and stops itself when no stream is open. The real engine path
(a simulated engine silent mid-stream) is in tests/test_gateway_errors.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from gateway.silence import NOT_WAITING, Silences


@dataclass
class _Content:
    error: BaseException | None = None

    def set_exception(self, exc: BaseException) -> None:
        self.error = exc


@dataclass
class _Protocol:
    read_timeout: float | None = 5.0


@dataclass
class _Connection:
    protocol: _Protocol = field(default_factory=_Protocol)


@dataclass
class _Answer:  # the two things the watch reads of aiohttp's response or gateway/http1.py's
    content: _Content = field(default_factory=_Content)
    connection: _Connection | None = field(default_factory=_Connection)


@pytest.mark.anyio
async def test_one_timer_ends_the_silent_stream_only_and_stops_when_none_is_open() -> None:
    loop = asyncio.get_running_loop()
    silences = Silences(loop, timeout_s=0.2)  # ticks every 0.05 s
    silent, flowing, whole = _Answer(), _Answer(), _Answer(connection=None)
    w_silent = silences.watch(cast(Any, silent))
    w_flowing = silences.watch(cast(Any, flowing))
    silences.watch(cast(Any, whole))  # all of it here already: not watched
    assert silent.connection is not None and silent.connection.protocol.read_timeout is None
    w_silent.since = loop.time()  # waiting on the engine from now
    for _ in range(8):  # 0.4 s: the flowing one reads every 0.05 s
        w_flowing.since = loop.time()
        await asyncio.sleep(0.05)
        w_flowing.since = NOT_WAITING
    assert isinstance(silent.content.error, TimeoutError)
    assert flowing.content.error is None and whole.content.error is None
    silences.close(w_flowing)
    await asyncio.sleep(0.1)
    assert silences._handle is None  # no stream open: no timer either
