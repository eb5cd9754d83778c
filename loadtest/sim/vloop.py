"""An asyncio event loop on a virtual clock: sleeping costs nothing, time jumps to the next timer.

The fleet simulation (`loadtest/fleet.py`) runs the gateway's own admission code, which is
asynchronous (its queue waits on futures under `asyncio.timeout`, its ticker sleeps), beside
the simulated engines' step loops. On this loop `loop.time()` is a virtual clock that starts
at 0, and the selector, instead of blocking until the next timer is due, moves the clock to it
and reports no I/O. Every `asyncio.sleep`, `asyncio.timeout` and `call_later` therefore works
unchanged, in the order real time would give, as fast as the callbacks themselves run; the same
inputs always give the same schedule.

Nothing on this loop may wait on real I/O or threads (there is none to wait for): a loop with no
timer and nothing ready has nothing that could ever wake it, and `select` says so
(`Deadlock`) instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class Deadlock(RuntimeError):
    """Every task waits and no timer is set: nothing can happen any more."""


class _Clock:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0


class _VirtualSelector(selectors.BaseSelector):
    """Holds registrations (the loop's self-pipe) but never reports I/O; select() advances time."""

    def __init__(self, clock: _Clock) -> None:
        self._clock = clock
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlock("every task waits and no timer is set")
        if timeout > 0:
            self._clock.now += timeout
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._vclock = _Clock()
        super().__init__(_VirtualSelector(self._vclock))

    def time(self) -> float:
        return self._vclock.now


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on a fresh virtual loop."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
