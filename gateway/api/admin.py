"""The admin API: `/admin/state`, `/admin/policy`, `POST /admin/reload`.

Every call needs an admin key (`Authorization: Bearer <key>`): one whose SHA-256 is in the
policy's `auth.admin_keys`, or the value of the environment variable GATEWAY_ADMIN_KEY.
Tenants' keys are refused. With no admin key configured at all, the admin API is off (403).
It can be bound to a port of its own (`gateway serve --admin-port`).
"""

from __future__ import annotations

import hmac
import os
import signal
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.runtime import Runtime
from gateway.signals.blocks import disagreement
from gateway.tenancy.auth import bearer
from gateway.wire.openai import error_body, error_type, retry_headers

# Set in each process of `gateway serve --workers N` to its parent's pid
# (gateway/commands/serve.py): a reload asked of one worker is the parent's to pass on to all.
PARENT_ENV = "GATEWAY_WORKERS_PARENT"


class ReloadOutcome(Protocol):
    ok: bool
    problems: list[str]


class GatewayApp(Protocol):
    """What the admin API reads and drives of the running gateway (gateway/app.py's
    GatewayApp); a protocol, so this module needs nothing of the app that mounts it."""

    runtime: Runtime | None
    policy_path: str | None
    loaded_at: float
    reloads: dict[str, int]
    last_reload_error: str | None

    async def reload(self) -> ReloadOutcome: ...

    async def check_reload(self) -> ReloadOutcome: ...

ADMIN_KEY_ENV = "GATEWAY_ADMIN_KEY"


def routes() -> list[Route]:
    return [Route("/admin/state", state, methods=["GET"]),
            Route("/admin/policy", policy, methods=["GET"]),
            Route("/admin/reload", reload, methods=["POST"])]


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS),
                    status_code=status, media_type="application/json")


def _refuse(request: Request) -> Response | None:
    gw: GatewayApp = request.app.state.gateway
    return refuse_non_admin(request, gw.runtime)


def refuse_non_admin(request: Request, rt: Runtime | None) -> Response | None:
    """The answer for a caller without an admin key; None for an admin."""
    env_key = os.environ.get(ADMIN_KEY_ENV)
    if rt is None:  # still starting: a moment's wait
        return Response(error_body("Not ready.", error_type(503), None, "not_ready"), 503,
                        {k.decode(): v.decode() for k, v in retry_headers(1.0)},
                        media_type="application/json")
    if not rt.policy.auth.admin_keys and not env_key:
        return Response(error_body(
            "The admin API is disabled: no admin key is configured (auth.admin_keys in the "
            f"policy, or {ADMIN_KEY_ENV}).", error_type(403), None, "admin_disabled"),
            403, media_type="application/json")
    auth = request.headers.get("authorization", "").encode("latin-1")
    ok = rt.tenants.is_admin(auth)
    token = bearer(auth)
    if env_key and token is not None:
        ok |= hmac.compare_digest(token.encode(), env_key.encode())
    if not ok:
        return Response(error_body("An admin key is required for the admin API.",
                                   error_type(401), None, "invalid_admin_key"),
                        401, media_type="application/json")
    return None


async def state(request: Request) -> Response:
    if (refused := _refuse(request)) is not None:
        return refused
    gw: GatewayApp = request.app.state.gateway
    rt = gw.runtime
    assert rt is not None
    now = rt.backends.clock()
    rt.accountant.update()  # prices as of now, not as of the last periodic update
    pools: dict[str, Any] = {}
    for name, ps in rt.admission.pools.items():
        backends = {}
        for b in rt.backends.pools[name]:
            sample = rt.scraper.fresh(name, b.name)
            backends[b.name] = {
                "status": b.status(now), "outstanding": b.outstanding,
                "kv_blocks_capacity": ps.capacity.get(b.name),
                "kv_blocks_limit": rt.admission.max_blocks(ps, b.name),
                "kv_blocks_reserved": ps.reserved.get(b.name, 0),
                "kv_block_size": rt.scraper.blocks.backends.get((name, b.name)),
                "engine": None if sample is None else {
                    "kv_usage": sample.kv_usage, "waiting": sample.waiting,
                    "running": sample.running, "age_s": round(now - sample.at, 3)},
            }
        depth = {k: n for k, n in ps.queue.depth_by_priority().items() if n}
        thresholds = ps.thresholds.as_dict()
        thresholds["latency_guard_limit_tokens"] = {
            "value": ps.guard.limit, "source": "latency_guard", "state": ps.guard.state}
        pools[name] = {
            "shadow": ps.spec.admission.shadow,
            "backends": backends,
            "block_size_disagreement": disagreement(ps.spec.block_size,
                                                    rt.scraper.blocks.reported(name)),
            "reserved_tokens": ps.reserved_tokens,
            "queue": {"depth": len(ps.queue), "by_priority": depth},
            "drain_rate_tokens_s": round(ps.drain_rate, 1),
            "ttft_p99_s": ps.ttft.quantile(0.99), "tpot_p99_s": ps.tpot.quantile(0.99),
            "thresholds": thresholds,
            "cost": rt.accountant.snapshot(name),
        }
    return _json({
        "policy": {"path": gw.policy_path, "loaded_at": gw.loaded_at, "reloads": gw.reloads,
                   "last_reload_error": gw.last_reload_error},
        "state_backend": rt.state.name, "replicas_alive": rt.admission.replicas,
        "pools": pools,
        "tenants": [{"name": t.name, "priority": t.priority, "keys": len(t.api_keys),
                     "tokens_per_minute": t.tokens_per_minute,
                     "tokens_per_day": t.tokens_per_day, "max_kv_share": t.max_kv_share,
                     "shadow": t.shadow} for t in rt.policy.tenants],
    })


async def policy(request: Request) -> Response:
    if (refused := _refuse(request)) is not None:
        return refused
    gw: GatewayApp = request.app.state.gateway
    assert gw.runtime is not None
    data = gw.runtime.policy.model_dump(mode="json")
    # Key digests are not keys, but there is no reason to hand them out either.
    for tenant in data.get("tenants", []):
        tenant["api_keys"] = f"<{len(tenant['api_keys'])} key(s)>"
    data["auth"]["admin_keys"] = f"<{len(data['auth']['admin_keys'])} key(s)>"
    return _json(data)


async def reload(request: Request) -> Response:
    if (refused := _refuse(request)) is not None:
        return refused
    gw: GatewayApp = request.app.state.gateway
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        # One of several workers: check the file here, then have the parent signal all of
        # them (this one included), so every worker runs the same policy.
        result = await gw.check_reload()
        if result.ok:
            os.kill(int(parent), signal.SIGHUP)
            return _json({"status": "reloading every worker", "policy": gw.policy_path})
    else:
        result = await gw.reload()
    if result.ok:
        return _json({"status": "reloaded", "policy": gw.policy_path})
    return Response(error_body("The policy was not reloaded; the old one stays in force:\n"
                               + "\n".join(result.problems), error_type(400), None,
                               "invalid_policy"), 400, media_type="application/json")
