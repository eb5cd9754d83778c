"""The seam between admission and where reservations live: one process, or Redis.

A reservation is a lease: KV blocks and tokens held on one backend by one in-flight request,
with an expiry. The request refreshes it while it lives and releases it when it ends; a
replica that crashes stops refreshing, and its leases expire by themselves.

Every check-and-reserve is atomic: the backend's blocks and the pool's tokens are checked
against their limits and taken in one step, so two replicas can never both take the last
blocks. Time comes from the store (Redis `TIME`), not from each replica's clock.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    pool: str
    backend: str
    lease_id: str
    blocks: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Limits:
    max_blocks: int  # on the backend
    max_tokens: int | None  # in flight on the whole pool; None: no limit


@dataclass(frozen=True, slots=True)
class PoolUsage:
    blocks: dict[str, int]  # reserved KV blocks per backend
    tokens: int  # reserved tokens on the whole pool


@dataclass(frozen=True, slots=True)
class ReserveResult:
    ok: bool
    backend_blocks: int  # the backend's reserved blocks after the call
    pool_tokens: int  # the pool's reserved tokens after the call
    reason: str = ""  # "kv_blocks" or "inflight_tokens" when refused


class StateError(Exception):
    """The store could not be reached or answered wrongly; admission applies its fail mode."""


class StateBackend(abc.ABC):
    """Reservations shared by every replica that uses the same store."""

    name: str

    @abc.abstractmethod
    async def reserve(self, lease: Lease, limits: Limits, ttl_s: float) -> ReserveResult:
        """Take the lease if the backend's blocks and the pool's tokens stay within limits.

        A request alone on an empty pool is admitted whatever its tokens, so that the token
        limit can never starve a large request forever; blocks are never exceeded.
        """

    @abc.abstractmethod
    async def release(self, lease: Lease) -> None:
        """Give the lease back; releasing one that expired or was released is a no-op."""

    @abc.abstractmethod
    async def refresh(self, leases: list[Lease], ttl_s: float) -> None:
        """Push the expiry of live leases forward (one round trip for all of them)."""

    @abc.abstractmethod
    async def usage(self, pool: str) -> PoolUsage:
        """Reserved blocks per backend and tokens of the pool, expired leases dropped."""

    async def heartbeat(self, replica_id: str, ttl_s: float) -> int:
        """Announce this replica; return how many replicas are alive (for fail-open shares)."""
        return 1

    async def close(self) -> None:
        return None
