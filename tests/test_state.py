"""One test body for every state backend: memory and a real Redis (never skipped)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable

import pytest

from gateway.state import Lease, Limits, MemoryState, StateBackend, create_state


@pytest.fixture(params=["memory", "redis"])
def make_state(request: pytest.FixtureRequest, redis_url: str) -> Callable[[], StateBackend]:
    """A factory: a Redis client must be made inside the event loop that uses it."""
    if request.param == "memory":
        return MemoryState
    return lambda: create_state(redis_url)


def pool() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"  # fresh keys per test, even on a shared Redis


def test_reserve_within_limits_and_release_to_zero(make_state: Callable[[], StateBackend]) -> None:
    p = pool()

    async def go() -> None:
        state = make_state()
        limits = Limits(max_blocks=100, max_tokens=None)
        a = Lease(p, "b0", "a", 60, 900)
        b = Lease(p, "b0", "b", 50, 800)
        c = Lease(p, "b1", "c", 50, 800)
        assert (await state.reserve(a, limits, 30)).ok
        refused = await state.reserve(b, limits, 30)
        assert not refused.ok and refused.reason == "kv_blocks"
        assert refused.backend_blocks == 60
        assert (await state.reserve(c, limits, 30)).ok  # another backend has its own blocks
        usage = await state.usage(p)
        assert usage.blocks == {"b0": 60, "b1": 50} and usage.tokens == 1700
        await state.release(a)
        await state.release(a)  # twice is harmless
        await state.release(c)
        usage = await state.usage(p)
        assert usage.blocks == {"b0": 0, "b1": 0} and usage.tokens == 0
        await state.close()

    asyncio.run(go())


def test_token_limit_admits_a_lone_large_request(make_state: Callable[[], StateBackend]) -> None:
    p = pool()

    async def go() -> None:
        state = make_state()
        limits = Limits(max_blocks=10_000, max_tokens=1000)
        big = Lease(p, "b0", "big", 10, 5000)
        assert (await state.reserve(big, limits, 30)).ok  # alone: never starved by the limit
        small = Lease(p, "b0", "small", 1, 10)
        refused = await state.reserve(small, limits, 30)
        assert not refused.ok and refused.reason == "inflight_tokens"
        await state.release(big)
        assert (await state.reserve(small, limits, 30)).ok
        await state.release(small)
        await state.close()

    asyncio.run(go())


def test_leases_expire_unless_refreshed(make_state: Callable[[], StateBackend]) -> None:
    p = pool()

    async def go() -> None:
        state = make_state()
        limits = Limits(max_blocks=100, max_tokens=None)
        kept = Lease(p, "b0", "kept", 10, 10)
        lost = Lease(p, "b0", "lost", 20, 20)
        assert (await state.reserve(kept, limits, 0.3)).ok
        assert (await state.reserve(lost, limits, 0.3)).ok
        for _ in range(3):
            await asyncio.sleep(0.15)
            await state.refresh([kept], 0.3)
        usage = await state.usage(p)
        assert usage.blocks == {"b0": 10} and usage.tokens == 10
        await state.release(kept)
        await state.close()

    asyncio.run(go())


def test_redis_url_is_required_by_make_test() -> None:
    assert os.environ.get("REDIS_URL"), "make test must export REDIS_URL"
