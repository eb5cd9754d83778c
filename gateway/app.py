"""The ASGI app: a fast path for the completion endpoints in front of a Starlette app.

The two POST endpoints that carry streams go straight to their raw ASGI handlers; Starlette
serves everything else (models, health, metrics) and the lifespan. Starlette's middleware
would otherwise wrap `send` for every streamed chunk.

The lifespan holds what lives as long as the process: the aiohttp session, the health
prober, the event-loop lag monitor. After start-up it freezes the garbage collector's view of
everything built so far, so a full collection no longer walks the tokenizers, the policy and
the imported modules while streams wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.api import ops
from gateway.api.openai import CompletionsEndpoint, error_response, list_models
from gateway.metrics import GatewayMetrics
from gateway.policy import Policy
from gateway.api.estimate import estimate_endpoint
from gateway.runtime import Runtime, build_runtime, load_counters, make_session
from gateway.state import create_state

log = logging.getLogger("gateway.app")

LAG_INTERVAL_S = 0.1


class GatewayApp:
    def __init__(self, policy: Policy, metrics: GatewayMetrics | None = None,
                 redis_url: str | None = None, state_prefix: str = "gw") -> None:
        self.policy = policy
        self.redis_url = redis_url
        self.state_prefix = state_prefix
        self.metrics = metrics or GatewayMetrics()
        self.runtime: Runtime | None = None
        get = self._runtime
        self.fast: dict[str, CompletionsEndpoint] = {
            "/v1/chat/completions": CompletionsEndpoint("chat", get),
            "/v1/completions": CompletionsEndpoint("completions", get),
        }
        self.starlette = Starlette(
            routes=[
                # Reached only for other methods (the fast path takes POST): answers 405.
                *(Route(path, ep, methods=["POST"]) for path, ep in self.fast.items()),
                Route("/v1/models", list_models, methods=["GET"]),
                Route("/healthz", ops.healthz, methods=["GET"]),
                Route("/readyz", ops.readyz, methods=["GET"]),
                Route("/metrics", ops.metrics, methods=["GET"]),
                Route("/gateway/estimate", estimate_endpoint, methods=["POST"]),
            ],
            exception_handlers={HTTPException: _http_error},  # type: ignore[dict-item]
            lifespan=self._lifespan,
        )

    def _runtime(self) -> Runtime:
        assert self.runtime is not None, "lifespan has not run"
        return self.runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.starlette(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        counters = await asyncio.to_thread(load_counters, self.policy)
        session = make_session(self.policy)
        state = create_state(self.redis_url, self.state_prefix)
        rt = build_runtime(self.policy, self.metrics, session, state, counters, time.time())
        await rt.backends.probe_all(session)
        self.runtime = rt
        app.state.runtime = rt
        sig = self.policy.signals
        targets = [(b.pool, b.name, b.url + "/metrics", self.policy.pools[b.pool].engine)
                   for b in rt.backends.all() if self.policy.pools[b.pool].engine != "openai"]
        # One scrape before serving: capacities come from the engines, not the ledger, from
        # the first request on.
        await asyncio.gather(*(rt.scraper.scrape(session, pool, name, url, engine,
                                                 sig.scrape_timeout_s)
                               for pool, name, url, engine in targets))
        for (pool, name), sample in rt.scraper.samples.items():
            rt.admission.on_engine_sample(pool, name, sample)
        tasks = [asyncio.create_task(rt.backends.run_prober(session), name="health-prober"),
                 asyncio.create_task(_watch_loop_lag(self.metrics), name="loop-lag"),
                 asyncio.create_task(rt.admission.run(), name="admission"),
                 asyncio.create_task(rt.scraper.run(
                     session, targets, sig.scrape_interval_s, sig.scrape_timeout_s,
                     rt.admission.on_engine_sample), name="engine-scraper")]
        self.metrics.install_gc_callback()
        gc.collect()
        gc.freeze()
        log.info("gateway ready: %d pool(s), %d backend(s)", len(rt.backends.pools),
                 sum(1 for _ in rt.backends.all()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.metrics.remove_gc_callback()
            await session.close()
            await state.close()
            for counter in counters.values():
                counter.close()


async def _watch_loop_lag(metrics: GatewayMetrics) -> None:
    """How late a timer fires is how long every stream waited for the loop."""
    loop = asyncio.get_running_loop()
    observe = metrics.loop_lag.observe
    while True:
        start = loop.time()
        await asyncio.sleep(LAG_INTERVAL_S)
        observe(max(0.0, loop.time() - start - LAG_INTERVAL_S))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(404, f"Unknown path {request.url.path}. This gateway serves "
                              "/v1/chat/completions, /v1/completions and /v1/models.",
                              "invalid_request_error", "not_found")
    if exc.status_code == 405:
        return error_response(405, f"Method {request.method} is not allowed on "
                              f"{request.url.path}.", "invalid_request_error",
                              "method_not_allowed")
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error", None)


def create_app(policy: Policy, metrics: GatewayMetrics | None = None,
               redis_url: str | None = None, state_prefix: str = "gw") -> GatewayApp:
    return GatewayApp(policy, metrics, redis_url, state_prefix)
