"""The ASGI app: a fast path for the completion endpoints in front of a Starlette app.

The two POST endpoints that carry streams go straight to their raw ASGI handlers; Starlette
serves everything else (models, health, metrics, estimate, admin) and the lifespan.
Starlette's middleware would otherwise wrap `send` for every streamed chunk.

The lifespan holds what lives as long as the process: the aiohttp session, the state backend,
the tokenizers, and the background tasks of the runtime in force (health prober, engine
scraper, admission ticks) plus the event-loop lag monitor and the heap keeper, which freezes
start-up's objects out of the garbage collector's view and keeps the open streams' objects in
an old generation only its sweep walks, so collections no longer walk them while streams wait
(gateway/serving/heap.py).

A reload (SIGHUP or POST /admin/reload) validates the new file, builds a new Runtime on the
same session, state and tokenizers, and swaps it in with one assignment. In-flight requests
keep the Runtime they started with and release into the same state backend, so reservations
carry over; the old runtime's admission keeps ticking until its last request is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.api import admin, ops, passthrough
from gateway.api.anthropic import CountTokensEndpoint, MessagesEndpoint
from gateway.api.estimate import EstimateEndpoint
from gateway.api.openai import CompletionsEndpoint, error_response, list_models
from gateway.cost import TokenizerError
from gateway.observe.metrics import GatewayMetrics
from gateway.pipeline import Gate
from gateway.policy import Policy, PolicyError, load_policy
from gateway.prefix.precise import PreciseEvents
from gateway.runtime import Runtime, build_runtime, load_counters, make_engine_pool, make_session
from gateway.serving.heap import HeapKeeper
from gateway.state import StateBackend, create_state
from gateway.tokens import TokenCounter, load_tokenizer
from gateway.upstream.native import EnginePool
from gateway.wire.openai import error_type

STATE_WARM_S = 3.0  # at most this long at start for the state store to answer

log = logging.getLogger("gateway.app")

LAG_INTERVAL_S = 0.1
DEBUG_GC_ENV = "GATEWAY_DEBUG_GC_EVERY_S"


@dataclass
class ReloadResult:
    ok: bool
    problems: list[str] = field(default_factory=list)


class GatewayApp:
    def __init__(self, policy: Policy, metrics: GatewayMetrics | None = None,
                 redis_url: str | None = None, state_prefix: str = "gw",
                 policy_path: str | None = None, admin_routes: bool = True) -> None:
        self.policy = policy
        self.policy_path = policy_path
        self.redis_url = redis_url
        self.state_prefix = state_prefix
        self.metrics = metrics or GatewayMetrics()
        self.runtime: Runtime | None = None
        self.loaded_at = time.time()
        self.reloads = {"ok": 0, "invalid": 0}
        self.last_reload_error: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._engines: EnginePool | None = None
        self._state: StateBackend | None = None
        self._counters: dict[str, tuple[str, TokenCounter]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.precise: PreciseEvents | None = None  # the KV-events subscriptions in force
        self._retirements: set[asyncio.Task[None]] = set()
        self._tasks_debug: asyncio.Task[None] | None = None
        self._heap: HeapKeeper | None = None
        self._reload_lock = asyncio.Lock()
        self.gate = Gate(policy.server.max_concurrent_requests)
        get, gate = self._runtime, self.gate
        self.fast: dict[str, CompletionsEndpoint] = {
            "/v1/chat/completions": CompletionsEndpoint("chat", get, gate),
            "/v1/completions": CompletionsEndpoint("completions", get, gate),
            "/v1/responses": CompletionsEndpoint("responses", get, gate),
            "/v1/embeddings": CompletionsEndpoint("embeddings", get, gate),
            # Prefill work, counted and admitted as an embedding (gateway/wire/pooling.py says why;
            # /pooling is passed through: gateway/api/passthrough.py).
            "/v1/rerank": CompletionsEndpoint("rerank", get, gate),
            "/v1/score": CompletionsEndpoint("score", get, gate),
            "/classify": CompletionsEndpoint("classify", get, gate),
            "/v1/messages": MessagesEndpoint(get, gate),  # Anthropic's Messages API
        }
        routes = [
            # Reached only for other methods (the fast path takes POST): answers 405.
            *(Route(path, ep, methods=["POST"]) for path, ep in self.fast.items()),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/healthz", ops.healthz, methods=["GET"]),
            Route("/readyz", ops.readyz, methods=["GET"]),
            Route("/metrics", ops.metrics, methods=["GET"]),
            Route("/gateway/estimate", EstimateEndpoint(get), methods=["POST"]),
            Route("/v1/messages/count_tokens", CountTokensEndpoint(get), methods=["POST"]),
            *passthrough.routes(),
        ]
        if admin_routes:
            routes.extend(admin.routes())
        self.starlette = Starlette(
            routes=routes,
            exception_handlers={HTTPException: _http_error},  # type: ignore[dict-item]
            lifespan=self._lifespan,
        )
        # Starlette would answer a trailing slash with a 307 to a URL built from the caller's
        # Host header, before authentication: an open redirect. A path is served as named.
        self.starlette.router.redirect_slashes = False
        self.starlette.state.gateway = self

    def admin_app(self) -> Starlette:
        """The admin API alone, for a port of its own; shares this app's runtime."""
        app = Starlette(routes=[*admin.routes(),
                                Route("/healthz", ops.healthz, methods=["GET"]),
                                Route("/metrics", ops.metrics, methods=["GET"])],
                        exception_handlers={HTTPException: _http_error})  # type: ignore[dict-item]
        app.router.redirect_slashes = False  # as on the main port
        app.state.gateway = self
        app.state.admin_port = True  # where auth.metrics: admin_port serves /metrics
        return app

    def _runtime(self) -> Runtime:
        assert self.runtime is not None, "lifespan has not run"
        return self.runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI 3: the admitted endpoints straight to the pipeline, the rest through
        Starlette's router."""
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.starlette(scope, receive, send)

    # --- lifecycle ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        counters = await asyncio.to_thread(load_counters, self.policy)
        self._counters = {m.name: (m.tokenizer, counters[m.name]) for m in self.policy.models}
        self._session = make_session(self.policy)
        self._engines = make_engine_pool(self.policy)
        self._state = create_state(self.redis_url, self.state_prefix, self.policy, self.metrics)
        # Connected while the engines are probed: uvicorn accepts no request before this
        # returns, so the first reservations find the store ready.
        rt, _ = await asyncio.gather(self._build(self.policy, counters, None),
                                     self._state.warm(STATE_WARM_S))
        self._install(rt, None)
        lag = asyncio.create_task(_watch_loop_lag(self.metrics), name="loop-lag")
        self.metrics.install_gc_callback()
        server = self.policy.server
        gate = self.gate
        heap = HeapKeeper(self.metrics, server.gc_freeze_interval_s, server.gc_sweep_interval_s,
                          lambda: gate.open, server.gc_sweep_growth)
        heap.settle()
        heap.install()
        self._heap = heap
        gc_every = float(os.environ.get(DEBUG_GC_ENV, "0") or 0)
        if gc_every > 0:  # benchmarks: force full collections (sweeps) to measure their stall
            # Only while requests are open: an idle benchmark gateway beside the one measured
            # (same CPU) would otherwise stall it with sweeps of its own heap.
            self._tasks_debug = asyncio.create_task(
                _every(gc_every, lambda: gate.open and heap.sweep()), name="gc")
        keeper = asyncio.create_task(heap.run(), name="heap")
        log.info("gateway ready: %d pool(s), %d backend(s)", len(rt.backends.pools),
                 sum(1 for _ in rt.backends.all()))
        try:
            yield
        finally:
            lag.cancel()
            keeper.cancel()
            if self._tasks_debug is not None:
                self._tasks_debug.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(lag, keeper, *self._tasks, return_exceptions=True)
            self.metrics.remove_gc_callback()
            heap.uninstall()
            await self._session.close()
            if self._engines is not None:
                await self._engines.close()
            await self._state.close()
            for _, counter in self._counters.values():
                counter.close()

    async def _build(self, policy: Policy, counters: dict[str, TokenCounter],
                     old: Runtime | None) -> Runtime:
        assert self._session is not None and self._state is not None
        rt = build_runtime(policy, self.metrics, self._session, self._state, counters,
                           time.time(), old.output_lengths if old else None,
                           old.prefix if old else None, self._engines)
        await rt.backends.probe_all(rt.forwarder.aio.probe)
        # One scrape before serving: capacities come from the engines, not the ledger, from
        # the first request on.
        await asyncio.gather(*(rt.scraper.scrape(rt.forwarder.aio.get_text, pool, name, url, engine,
                                                 policy.signals.scrape_timeout_s)
                               for pool, name, url, engine in _targets(rt)))
        for (pool, name), sample in rt.scraper.samples.items():
            rt.admission.on_engine_sample(pool, name, sample)
        return rt

    def _show_encoders(self, rt: Runtime) -> None:
        gauge = self.metrics.tokenizer_rank_encoder
        native = self.metrics.chat_template_native
        for model, counter in rt.counters.items():
            gauge.labels(model).set(getattr(counter.tokenizer, "rank_bpe", None) is not None)
            native.labels(model).set(getattr(counter.tokenizer, "native_render", False))

    def _install(self, rt: Runtime, old: Runtime | None) -> None:
        assert self._session is not None
        old_tasks = self._tasks
        self.runtime = rt
        self.policy = rt.policy
        self.gate.cap = rt.policy.server.max_concurrent_requests
        sig = rt.policy.signals
        self._tasks = [
            asyncio.create_task(rt.backends.run_prober(rt.forwarder.aio.probe),
                                name="health-prober"),
            asyncio.create_task(rt.admission.run(), name="admission"),
            asyncio.create_task(_every(5.0, rt.accountant.update), name="accounting"),
            asyncio.create_task(_every(5.0, lambda: self._show_encoders(rt)), name="encoders"),
            asyncio.create_task(rt.scraper.run(rt.forwarder.aio.get_text, _targets(rt),
                                               sig.scrape_interval_s, sig.scrape_timeout_s,
                                               rt.admission.on_engine_sample),
                                name="engine-scraper"),
        ]
        # Precise prefix mode: one KV-events subscription per backend that publishes them.
        self.precise = PreciseEvents(rt.policy, rt.prefix, rt.backends.all(),
                                     self.metrics.kv_events.bind)
        self._tasks += self.precise.start()
        self._show_encoders(rt)
        for task in old_tasks:
            if task.get_name() == "admission" and old is not None:
                # Retired once the last request admitted through it is done.
                self._retirements.add(asyncio.create_task(_retire(task, old, self._heap)))
            else:
                task.cancel()

    async def reload(self) -> ReloadResult:
        """Validate and swap in the policy file; on any problem the old policy stays."""
        if self.policy_path is None:
            return ReloadResult(False, ["no policy file to reload (started without one)"])
        async with self._reload_lock:
            try:
                policy = await asyncio.to_thread(load_policy, self.policy_path)
                counters = await asyncio.to_thread(self._counters_for, policy)
            except PolicyError as exc:
                return self._reload_failed(exc.render().splitlines())
            except TokenizerError as exc:
                return self._reload_failed([f"{self.policy_path}: tokenizer: {exc}"])
            old = self.runtime
            rt = await self._build(policy, counters, old)
            self._install(rt, old)
            self.loaded_at = time.time()
            self.reloads["ok"] += 1
            self.last_reload_error = None
            self.metrics.policy_reloads.labels("ok").inc()
            log.warning("policy reloaded from %s", self.policy_path)
            return ReloadResult(True)

    async def check_reload(self) -> ReloadResult:
        """Validate the policy file without applying it."""
        if self.policy_path is None:
            return ReloadResult(False, ["no policy file to reload (started without one)"])
        try:
            await asyncio.to_thread(load_policy, self.policy_path)
        except PolicyError as exc:
            return self._reload_failed(exc.render().splitlines())
        return ReloadResult(True)

    def _reload_failed(self, problems: list[str]) -> ReloadResult:
        self.reloads["invalid"] += 1
        self.last_reload_error = "\n".join(problems)
        self.metrics.policy_reloads.labels("invalid").inc()
        log.error("policy reload refused; the old policy stays in force:\n%s",
                  self.last_reload_error)
        return ReloadResult(False, problems)

    def _counters_for(self, policy: Policy) -> dict[str, TokenCounter]:
        """Reuse the tokenizers whose spec did not change; load the new ones."""
        out: dict[str, TokenCounter] = {}
        for m in policy.models:
            spec, counter = self._counters.get(m.name, (None, None))
            # A new chat template is a new count too; a new encoder the same count, made anew.
            if counter is None or spec != m.tokenizer \
                    or getattr(counter.tokenizer, "chat_template_spec", None) != m.chat_template \
                    or getattr(counter.tokenizer, "encoder", "auto") != m.encoder \
                    or getattr(counter.tokenizer, "renderer", "auto") != m.renderer:
                counter = TokenCounter(load_tokenizer(m.tokenizer, chat_template=m.chat_template,
                                                      encoder=m.encoder, renderer=m.renderer),
                                       policy.server.max_prompt_chars)
                counter.warm()  # in the reload's thread, as loading the tokenizer
                self._counters[m.name] = (m.tokenizer, counter)
            counter.max_prompt_chars = policy.server.max_prompt_chars
            counter.inline_chars = policy.server.inline_tokenize_chars
            out[m.name] = counter
        return out


def _targets(rt: Runtime) -> list[tuple[str, str, str, str]]:
    return [(b.pool, b.name, b.url + "/metrics", rt.policy.pools[b.pool].engine)
            for b in rt.backends.all() if rt.policy.pools[b.pool].engine != "openai"]


async def _every(period_s: float, fn: Callable[[], object]) -> None:
    while True:
        await asyncio.sleep(period_s)
        fn()


async def _retire(task: asyncio.Task[None], rt: Runtime, heap: HeapKeeper | None) -> None:
    """Stop a replaced runtime's admission ticks once nothing runs or waits through it."""
    # A rare, slow poll: no event marks "the last request of an old runtime is done".
    while rt.admission.leases_live() or any(len(p.queue) for p in rt.admission.pools.values()):  # noqa: ASYNC110
        await asyncio.sleep(0.5)
    task.cancel()
    if heap is not None:  # the old runtime was frozen with start-up: only a full pass frees it
        heap.ask_full()


async def _watch_loop_lag(metrics: GatewayMetrics) -> None:
    """How late a timer fires is how long every stream waited for the loop."""
    loop = asyncio.get_running_loop()
    observe = metrics.loop_lag.observe
    while True:
        start = loop.time()
        await asyncio.sleep(LAG_INTERVAL_S)
        observe(max(0.0, loop.time() - start - LAG_INTERVAL_S))
        metrics.flush_gc_pauses()  # noted by the GC callback, which must not observe itself


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        path = request.url.path
        slash = " (without the trailing slash)" if len(path) > 1 and path.endswith("/") else ""
        return error_response(404, f"Unknown path {path}. This gateway serves "
                              "/v1/chat/completions, /v1/completions, /v1/responses, "
                              "/v1/embeddings, /v1/rerank, /v1/score, /classify, /pooling, "
                              f"/v1/models, /tokenize and /detokenize{slash}.",
                              error_type(404), "not_found")
    if exc.status_code == 405:
        return error_response(405, f"Method {request.method} is not allowed on "
                              f"{request.url.path}.", error_type(405),
                              "method_not_allowed")
    return error_response(exc.status_code, str(exc.detail), error_type(exc.status_code), None)


def create_app(policy: Policy, metrics: GatewayMetrics | None = None,
               redis_url: str | None = None, state_prefix: str = "gw",
               policy_path: str | None = None, admin_routes: bool = True) -> GatewayApp:
    return GatewayApp(policy, metrics, redis_url, state_prefix, policy_path, admin_routes)

