"""Who is calling and how much they may use.

    auth.py    API keys (SHA-256 digests) -> tenants, priority ceilings, allowed models, admin keys
    quotas.py  tenants' token buckets in the state backend: take, settle, shadow mode, fail mode

Plain code: no HTTP. What a tenant's tokens cost in money is gateway/cost/pricing.py's.
"""
