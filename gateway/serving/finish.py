"""Work that must finish even if its caller is cancelled, without a task when it need not wait.

A request's release (its reservation, its quota hold) runs in the request's `finally`, where
a second cancellation (the caller gone, the server stopping) could cut it short and leak what
it holds. `asyncio.shield` guards it with a task, made and scheduled for every request, and a
loop turn before the request ends, even where the release finishes without waiting on
anything (the in-memory store, a request that reserved nothing there). `finish` runs the
coroutine at once, as Python 3.12's eager tasks would, and only when it waits hands the rest
to a shielded task (a Redis store's round trip).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar, cast

T = TypeVar("T")


async def finish(coro: Coroutine[Any, Any, T]) -> T:
    """`await asyncio.shield(coro)`, but run eagerly: up to its first wait in the caller, and
    the rest (if any) in a task the caller's cancellation does not reach."""
    try:
        waiting_on = coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    return await asyncio.shield(_rest(coro, waiting_on))


async def _rest(coro: Coroutine[Any, Any, T], waiting_on: Any) -> T:
    return cast(T, await _Resumed(coro, waiting_on))


class _Resumed:
    """A coroutine already started, to be awaited: what the task yields and sends goes to it,
    starting with the future it was waiting on when it was handed over (a `yield from`)."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._waiting_on
        self._waiting_on = None
        while True:
            try:
                sent = yield value
            except BaseException as exc:  # thrown in by the task: passed on
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value
