"""Reservations in this process: the default, with no dependencies.

Correct for one gateway process. Several replicas each with memory state would each admit up
to the whole budget; use the Redis state for those.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from gateway.state.base import (
    HOLD_TTL_S,
    Bucket,
    BucketResult,
    Lease,
    Limits,
    PoolUsage,
    ReserveResult,
    StateBackend,
)

KEPT_MAX = 100_000  # remembered keys (stored responses' backends) kept in one process


class MemoryState(StateBackend):
    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # (pool, id) -> the lease, and -> its expiry.
        self._leases: dict[tuple[str, str], Lease] = {}
        self._expires: dict[tuple[str, str], float] = {}
        self._expiry: list[tuple[float, str, str]] = []  # heap of (expiry, pool, id)
        self._blocks: dict[tuple[str, str], int] = {}
        self._tokens: dict[str, int] = {}
        self._tenants: dict[tuple[str, str], int] = {}  # (pool, tenant) -> blocks
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (level, at)
        self._kept: dict[str, tuple[str, float]] = {}  # remember(): key -> (value, expiry)
        self._holds: dict[tuple[str, str], tuple[int, float]] = {}  # (bucket, hold) -> taken

    def _purge(self) -> None:
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, pool, lease_id = heapq.heappop(self._expiry)
            key = (pool, lease_id)
            expiry = self._expires.get(key)
            if expiry is not None and expiry <= now:
                self._drop(self._leases[key])

    def _drop(self, lease: Lease) -> None:
        held = (lease.pool, lease.lease_id)
        del self._leases[held], self._expires[held]
        key = (lease.pool, lease.backend)
        self._blocks[key] -= lease.blocks
        self._tokens[lease.pool] -= lease.tokens
        self._tenants[(lease.pool, lease.tenant)] -= lease.blocks

    async def reserve(self, lease: Lease, limits: Limits, ttl_s: float) -> ReserveResult:
        self._purge()
        key = (lease.pool, lease.backend)
        blocks = self._blocks.get(key, 0)
        tokens = self._tokens.get(lease.pool, 0)
        if blocks + lease.blocks > limits.max_blocks:
            return ReserveResult(False, blocks, tokens, "kv_blocks")
        if limits.max_tokens is not None and tokens > 0 \
                and tokens + lease.tokens > limits.max_tokens:
            return ReserveResult(False, blocks, tokens, "inflight_tokens")
        tenant_key = (lease.pool, lease.tenant)
        held = self._tenants.get(tenant_key, 0)
        if limits.tenant_max_blocks is not None and held > 0 \
                and held + lease.blocks > limits.tenant_max_blocks:
            return ReserveResult(False, blocks, tokens, "tenant_share")
        self._tenants[tenant_key] = held + lease.blocks
        expiry = self.clock() + ttl_s
        self._leases[(lease.pool, lease.lease_id)] = lease
        self._expires[(lease.pool, lease.lease_id)] = expiry
        heapq.heappush(self._expiry, (expiry, lease.pool, lease.lease_id))
        self._blocks[key] = blocks + lease.blocks
        self._tokens[lease.pool] = tokens + lease.tokens
        return ReserveResult(True, blocks + lease.blocks, tokens + lease.tokens)

    async def release(self, lease: Lease) -> None:
        held = self._leases.get((lease.pool, lease.lease_id))
        if held is not None:
            self._drop(held)

    async def refresh(self, leases: list[Lease], ttl_s: float) -> None:
        expiry = self.clock() + ttl_s
        for lease in leases:
            key = (lease.pool, lease.lease_id)
            if key in self._expires:
                self._expires[key] = expiry
                heapq.heappush(self._expiry, (expiry, lease.pool, lease.lease_id))

    def _level(self, bucket: Bucket) -> float:
        now = self.clock()
        level, at = self._buckets.get(bucket.key, (float(bucket.capacity), now))
        return min(float(bucket.capacity), level + (now - at) * bucket.refill_per_s)

    def _result(self, bucket: Bucket, ok: bool, level: float) -> BucketResult:
        self._buckets[bucket.key] = (level, self.clock())
        reset = (bucket.capacity - level) / bucket.refill_per_s if bucket.refill_per_s else 0.0
        return BucketResult(ok, int(level), max(0.0, reset))

    async def take(self, bucket: Bucket, amount: int, hold: str = "",
                   ttl_s: float = HOLD_TTL_S) -> BucketResult:
        level = self._level(bucket)
        if hold and (bucket.key, hold) in self._holds:
            return self._result(bucket, True, level)  # taken already under this hold
        if level >= amount or level >= bucket.capacity:
            if hold:
                self._hold(bucket.key, hold, amount, ttl_s)
            return self._result(bucket, True, level - amount)
        return self._result(bucket, False, level)

    def _hold(self, key: str, hold: str, amount: int, ttl_s: float) -> None:
        now = self.clock()
        if len(self._holds) >= KEPT_MAX:  # bounded: expired ones go first
            self._holds = {k: v for k, v in self._holds.items() if v[1] > now}
        self._holds[(key, hold)] = (amount, now + ttl_s)

    async def settle(self, bucket: Bucket, hold: str, refund: int) -> BucketResult:
        level = self._level(bucket)
        entry = self._holds.pop((bucket.key, hold), None)
        if entry is None or entry[1] <= self.clock():
            return self._result(bucket, False, level)
        return self._result(bucket, True, min(float(bucket.capacity), level + refund))

    def holds(self) -> int:
        """Holds not settled yet (for tests)."""
        return len(self._holds)

    async def adjust(self, bucket: Bucket, delta: int) -> BucketResult:
        level = min(float(bucket.capacity), self._level(bucket) + delta)
        return self._result(bucket, True, level)

    async def usage(self, pool: str) -> PoolUsage:
        self._purge()
        blocks = {b: n for (p, b), n in self._blocks.items() if p == pool}
        return PoolUsage(blocks, self._tokens.get(pool, 0))

    async def remember(self, key: str, value: str, ttl_s: float) -> None:
        now = self.clock()
        if len(self._kept) >= KEPT_MAX:  # bounded: expired ones first, then the oldest
            self._kept = {k: v for k, v in self._kept.items() if v[1] > now}
            while len(self._kept) >= KEPT_MAX:
                del self._kept[next(iter(self._kept))]
        self._kept[key] = (value, now + ttl_s)

    async def recall(self, key: str) -> str | None:
        entry = self._kept.get(key)
        if entry is None or entry[1] <= self.clock():
            self._kept.pop(key, None)
            return None
        return entry[0]
