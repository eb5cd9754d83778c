"""Coroutines run at once, up to their first wait, as Python 3.12's eager tasks run them.

Most awaits on a request's path do not wait: the body came with the head, the in-memory store
answers at once. Guarding such an await the usual way costs as if it would: `asyncio.shield`
makes and schedules a task (and the request ends a loop turn later), `asyncio.timeout` sets
and cancels a timer (6-10 us each here). `start` runs the coroutine first and tells whether
it waited, so the guard is paid only then.

`finish` is the release a request must complete in its `finally`, where a second cancellation
(the caller gone, the server stopping) could cut it short and leak what it holds: run at once,
and only if it waits (a Redis store's round trip) is the rest shielded in a task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Resumed(Generic[T]):
    """A coroutine that `start` ran to its first wait, to be awaited for the rest: what the
    awaiting task yields and sends goes to it, starting with the future it waits on."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, T], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, T]:
        coro, value = self._coro, self._waiting_on
        self._waiting_on = None
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # thrown in by the task (a cancellation): passed on
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]


def start(coro: Coroutine[Any, Any, T]) -> T | Resumed[T]:
    """Run `coro` now: its result if it finished without waiting, else the rest to await
    (await it in the same task, or hand it to one)."""
    try:
        waiting_on = coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    return Resumed(coro, waiting_on)


async def finish(coro: Coroutine[Any, Any, T]) -> T:
    """`await asyncio.shield(coro)`, run eagerly: up to its first wait in the caller, and the
    rest (if any) in a task the caller's cancellation does not reach."""
    started = start(coro)
    if not isinstance(started, Resumed):
        return started
    return await asyncio.shield(_rest(started))


async def _rest(resumed: Resumed[T]) -> T:
    return await resumed
