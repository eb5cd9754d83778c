"""One test body for every state backend: memory, a real Redis (never skipped), a 3-primary
Redis Cluster and a Sentinel-managed primary (both started here, tests/redis_topologies.py)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest

from gateway.state import Bucket, Lease, Limits, MemoryState, StateBackend, create_state
from tests.redis_topologies import redis_cluster, redis_sentinels

MakeState = Callable[..., Awaitable[StateBackend]]


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_cluster(tmp_path_factory.mktemp("cluster"), primaries=3, replicas=0) as c:
        yield c.url


@pytest.fixture(scope="module")
def sentinel_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_sentinels(tmp_path_factory.mktemp("sentinel")) as s:
        yield s.url


@pytest.fixture(params=["memory", "redis", "cluster", "sentinel"])
def make_state(request: pytest.FixtureRequest, redis_url: str) -> MakeState:
    """A factory: a Redis client must be made inside the event loop that uses it, and is
    warmed as the gateway's lifespan warms it (the slot map, the primary, the scripts)."""
    url = None if request.param == "memory" else {
        "redis": redis_url, "cluster": request.getfixturevalue("cluster_url"),
        "sentinel": request.getfixturevalue("sentinel_url")}[request.param]

    async def make(prefix: str = "gw") -> StateBackend:
        state = create_state(url, prefix)
        assert await state.warm(5.0)
        return state
    return make


def pool() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"  # fresh keys per test, even on a shared Redis


@pytest.mark.anyio
async def test_reserve_within_limits_and_release_to_zero(
        make_state: MakeState) -> None:
    p = pool()
    state = await make_state()
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


@pytest.mark.anyio
async def test_token_limit_admits_a_lone_large_request(
        make_state: MakeState) -> None:
    p = pool()
    state = await make_state()
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


@pytest.mark.anyio
async def test_leases_expire_unless_refreshed(make_state: MakeState) -> None:
    p = pool()
    state = await make_state()
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


def test_redis_url_is_required_by_make_test() -> None:
    assert os.environ.get("REDIS_URL"), "make test must export REDIS_URL"


@pytest.mark.anyio
async def test_tenant_share_of_a_pool(make_state: MakeState) -> None:
    p = pool()
    state = await make_state()
    limits = Limits(max_blocks=100, max_tokens=None, tenant_max_blocks=30)
    a = Lease(p, "b0", "a", 20, 10, tenant="team-a")
    assert (await state.reserve(a, limits, 30)).ok
    refused = await state.reserve(Lease(p, "b1", "b", 20, 10, tenant="team-a"), limits, 30)
    assert not refused.ok and refused.reason == "tenant_share"
    other = Lease(p, "b1", "c", 20, 10, tenant="team-b")
    assert (await state.reserve(other, limits, 30)).ok
    await state.release(a)
    again = Lease(p, "b1", "d", 20, 10, tenant="team-a")
    assert (await state.reserve(again, limits, 30)).ok
    for lease in (other, again):
        await state.release(lease)
    await state.close()


@pytest.mark.anyio
async def test_token_bucket_take_refund_and_refill(make_state: MakeState) -> None:
    key = f"tenant-{uuid.uuid4().hex[:8]}"
    state = await make_state()
    bucket = Bucket(key, capacity=1000, refill_per_s=100.0)
    first = await state.take(bucket, 700)
    assert first.ok and 299 <= first.remaining <= 301
    assert 6.5 <= first.reset_s <= 7.5
    refused = await state.take(bucket, 500)
    assert not refused.ok
    await state.adjust(bucket, 300)  # the request never ran: refund
    assert (await state.take(bucket, 500)).ok
    await state.adjust(bucket, -400)  # it used more than reserved: reconcile
    low = await state.take(bucket, 1)
    assert low.remaining < 300
    await asyncio.sleep(0.3)  # refills at 100 tokens/s
    later = await state.adjust(bucket, 0)
    assert later.remaining >= low.remaining + 20
    big = Bucket(f"{key}-big", capacity=100, refill_per_s=1.0)
    assert (await state.take(big, 5000)).ok  # a full bucket gives once, even too much
    assert not (await state.take(big, 1)).ok
    await state.close()


@pytest.mark.anyio
async def test_remembered_values_are_shared_and_expire(
        make_state: MakeState) -> None:
    # Which backend stored a Responses API response: every replica must find it (Redis).
    key = f"response:{pool()}"
    writer, reader = await make_state(), await make_state()
    if isinstance(writer, MemoryState):
        reader = writer  # one process's memory: shared with itself only
    await writer.remember(key, "default\tb1\t42", 0.3)
    assert await reader.recall(key) == "default\tb1\t42"
    assert await reader.recall(key + "-other") is None
    await asyncio.sleep(0.45)
    assert await reader.recall(key) is None
    await writer.close()
    if reader is not writer:
        await reader.close()


@pytest.mark.anyio
async def test_a_quota_hold_settles_once(make_state: MakeState) -> None:
    # What a request took is held under its id until it settles; a settle sent again (after
    # a failure that may have run) or for a hold never taken changes nothing.
    key = f"tenant-{uuid.uuid4().hex[:8]}"
    state = await make_state()
    bucket = Bucket(key, capacity=1000, refill_per_s=0.001)
    assert (await state.take(bucket, 600, "r1")).remaining == 400
    assert (await state.take(bucket, 600, "r1")).remaining == 400  # a retried take: once
    assert not (await state.take(bucket, 600, "r2")).ok  # 400 left
    settled = await state.settle(bucket, "r1", 500)  # used 100 of the 600
    assert settled.ok and settled.remaining == 900
    again = await state.settle(bucket, "r1", 500)
    assert not again.ok and again.remaining == 900
    assert not (await state.settle(bucket, "never-taken", 500)).ok
    assert (await state.take(bucket, 300, "r3")).remaining == 600
    assert (await state.settle(bucket, "r3", -200)).remaining == 400  # used 500: more taken
    await state.close()


@pytest.mark.anyio
async def test_a_quota_hold_expires_taken(make_state: MakeState) -> None:
    key = f"tenant-{uuid.uuid4().hex[:8]}"
    state = await make_state()
    bucket = Bucket(key, capacity=1000, refill_per_s=0.001)
    await state.take(bucket, 600, "gone", ttl_s=0.2)  # its replica died before settling
    await asyncio.sleep(0.35)
    late = await state.settle(bucket, "gone", 600)
    assert not late.ok and late.remaining == 400  # what it took stays taken
    await state.close()


@pytest.mark.anyio
async def test_replicas_count_each_other(make_state: MakeState) -> None:
    prefix = f"hb-{uuid.uuid4().hex[:8]}"  # its own heartbeat key, even on a shared Redis
    a, b = await make_state(prefix), await make_state(prefix)
    if isinstance(a, MemoryState):
        assert await a.heartbeat("a", 0.3) == 1  # one process: alone by definition
        return
    assert await a.heartbeat("a", 0.3) == 1
    assert await b.heartbeat("b", 0.3) == 2
    await asyncio.sleep(0.45)  # a stopped beating: it no longer counts
    assert await b.heartbeat("b", 0.3) == 1
    await a.close()
    await b.close()


@pytest.mark.anyio
@pytest.mark.parametrize("url", ["redis://127.0.0.1:1", "redis+cluster://127.0.0.1:1"])
async def test_warming_a_store_that_is_down_gives_up_in_time(url: str) -> None:
    # The gateway warms its store at start; a store down then delays the start by no more
    # than the deadline, and calls later take the fail mode (tests/test_state_breaker.py).
    state = create_state(url, "gw")
    started = time.monotonic()
    assert not await state.warm(1.0)
    assert time.monotonic() - started < 1.5
    await state.close()
