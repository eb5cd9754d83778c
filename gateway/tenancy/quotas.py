"""Tenants' token quotas: token buckets (per minute, optionally per day) in the state backend.

Replicas share the buckets through the state backend. A request reserves prompt + expected
output tokens before it is forwarded and is reconciled with the engine's reported usage
afterwards; a request that never reached an engine is refunded in full.

What a request took is a hold in the store under the request's own id until it settles, so a
settle counts once whatever happens to it: the store sends it again after an outage (a Redis
failover, a restart) without giving the tenant tokens twice, and the holds left over say
exactly what is still reserved (none, once the replicas are quiet).
"""

from __future__ import annotations

import uuid

from gateway.errors import QuotaExceeded, RateWindow, StateUnavailable
from gateway.observe.metrics import GatewayMetrics
from gateway.policy.model import Policy, TenantSpec
from gateway.records import record
from gateway.state import Bucket, BucketResult, StateBackend, StateError


@record
class QuotaTicket:
    """Tokens taken from a tenant's buckets, to reconcile when the request ends."""

    tenant: str
    taken: int
    buckets: tuple[Bucket, ...]
    window: RateWindow | None  # the tightest window's state, for x-ratelimit-* on the answer
    hold: str = ""  # the id `taken` is held under in each bucket until settled


def buckets(tenant: TenantSpec) -> tuple[Bucket, ...]:
    out = []
    if tenant.tokens_per_minute:
        out.append(Bucket(f"{tenant.name}:minute", tenant.tokens_per_minute,
                          tenant.tokens_per_minute / 60.0))
    if tenant.tokens_per_day:
        out.append(Bucket(f"{tenant.name}:day", tenant.tokens_per_day,
                          tenant.tokens_per_day / 86400.0))
    return tuple(out)


def window_of(bucket: Bucket, result: BucketResult, requested: int) -> RateWindow:
    """What a client should know of `bucket` after asking it for `requested` tokens.

    The bucket gives when it holds what is asked, or when it is full (a request larger than
    the whole bucket goes through once it is full), so the wait is until it holds the smaller
    of the two; a tenant in debt (a negative level, after usage beyond its reservations)
    waits for the debt to refill first.
    """
    needed = min(requested, bucket.capacity)
    missing = max(0, needed - result.remaining)
    retry = missing / bucket.refill_per_s if bucket.refill_per_s else float(missing)
    return RateWindow(bucket.capacity, result.remaining, result.reset_s, retry)


async def take_quota(state: StateBackend, tenant: TenantSpec, tokens: int,
                     enforce: bool) -> QuotaTicket | None:
    """Reserve `tokens` from every bucket of the tenant, or raise 429 (unless not enforced).

    Returns None when the tenant has no quota. A refusal by a later bucket (per day) gives
    back what earlier ones (per minute) took.
    """
    wanted = buckets(tenant)
    if not wanted:
        return None
    taken: list[Bucket] = []
    window: RateWindow | None = None
    hold = uuid.uuid4().hex
    for bucket in wanted:
        try:
            result = await state.take(bucket, tokens, hold)
        except StateError:
            await _give_back(state, taken, hold, tokens)
            raise
        if result.ok:
            taken.append(bucket)
            if window is None:
                window = window_of(bucket, result, 0)
            continue
        await _give_back(state, taken, hold, tokens)
        if enforce:
            refused = window_of(bucket, result, tokens)
            raise QuotaExceeded(
                f"Rate limit reached for tenant `{tenant.name}` on tokens per "
                f"{bucket.key.rsplit(':', 1)[1]}: limit {bucket.capacity}, remaining "
                f"{max(0, result.remaining)}, requested {tokens}. Please try again in "
                f"{max(1.0, refused.retry_s):.1f}s.", refused)
        return QuotaTicket(tenant.name, 0, (), None)
    return QuotaTicket(tenant.name, tokens, tuple(taken), window, hold)


async def _give_back(state: StateBackend, taken: list[Bucket], hold: str, tokens: int) -> None:
    """Settle what earlier buckets took, in full (a later bucket refused, or failed)."""
    for b in taken:
        try:
            await state.settle(b, hold, tokens)
        except StateError:
            pass  # the store settles it when it answers again


async def settle_quota(state: StateBackend, ticket: QuotaTicket, used: int | None) -> None:
    """Reconcile a reservation with what the engine reported (None: nothing ran: refund).
    Settled even when nothing is to be given back, to end the hold."""
    delta = ticket.taken - (used or 0)
    for bucket in ticket.buckets:
        try:
            await state.settle(bucket, ticket.hold, delta)
        except StateError:
            pass  # the store settles it when it answers again; admission has its fail mode


class Quotas:
    """Tenants' token quotas on the shared state, with shadow mode and the store's fail mode."""

    def __init__(self, policy: Policy, state: StateBackend, metrics: GatewayMetrics) -> None:
        self.policy = policy
        self.state = state
        self.metrics = metrics

    @staticmethod
    def applies(tenant: TenantSpec) -> bool:
        """Whether `take` charges this tenant anything (it has a token quota)."""
        return bool(tenant.tokens_per_minute or tenant.tokens_per_day)

    async def take(self, tenant: TenantSpec, tokens: int, pool: str) -> QuotaTicket | None:
        if not self.applies(tenant):
            return None
        try:
            ticket = await take_quota(self.state, tenant, tokens, enforce=not tenant.shadow)
        except QuotaExceeded:
            self.metrics.quota_rejections.labels(tenant.name).inc()
            raise
        except StateError:
            self.metrics.state_errors.labels("quota").inc()
            if self.policy.pools[pool].admission.fail_mode == "closed":
                raise StateUnavailable("Quota state is unavailable and this pool fails closed.",
                                       retry_after_s=1) from None
            return None
        if ticket is not None and tenant.shadow and ticket.taken == 0:
            self.metrics.shadow_decisions.labels(pool, "rejected", "quota").inc()
            return None
        return ticket

    async def settle(self, ticket: QuotaTicket, used: int | None) -> None:
        await settle_quota(self.state, ticket, used)
