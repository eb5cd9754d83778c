"""`start` and `finish`: coroutines run at once, guarded only once they wait."""

from __future__ import annotations

import asyncio

import pytest

from gateway.pipeline.eager import Resumed, finish, start


@pytest.mark.anyio
async def test_work_that_never_waits_runs_at_once_without_a_task() -> None:
    ran: list[str] = []

    async def release() -> int:
        ran.append("released")
        return 7

    before = len(asyncio.all_tasks())
    call = asyncio.ensure_future(finish(release()))
    assert ran == []  # not yet: the caller's task has not started
    assert await call == 7 and ran == ["released"]
    assert len(asyncio.all_tasks()) == before


@pytest.mark.anyio
async def test_work_that_waits_finishes_though_its_caller_is_cancelled() -> None:
    steps: list[str] = []
    gate = asyncio.Event()

    async def release() -> str:
        steps.append("local books")
        await gate.wait()
        steps.append("the store")
        await asyncio.sleep(0)
        steps.append("done")
        return "ok"

    async def request() -> str:
        try:
            await asyncio.sleep(3600)
        finally:
            return await finish(release())  # noqa: B012 - the release's result is the test's

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0)
    task.cancel()  # the caller leaves: the release starts in the finally
    await asyncio.sleep(0)
    assert steps == ["local books"]
    task.cancel()  # a second cancellation, while the release waits
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["local books", "the store", "done"]


@pytest.mark.anyio
async def test_errors_reach_the_caller_before_and_after_a_wait() -> None:
    async def fails_at_once() -> None:
        raise ValueError("at once")

    async def fails_later() -> None:
        await asyncio.sleep(0)
        raise KeyError("later")

    with pytest.raises(ValueError, match="at once"):
        await finish(fails_at_once())
    with pytest.raises(KeyError, match="later"):
        await finish(fails_later())


@pytest.mark.anyio
async def test_what_the_awaited_futures_give_is_passed_on() -> None:
    loop = asyncio.get_running_loop()

    async def reads() -> int:
        first: asyncio.Future[int] = loop.create_future()
        loop.call_soon(first.set_result, 20)
        second: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.01, second.set_result, 22)
        return await first + await second

    assert await finish(reads()) == 42


@pytest.mark.anyio
async def test_start_tells_whether_it_waited() -> None:
    async def ready() -> str:
        return "body"

    gate = asyncio.Event()

    async def waits() -> str:
        await gate.wait()
        return "later"

    assert start(ready()) == "body"
    rest = start(waits())
    assert isinstance(rest, Resumed)
    asyncio.get_running_loop().call_soon(gate.set)
    assert await rest == "later"


@pytest.mark.anyio
async def test_a_timeout_around_the_rest_cancels_it() -> None:
    cancelled: list[bool] = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    rest = start(waits_forever())
    assert isinstance(rest, Resumed)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await rest
    assert cancelled == [True]
