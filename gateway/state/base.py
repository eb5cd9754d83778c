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

from gateway.records import record


@record
class Lease:
    pool: str
    backend: str
    lease_id: str
    blocks: int
    tokens: int
    tenant: str = ""


@record
class Limits:
    max_blocks: int  # on the backend
    max_tokens: int | None  # in flight on the whole pool; None: no limit
    tenant_max_blocks: int | None = None  # the lease's tenant, across the pool's backends


@record
class Bucket:
    """A token bucket: `capacity` tokens, refilled at `refill_per_s`."""

    key: str
    capacity: int
    refill_per_s: float


@record
class BucketResult:
    ok: bool
    remaining: int  # tokens left after the call (may be negative after a reconciliation)
    reset_s: float  # until the bucket is full again


@record
class PoolUsage:
    blocks: dict[str, int]  # reserved KV blocks per backend
    tokens: int  # reserved tokens on the whole pool


@record
class ReserveResult:
    ok: bool
    backend_blocks: int  # the backend's reserved blocks after the call
    pool_tokens: int  # the pool's reserved tokens after the call
    reason: str = ""  # "kv_blocks", "inflight_tokens" or "tenant_share" when refused


# A quota hold outlives any request (a stream's reads are at most upstream.read_timeout_s
# apart, but a stream may run for hours); it only bounds the bookkeeping of a replica that died.
HOLD_TTL_S = 86_400.0


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

    @abc.abstractmethod
    async def take(self, bucket: Bucket, amount: int, hold: str = "",
                   ttl_s: float = HOLD_TTL_S) -> BucketResult:
        """Take `amount` from the bucket if it holds that much. A full bucket always gives,
        even more than it holds (going negative), so a request larger than a whole quota
        window is admitted once rather than refused forever.

        With a `hold` id, what was taken is held under that id until `settle` (or `ttl_s`,
        after which it stays taken); a take repeated with the same id takes nothing more."""

    @abc.abstractmethod
    async def settle(self, bucket: Bucket, hold: str, refund: int) -> BucketResult:
        """End a hold: put `refund` back (taken - used; negative takes more), once. A hold
        that is not there (settled already, expired, never taken) changes nothing: ok False.
        So a settle may be sent again after a failure that may or may not have run."""

    @abc.abstractmethod
    async def adjust(self, bucket: Bucket, delta: int) -> BucketResult:
        """Put `delta` tokens back (a refund) or, negative, take more (reconciliation);
        never above capacity."""

    @abc.abstractmethod
    async def remember(self, key: str, value: str, ttl_s: float) -> None:
        """Keep `value` under `key` for `ttl_s` (which backend holds a stored response)."""

    @abc.abstractmethod
    async def recall(self, key: str) -> str | None:
        """What `remember` kept under `key`, while it lives; None otherwise."""

    async def heartbeat(self, replica_id: str, ttl_s: float) -> int:
        """Announce this replica; return how many replicas are alive (for fail-open shares)."""
        return 1

    async def warm(self, deadline_s: float) -> bool:
        """Make the first calls as fast as the rest (connect, discover, load scripts) within
        `deadline_s`; False when the store did not answer (calls then take the fail mode)."""
        return True

    async def close(self) -> None:
        return None
