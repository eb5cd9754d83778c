"""Who is calling: API keys -> tenants, their priority ceiling, models and token quotas.

Keys are stored in the policy as SHA-256 hex digests, never in plain text; a presented key is
hashed and looked up, then confirmed with a constant-time comparison. The caller's key is
never forwarded, logged or used as a label: tenants appear in metrics by their policy name.

Quotas are token buckets (per minute, optionally per day) in the state backend, so replicas
share them. A request reserves prompt + expected output tokens before it is forwarded and is
reconciled with the engine's reported usage afterwards; a request that never reached an
engine is refunded in full.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass

from gateway.admission.queue import PRIORITIES
from gateway.metrics import GatewayMetrics
from gateway.policy.model import Policy, TenantSpec
from gateway.protocol import GatewayError
from gateway.state import Bucket, StateBackend, StateError


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "model_not_allowed"


class QuotaExceeded(GatewayError):
    status = 429
    type = "tokens"
    code = "rate_limit_exceeded"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(auth: bytes | None) -> str | None:
    if not auth:
        return None
    scheme, _, token = auth.decode("latin-1").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


@dataclass(frozen=True, slots=True)
class QuotaTicket:
    """Tokens taken from a tenant's buckets, to reconcile when the request ends."""

    tenant: str
    taken: int
    buckets: tuple[Bucket, ...]
    headers: dict[str, str]  # x-ratelimit-* of the tightest window, for the response


class Tenants:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.by_hash: dict[str, TenantSpec] = {k: t for t in policy.tenants for k in t.api_keys}
        self.by_name = {t.name: t for t in policy.tenants}
        anon = policy.auth.anonymous_tenant
        self.anonymous = self.by_name.get(anon) or TenantSpec(name=anon)
        self.admin_hashes = list(policy.auth.admin_keys)

    def identify(self, auth: bytes | None) -> TenantSpec:
        key = bearer(auth)
        if key is not None:
            digest = hash_key(key)
            tenant = self.by_hash.get(digest)
            if tenant is not None and any(hmac.compare_digest(digest, k)
                                          for k in tenant.api_keys):
                return tenant
        if self.policy.auth.require_keys:
            raise Unauthorized(
                "Incorrect API key provided." if key else
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
        return self.anonymous

    def is_admin(self, auth: bytes | None) -> bool:
        key = bearer(auth)
        if key is None:
            return False
        digest = hash_key(key)
        # Every candidate compared, in constant time each: no early exit to time.
        found = False
        for admin in self.admin_hashes:
            found |= hmac.compare_digest(digest, admin)
        return found

    @staticmethod
    def priority(tenant: TenantSpec, asked: bytes | None) -> int:
        """The caller may lower its priority below its tenant's, never raise it."""
        ceiling = PRIORITIES[tenant.priority]
        if asked:
            wanted = PRIORITIES.get(asked.decode("latin-1").strip().lower())
            if wanted is not None:
                return max(ceiling, wanted)
        return ceiling

    @staticmethod
    def check_model(tenant: TenantSpec, model: str) -> None:
        if tenant.models is not None and model not in tenant.models:
            raise Forbidden(f"Tenant `{tenant.name}` may not use the model `{model}`.",
                            param="model")

    @staticmethod
    def buckets(tenant: TenantSpec) -> tuple[Bucket, ...]:
        out = []
        if tenant.tokens_per_minute:
            out.append(Bucket(f"{tenant.name}:minute", tenant.tokens_per_minute,
                              tenant.tokens_per_minute / 60.0))
        if tenant.tokens_per_day:
            out.append(Bucket(f"{tenant.name}:day", tenant.tokens_per_day,
                              tenant.tokens_per_day / 86400.0))
        return tuple(out)


async def take_quota(state: StateBackend, tenant: TenantSpec, tokens: int,
                     enforce: bool) -> QuotaTicket | None:
    """Reserve `tokens` from every bucket of the tenant, or raise 429 (unless not enforced).

    Returns None when the tenant has no quota. A refusal by a later bucket (per day) gives
    back what earlier ones (per minute) took.
    """
    buckets = Tenants.buckets(tenant)
    if not buckets:
        return None
    taken: list[Bucket] = []
    headers: dict[str, str] = {}
    for bucket in buckets:
        result = await state.take(bucket, tokens)
        if result.ok:
            taken.append(bucket)
            if not headers:
                headers = rate_limit_headers(bucket, result.remaining, result.reset_s, 0)
                del headers["retry-after"]
            continue
        for b in taken:
            await state.adjust(b, tokens)
        if enforce:
            raise QuotaExceeded(
                f"Rate limit reached for tenant `{tenant.name}` on tokens per "
                f"{bucket.key.rsplit(':', 1)[1]}: limit {bucket.capacity}, remaining "
                f"{max(0, result.remaining)}, requested {tokens}. Please try again in "
                f"{result.reset_s:.1f}s.",
                headers=rate_limit_headers(bucket, result.remaining, result.reset_s,
                                           tokens))
        return QuotaTicket(tenant.name, 0, (), {})
    return QuotaTicket(tenant.name, tokens, tuple(taken), headers)


def rate_limit_headers(bucket: Bucket, remaining: int, reset_s: float,
                       requested: int) -> dict[str, str]:
    refill = bucket.refill_per_s or 1.0
    missing = max(0, requested - max(0, remaining))
    wait = max(1, math.ceil(missing / refill)) if missing else 1
    return {"retry-after": str(wait),
            "x-ratelimit-limit-tokens": str(bucket.capacity),
            "x-ratelimit-remaining-tokens": str(max(0, remaining)),
            "x-ratelimit-reset-tokens": f"{reset_s:.3f}s"}


async def settle_quota(state: StateBackend, ticket: QuotaTicket, used: int | None) -> None:
    """Reconcile a reservation with what the engine reported (None: nothing ran: refund)."""
    delta = ticket.taken - (used or 0)
    if not delta:
        return
    for bucket in ticket.buckets:
        try:
            await state.adjust(bucket, delta)
        except StateError:
            pass  # quotas are best effort while the store is down; admission has its mode


class Quotas:
    """Tenants' token quotas on the shared state, with shadow mode and the store's fail mode."""

    def __init__(self, policy: Policy, state: StateBackend, metrics: GatewayMetrics) -> None:
        self.policy = policy
        self.state = state
        self.metrics = metrics

    async def take(self, tenant: TenantSpec, tokens: int, pool: str) -> QuotaTicket | None:
        if not (tenant.tokens_per_minute or tenant.tokens_per_day):
            return None
        try:
            ticket = await take_quota(self.state, tenant, tokens, enforce=not tenant.shadow)
        except QuotaExceeded:
            self.metrics.quota_rejections.labels(tenant.name).inc()
            raise
        except StateError:
            self.metrics.state_errors.labels("quota").inc()
            if self.policy.pools[pool].admission.fail_mode == "closed":
                from gateway.admission.controller import Overloaded

                raise Overloaded("Quota state is unavailable and this pool fails closed.",
                                 code="state_unavailable", headers={"retry-after": "1"}) \
                    from None
            return None
        if ticket is not None and tenant.shadow and ticket.taken == 0:
            self.metrics.shadow_decisions.labels(pool, "rejected", "quota").inc()
            return None
        return ticket

    async def settle(self, ticket: QuotaTicket, used: int | None) -> None:
        await settle_quota(self.state, ticket, used)
