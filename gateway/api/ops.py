"""`/healthz` (alive), `/readyz` (can serve: every pool has a healthy backend), `/metrics`."""

from __future__ import annotations

import asyncio

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.admin import refuse_non_admin
from gateway.observe.metrics import exposition_registry
from gateway.runtime import runtime_of
from gateway.wire.openai import error_body, error_type


async def healthz(request: Request) -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


async def readyz(request: Request) -> Response:
    rt = runtime_of(request)
    if rt is None:
        return _json({"status": "not ready", "reason": "policy not loaded"}, 503)
    now = rt.backends.clock()
    pools: dict[str, object] = {}
    not_ready: list[str] = []
    for pool, backends in rt.backends.pools.items():
        states = {b.name: b.public_status(now) for b in backends}
        healthy = [name for name, s in states.items() if s == "up"]
        pools[pool] = {"healthy": len(healthy), "backends": states}
        if not healthy:
            not_ready.append(pool)
    if not_ready:
        return _json({"status": "not ready",
                      "reason": f"no healthy backend in pool(s): {', '.join(not_ready)}",
                      "pools": pools}, 503)
    return _json({"status": "ready", "pools": pools}, 200)


async def metrics(request: Request) -> Response:
    rt = runtime_of(request)
    assert rt is not None, "lifespan has not run"
    access = rt.policy.auth.metrics
    if access == "admin_port" and not getattr(request.app.state, "admin_port", False):
        return Response(error_body(
            f"Unknown path {request.url.path}: metrics are served on the admin port "
            "(auth.metrics: admin_port).", error_type(404), None, "not_found"),
            404, media_type="application/json")
    if access == "admin_key" and (refused := refuse_non_admin(request, rt)) is not None:
        return refused
    # Rendering walks every series: off the loop.
    text = await asyncio.to_thread(
        lambda: generate_latest(exposition_registry(rt.metrics.registry)))
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def _json(data: object, status: int) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")
