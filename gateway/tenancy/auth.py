"""Who is calling: API keys -> tenants, their priority ceiling and the models they may use.

Keys are stored in the policy as SHA-256 hex digests, never in plain text; a presented key is
hashed and looked up, then confirmed with a constant-time comparison. The caller's key is
never forwarded, logged or used as a label: tenants appear in metrics by their policy name.
Token quotas are gateway/tenancy/quotas.py's.
"""

from __future__ import annotations

import hashlib
import hmac

from gateway.admission.queue import PRIORITIES
from gateway.errors import Forbidden, Unauthorized
from gateway.policy.model import Policy, TenantSpec


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(auth: bytes | None) -> str | None:
    if not auth:
        return None
    scheme, _, token = auth.decode("latin-1").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


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
