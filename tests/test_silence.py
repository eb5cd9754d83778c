"""One timer watches every stream's silence (gateway/upstream/silence.py): it ends the silent
streams only, by a tick at most late, and stops itself when no stream is open. The real engine path
(a simulated engine silent mid-stream) is in tests/test_gateway_errors.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import pytest

from gateway.upstream.errors import Silent
from gateway.upstream.silence import NOT_WAITING, Silences


@dataclass
class _Answer:
    """What the watch uses of an answer (gateway/upstream/base.py's `Answer`)."""

    stoppable: bool = True  # the client's own read timeout can be turned off
    timer_on: bool = True
    error: BaseException | None = None

    def stop_read_timeout(self) -> bool:
        if self.stoppable:
            self.timer_on = False
        return self.stoppable

    def fail(self, exc: BaseException) -> None:
        self.error = exc


@pytest.mark.anyio
async def test_one_timer_ends_the_silent_stream_only_and_stops_when_none_is_open() -> None:
    loop = asyncio.get_running_loop()
    silences = Silences(loop, timeout_s=0.2)  # ticks every 0.05 s
    silent, flowing, own = _Answer(), _Answer(), _Answer(stoppable=False)
    w_silent = silences.watch(cast(Any, silent))
    w_flowing = silences.watch(cast(Any, flowing))
    silences.watch(cast(Any, own))  # its client watches each read itself: not watched here
    assert not silent.timer_on
    w_silent.since = loop.time()  # waiting on the engine from now
    for _ in range(8):  # 0.4 s: the flowing one reads every 0.05 s
        w_flowing.since = loop.time()
        await asyncio.sleep(0.05)
        w_flowing.since = NOT_WAITING
    assert isinstance(silent.error, Silent)
    assert flowing.error is None and own.error is None
    silences.close(w_flowing)
    await asyncio.sleep(0.1)
    assert silences._handle is None  # no stream open: no timer either
