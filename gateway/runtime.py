"""What a running gateway holds: the policy in force and the objects built from it.

Built once in the app's lifespan (the aiohttp session needs a running loop) and read by every
request through one reference, so a reload can swap a whole new Runtime in atomically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import aiohttp
from starlette.requests import Request

from gateway.admission.controller import Admission
from gateway.cost import OutputLengthModel
from gateway.observe.accounting import Accountant
from gateway.observe.metrics import GatewayMetrics
from gateway.policy import Policy
from gateway.prefix import PrefixIndexes
from gateway.routing.affinity import Affinity
from gateway.routing.backends import Backends
from gateway.routing.router import Router
from gateway.signals.engines import EngineScraper
from gateway.state import StateBackend
from gateway.tenancy.auth import Tenants
from gateway.tenancy.quotas import Quotas
from gateway.tokens import TokenCounter, load_tokenizer
from gateway.upstream.aio import AioClient
from gateway.upstream.forward import Forwarder
from gateway.upstream.native import EnginePool


@dataclass(eq=False)
class Runtime:
    policy: Policy
    metrics: GatewayMetrics
    backends: Backends
    router: Router
    forwarder: Forwarder
    session: aiohttp.ClientSession
    state: StateBackend
    scraper: EngineScraper
    admission: Admission
    counters: dict[str, TokenCounter]  # model -> prompt token counter
    output_lengths: dict[str, OutputLengthModel]  # model -> learned completion lengths
    tenants: Tenants
    quotas: Quotas
    accountant: Accountant
    started_at: float
    affinity: Affinity
    prefix: PrefixIndexes  # every backend's prefix index; kept over reloads


def runtime_of(request: Request) -> Runtime | None:
    """The runtime in force, for any app the gateway serves (main or admin-only): both hold
    the gateway, and a reload swaps the runtime there."""
    gateway = getattr(request.app.state, "gateway", None)
    return None if gateway is None else gateway.runtime


def make_session(policy: Policy) -> aiohttp.ClientSession:
    up = policy.upstream
    connector = aiohttp.TCPConnector(
        limit=up.max_connections, limit_per_host=0,
        # Shorter than the engines' own keep-alive (uvicorn's default is 5 s), so the gateway
        # never reuses a connection the engine is closing.
        keepalive_timeout=up.keepalive_timeout_s,
        enable_cleanup_closed=True,
    )
    # No cookie jar: the session is every caller's, so a cookie an engine (or the load
    # balancer in front of it: a stickiness cookie) set on one caller's answer would go out
    # with every later request of every tenant, all pinned where the first one went.
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 skip_auto_headers=("User-Agent",),
                                 cookie_jar=aiohttp.DummyCookieJar())


def load_counters(policy: Policy) -> dict[str, TokenCounter]:
    """One counter per model; a tokenizer that cannot load stops start-up, naming the model."""
    out = {m.name: TokenCounter(load_tokenizer(m.tokenizer, chat_template=m.chat_template,
                                               encoder=m.encoder, renderer=m.renderer),
                                policy.server.max_prompt_chars)
           for m in policy.models}
    for counter in out.values():
        counter.inline_chars = policy.server.inline_tokenize_chars
        counter.warm()  # start-up runs this in a thread, before serving
    return out


def make_engine_pool(policy: Policy) -> EnginePool | None:
    """The forwarder's own HTTP/1.1 client (gateway/upstream/native.py), unless the policy asks for
    aiohttp's; in the running loop, like the session."""
    up = policy.upstream
    if up.client != "native":
        return None
    return EnginePool(up.max_connections, up.keepalive_timeout_s)


def build_runtime(policy: Policy, metrics: GatewayMetrics, session: aiohttp.ClientSession,
                  state: StateBackend, counters: dict[str, TokenCounter], started_at: float,
                  output_lengths: dict[str, OutputLengthModel] | None = None,
                  prefix: PrefixIndexes | None = None,
                  engines: EnginePool | None = None) -> Runtime:
    metrics.publish_policy(policy)
    backends = Backends(policy, metrics, upstream_key=_upstream_key(policy))
    scraper = EngineScraper(policy.signals.metrics_max_age_s)
    router = Router(policy, backends, scraper.blocks)
    forwarder = Forwarder(AioClient(session), router, policy.upstream.connect_timeout_s,
                          policy.upstream.read_timeout_s, engines)
    # What each backend holds survives a reload for the backends that stay.
    prefix = prefix or PrefixIndexes()
    prefix.retain((name, b.name) for name, pool in policy.pools.items() for b in pool.backends)
    admission = Admission(policy, backends, state, metrics, scraper, prefix=prefix)
    backends.on_lost = admission.prefix.forget
    # Learned output lengths carry over a reload for the models that stay.
    old = output_lengths or {}
    outputs = {m.name: old.get(m.name) or OutputLengthModel(policy.defaults.expected_output_tokens)
               for m in policy.models}
    return Runtime(policy, metrics, backends, router, forwarder, session, state, scraper,
                   admission, counters, outputs, Tenants(policy),
                   Quotas(policy, state, metrics), Accountant(policy, metrics), started_at,
                   Affinity(state, policy.upstream.responses_ttl_s, metrics), prefix)


def _upstream_key(policy: Policy) -> str | None:
    env = policy.auth.upstream_api_key_env
    return os.environ.get(env) if env else None
