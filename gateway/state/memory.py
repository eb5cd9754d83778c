"""Reservations in this process: the default, with no dependencies.

Correct for one gateway process. Several replicas each with memory state would each admit up
to the whole budget; use the Redis state for those.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from gateway.state.base import Lease, Limits, PoolUsage, ReserveResult, StateBackend


class MemoryState(StateBackend):
    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._leases: dict[tuple[str, str], tuple[Lease, float]] = {}  # (pool, id) -> expiry
        self._expiry: list[tuple[float, str, str]] = []  # heap of (expiry, pool, id)
        self._blocks: dict[tuple[str, str], int] = {}
        self._tokens: dict[str, int] = {}

    def _purge(self) -> None:
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            expiry, pool, lease_id = heapq.heappop(self._expiry)
            entry = self._leases.get((pool, lease_id))
            if entry is not None and entry[1] <= now:
                self._drop(entry[0])

    def _drop(self, lease: Lease) -> None:
        del self._leases[(lease.pool, lease.lease_id)]
        key = (lease.pool, lease.backend)
        self._blocks[key] -= lease.blocks
        self._tokens[lease.pool] -= lease.tokens

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
        expiry = self.clock() + ttl_s
        self._leases[(lease.pool, lease.lease_id)] = (lease, expiry)
        heapq.heappush(self._expiry, (expiry, lease.pool, lease.lease_id))
        self._blocks[key] = blocks + lease.blocks
        self._tokens[lease.pool] = tokens + lease.tokens
        return ReserveResult(True, blocks + lease.blocks, tokens + lease.tokens)

    async def release(self, lease: Lease) -> None:
        entry = self._leases.get((lease.pool, lease.lease_id))
        if entry is not None:
            self._drop(entry[0])

    async def refresh(self, leases: list[Lease], ttl_s: float) -> None:
        expiry = self.clock() + ttl_s
        for lease in leases:
            key = (lease.pool, lease.lease_id)
            if key in self._leases:
                self._leases[key] = (self._leases[key][0], expiry)
                heapq.heappush(self._expiry, (expiry, lease.pool, lease.lease_id))

    async def usage(self, pool: str) -> PoolUsage:
        self._purge()
        blocks = {b: n for (p, b), n in self._blocks.items() if p == pool}
        return PoolUsage(blocks, self._tokens.get(pool, 0))
