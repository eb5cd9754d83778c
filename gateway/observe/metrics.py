"""Every Prometheus metric the gateway exports, defined in one place.

Names follow the Prometheus guide: one `gateway_` prefix, base units as suffixes, labels only
from bounded sets (pool, backend, model and tenant names come from the policy; status codes and
error kinds from fixed lists), never a request id or prompt. Latency buckets reach minutes
because long generations and queueing under overload do. Money carries its currency as a
label, the pool's `cost.currency`: the policy prices each pool in its own, so a name fixed in
code (`_usd`) would be wrong for a pool priced in EUR, and a name made from the policy would
change under the dashboards on a reload. Renamed metrics keep their old names for one release
(`DEPRECATED_NAMES`), copied at scrape time.

Each app gets its own registry, so several gateways can run in one process (tests) and the
label children used on the hot path are bound once and cached. Under `gateway serve
--workers N` each gauge's `multiprocess_mode` says how the workers' values combine.
"""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    multiprocess,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gateway.observe.children import LabelChildren
from gateway.observe.kv_events_metrics import KVEventMetrics
from gateway.observe.prefix_metrics import PrefixMetrics
from gateway.policy.model import Policy, PricingSpec

# No `<name>_created` series beside every counter and histogram: one more sample per label
# set (about a sixth of a busy page's samples) that no panel or rule reads; vLLM turns them
# off too. Process-wide, and read at each scrape, so it holds for every registry;
# PROMETHEUS_DISABLE_CREATED_SERIES=true is the same switch for a process that never imports
# this module.
disable_created_metrics()  # type: ignore[no-untyped-call]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                0.5, 1.0, 2.5)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# A stage takes microseconds (routing) to seconds (a long prompt's tokens, a queue).
STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

UPSTREAM_ERROR_KINDS = ("connect", "timeout", "status_5xx", "redirect", "disconnect", "protocol")

# New name -> the old one, still exported for one release with the same samples and the HELP
# "Deprecated: use <new>." (docs/metrics.md, "Renamed metrics"). Remove after the next release.
DEPRECATED_NAMES = {
    "gateway_queue_requests": "gateway_queue_depth",
    "gateway_kv_reserved_blocks": "gateway_kv_blocks_reserved",
    "gateway_kv_capacity_blocks": "gateway_kv_blocks_capacity",
    "gateway_prefill_pending_tokens": "gateway_prefill_tokens_pending",
}
DEFAULT_CURRENCY: str = PricingSpec.model_fields["currency"].default  # a pool without `cost`


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.child = LabelChildren()  # children the request path touches, bound once
        r = self.registry
        self.requests = Counter(
            "gateway_requests_total", "Requests answered, by pool, model and HTTP status.",
            ["pool", "model", "status"], registry=r)
        self.duration = Histogram(
            "gateway_request_duration_seconds",
            "Time from the request's arrival to the last byte of the response.",
            ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "gateway_ttft_seconds",
            "Time to first token as the caller sees it: arrival to first streamed content.",
            ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "gateway_tpot_seconds",
            "Time per output token after the first, per request (e2e - ttft) / (tokens - 1).",
            ["pool"], buckets=TPOT_BUCKETS, registry=r)
        self.inflight = Gauge(
            "gateway_inflight_requests", "Requests being forwarded now.", ["pool"], registry=r,
            multiprocess_mode="livesum")
        self.backend_up = Gauge(
            "gateway_backend_up", "1 when the backend takes traffic (probe ok, not ejected).",
            ["pool", "backend"], registry=r, multiprocess_mode="livemax")
        self.upstream_errors = Counter(
            "gateway_upstream_errors_total", "Failures talking to an engine, by kind: "
            + ", ".join(UPSTREAM_ERROR_KINDS) + ".",
            ["pool", "backend", "kind"], registry=r)
        self.loop_lag = Histogram(
            "gateway_event_loop_lag_seconds",
            "How late the event loop ran a timer: time every stream waited for CPU.",
            buckets=LAG_BUCKETS, registry=r)
        # Where the time before the first byte goes upstream is spent, one stage at a time
        # (gateway/pipeline/context.py names them): the gateway's own cost, request by request.
        self.request_stage = Histogram(
            "gateway_request_stage_seconds",
            "Time each request spends in each stage before its first byte goes upstream, and "
            "the engine's answer headers after it.", ["stage"], buckets=STAGE_BUCKETS,
            registry=r)
        self.gc_pause = Histogram(
            "gateway_gc_pause_seconds", "Garbage-collection pauses, by generation.",
            ["generation"], buckets=LAG_BUCKETS, registry=r)
        self._gc_children = [self.gc_pause.labels(str(g)) for g in range(3)]
        # What collections find: the request path makes no cyclic garbage (issue 21), so a
        # rate above zero here says some path started to, which the heap keeper's freezing
        # would hide until its next sweep (gateway/serving/heap.py).
        self.gc_collected = Counter(
            "gateway_gc_collected_objects_total",
            "Unreachable objects garbage collections found and freed, by generation.",
            ["generation"], registry=r)
        self._gc_collected_children = [self.gc_collected.labels(str(g)) for g in range(3)]
        # Why each of the heap keeper's sweeps ran: "lull" (no request open, nobody waits) or
        # "growth" (due while requests were open, and memory had grown enough since the last
        # one to be worth a stall); a reload's full pass is counted the same way.
        self.gc_sweeps = Counter(
            "gateway_gc_sweeps_total",
            "Collections of the old generation the heap keeper ran, by what let it run.",
            ["trigger"], registry=r)
        # Both bound (and so exported at 0) from the start.
        self.gc_sweeps_by = {t: self.gc_sweeps.labels(t) for t in ("lull", "growth")}
        self.gc_frozen = Gauge(
            "gateway_gc_frozen_objects",
            "Objects in the permanent generation, which collections do not traverse.",
            registry=r, multiprocess_mode="livesum")
        # Which encoder counts each model's prompts (gateway/tokens/rankbpe.py): 0 where the rank
        # encoder does not apply, is still being built, or its canary found a difference.
        self.tokenizer_rank_encoder = Gauge(
            "gateway_tokenizer_rank_encoder",
            "1 while the model's prompts are counted by the rank encoder (tiktoken's core, the "
            "Hugging Face encoder's ids), 0 while by the Hugging Face encoder.",
            ["model"], registry=r, multiprocess_mode="livemin")
        # Which renders each model's chat template (gateway/tokens/native.py): 0 for a template
        # it does not know, `renderer: jinja`, or for good after its canary found a difference.
        self.chat_template_native = Gauge(
            "gateway_chat_template_native",
            "1 while the model's chat template (for requests without tools) is rendered in "
            "plain Python, 0 while by Jinja.",
            ["model"], registry=r, multiprocess_mode="livemin")
        # (generation, seconds, collected) of collections not yet observed; bounded, should
        # no tick come
        self._gc_pauses: deque[tuple[int, float, int]] = deque(maxlen=4096)
        self._stage_observers: dict[str, Callable[[float], None]] = {}
        # --- admission ---
        self.admission_decisions = Counter(
            "gateway_admission_decisions_total",
            "Admission decisions: admitted (at once), queued (admitted after waiting), "
            "rejected; with the reason.", ["pool", "decision", "reason"], registry=r)
        self.queue_depth = Gauge(
            "gateway_queue_requests", "Requests waiting for admission.", ["pool", "priority"],
            registry=r, multiprocess_mode="livesum")
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds", "Time admitted requests spent in the queue.",
            ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_blocks_reserved = Gauge(
            "gateway_kv_reserved_blocks", "KV blocks reserved by in-flight requests "
            "(all replicas sharing the state backend).", ["pool", "backend"], registry=r,
            multiprocess_mode="livemostrecent")
        self.prefill_tokens_pending = Gauge(
            "gateway_prefill_pending_tokens", "Prompt tokens this replica sent to the backend "
            "that still await their first token: the engine's prefill backlog.",
            ["pool", "backend"], registry=r, multiprocess_mode="livesum")
        self.kv_blocks_capacity = Gauge(
            "gateway_kv_capacity_blocks", "KV blocks of the backend: from the engine's "
            "vllm:cache_config_info, else the policy, else the planner's ledger.",
            ["pool", "backend"], registry=r, multiprocess_mode="livemostrecent")
        self.kv_overbook = Gauge(
            "gateway_kv_overbook_ratio", "Learned ratio of reserved KV blocks to the blocks the "
            "engine reports in use; reservations may exceed the budget by it.",
            ["pool", "backend"], registry=r, multiprocess_mode="livemostrecent")
        self.engine_kv_usage = Gauge(
            "gateway_engine_kv_usage_ratio", "The engine's own KV cache usage (0-1), scraped.",
            ["pool", "backend"], registry=r, multiprocess_mode="livemostrecent")
        self.engine_requests = Gauge(
            "gateway_engine_requests", "Requests the engine reports, scraped: `running` "
            "(vLLM/SGLang running, llama.cpp requests_processing) and `waiting` (queued in the "
            "engine; llama.cpp requests_deferred).", ["pool", "backend", "state"], registry=r,
            multiprocess_mode="livemostrecent")
        self.engine_kv_block_size = Gauge(
            "gateway_engine_kv_block_size_tokens", "The engine's own KV block (vLLM "
            "cache_config_info block_size), scraped: predicted cached tokens round down to it, "
            "reservations up to the pool's largest.", ["pool", "backend"], registry=r,
            multiprocess_mode="livemostrecent")
        self.engine_slots = Gauge(
            "gateway_engine_slots", "A slot engine's slots (llama.cpp /props total_slots): the "
            "most requests the gateway runs there at once.", ["pool", "backend"], registry=r,
            multiprocess_mode="livemostrecent")
        self.latency_guard_limit = Gauge(
            "gateway_latency_guard_limit_tokens", "In-flight tokens the latency guard allows "
            "the pool now.", ["pool"], registry=r, multiprocess_mode="livemin")
        self.state_errors = Counter(
            "gateway_state_errors_total", "Failed operations on the state backend.", ["op"],
            registry=r)
        self.state_breaker = Gauge(
            "gateway_state_breaker_state", "The state backend's circuit breaker: 0 closed "
            "(calls go to Redis), 1 open (every call fails at once and the fail mode applies), "
            "2 half-open (one probe call in flight).", registry=r, multiprocess_mode="livemax")
        self.state_timeouts = Counter(
            "gateway_state_timeouts_total", "State-backend calls that ran out of the policy's "
            "state.timeout_s (a Redis that hangs); each opens the circuit breaker.", ["op"],
            registry=r)
        self.state_breaker_opens = Counter(
            "gateway_state_breaker_opens_total", "Times the state backend's circuit breaker "
            "opened from closed: outages of the shared state, however short.", registry=r)
        self.shadow_decisions = Counter(
            "gateway_shadow_decisions_total", "What admission or a tenant rule in shadow mode "
            "would have done; the request was forwarded regardless.",
            ["pool", "decision", "reason"], registry=r)
        self.policy_reloads = Counter(
            "gateway_policy_reloads_total", "Policy reloads by result: ok, invalid (the old "
            "policy stays in force).", ["result"], registry=r)
        for result in ("ok", "invalid"):  # from 0, so the first failed reload is an increase
            self.policy_reloads.labels(result)
        self.slo_target = Gauge(
            "gateway_slo_target_seconds", "The pool's latency targets from the policy "
            "(admission ttft_p99_max_s, tpot_p99_max_s), for dashboards and alerts.",
            ["pool", "kind"], registry=r, multiprocess_mode="livemax")
        self.quota_limit = Gauge(
            "gateway_tenant_quota_tokens", "A tenant's token quota per window (minute, day).",
            ["tenant", "window"], registry=r, multiprocess_mode="livemax")
        self.quota_rejections = Counter(
            "gateway_quota_rejections_total", "Requests refused with 429 for a tenant's token "
            "quota.", ["tenant"], registry=r)
        # --- tokens and cost ---
        self.tokens = Counter(
            "gateway_tokens_total", "Tokens by the engines' usage: input (prompt computed), "
            "cached (prompt from the prefix cache), output.", ["pool", "tenant", "kind"],
            registry=r)
        # Money: in the pool's `cost.currency` (label `currency`), appended by `_InCurrency`.
        self._currencies: dict[str, str] = {}
        self.cost_per_hour = _InCurrency(Gauge(
            "gateway_cost_per_hour", "What the pool's GPUs cost per hour (policy cost model), "
            "in `currency`.", ["pool", "currency"], registry=r, multiprocess_mode="livemax"),
            ("pool",), self._currencies, self.child)
        self.cost_per_million = _InCurrency(Gauge(
            "gateway_cost_per_million_tokens", "Cost per million input or output tokens over "
            "the pool's cost window, in `currency`.", ["pool", "kind", "currency"], registry=r,
            multiprocess_mode="livemostrecent"), ("pool", "kind"), self._currencies, self.child)
        self.tenant_cost = _InCurrency(Counter(
            "gateway_tenant_cost_total", "Spend attributed to tenants: their tokens at the "
            "pool's current prices, in `currency`.", ["tenant", "pool", "currency"],
            registry=r), ("tenant", "pool"), self._currencies, self.child)
        self.token_estimate_error = Histogram(
            "gateway_token_estimate_error_ratio",
            "Relative error of prompt-token estimates for models with tokenizer `none` "
            "(|estimate - engine's count| / engine's count).", ["model"],
            buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0), registry=r)
        for op in ("reserve", "release", "refresh", "usage", "quota"):
            self.state_errors.labels(op)  # from 0, so a single error is an increase
            self.state_timeouts.labels(op)
        self.prefix = PrefixMetrics(r, self.child)  # gateway/observe/prefix_metrics.py
        self.kv_events = KVEventMetrics(r)  # gateway/observe/kv_events_metrics.py
        renamed = [self.queue_depth, self.kv_blocks_reserved, self.kv_blocks_capacity,
                   self.prefill_tokens_pending]
        r.register(DeprecatedAliases(lambda: (f for m in renamed for f in m.collect())))
        self._pool_children: dict[str, tuple[Any, Any, Any, Any]] = {}

    def publish_policy(self, policy: Policy) -> None:
        """Targets, quotas and currencies from the policy in force, as gauges dashboards can
        draw."""
        for name, pool in policy.pools.items():
            currency = pool.cost.currency if pool.cost is not None else DEFAULT_CURRENCY
            old = self._currencies.get(name, currency)
            self._currencies[name] = currency
            if old != currency:  # a reload repriced the pool: its old amounts are not in it
                for money in (self.cost_per_hour, self.cost_per_million, self.tenant_cost):
                    money.remove_pool(name, old)
            for kind, value in (("ttft_p99", pool.admission.ttft_p99_max_s),
                                ("tpot_p99", pool.admission.tpot_p99_max_s)):
                if value is not None:
                    self.slo_target.labels(name, kind).set(value)
        for t in policy.tenants:
            for window, value in (("minute", t.tokens_per_minute), ("day", t.tokens_per_day)):
                if value is not None:
                    self.quota_limit.labels(t.name, window).set(value)

    def request_done(self, pool: str, model: str, status: int) -> None:
        self.child(self.requests, pool, model, str(status)).inc()

    def pool_children(self, pool: str) -> tuple[Any, Any, Any, Any]:
        """A pool's duration, TTFT and TPOT histograms and in-flight gauge, in one lookup."""
        children = self._pool_children.get(pool)
        if children is None:
            children = self._pool_children[pool] = tuple(
                self.child(m, pool) for m in (self.duration, self.ttft, self.tpot,
                                              self.inflight))
        return children

    def install_gc_callback(self) -> None:
        """Time every collection: a full one stalls every open stream for its duration.

        The callback only notes the pause; `flush_gc_pauses` observes it later. Observing in
        the callback deadlocked a `--workers` process: a collection can start inside
        prometheus_client while it holds its (not re-entrant) multiprocess value lock, creating
        a label child, and the callback's observe then waited for that same lock forever.
        """
        started: list[float] = [0.0]
        pauses = self._gc_pauses

        # CPU time of the collecting thread, not wall time: a collection holds the GIL, but the
        # Python callback around it may wait for the GIL, which is not the collection's pause.
        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[0] = time.thread_time()
            else:
                pauses.append((info["generation"], time.thread_time() - started[0],
                               info["collected"]))

        gc.callbacks.append(on_gc)
        self._gc_callback = on_gc

    def stage_observer(self, stage: str) -> Callable[[float], None]:
        """The observe method of gateway_request_stage_seconds{stage}, its child bound once.
        Eight observations a request cost ~10 us against ~4 ms of the gateway's CPU a request
        at 100 streams: 0.3%."""
        observe = self._stage_observers.get(stage)
        if observe is None:
            observe = self._stage_observers[stage] = self.request_stage.labels(stage).observe
        return observe

    def flush_gc_pauses(self) -> None:
        """Observe the collections noted since the last call (the loop-lag monitor's tick)."""
        pauses = self._gc_pauses
        while pauses:
            generation, seconds, collected = pauses.popleft()
            self._gc_children[generation].observe(seconds)
            if collected:
                self._gc_collected_children[generation].inc(collected)

    def remove_gc_callback(self) -> None:
        cb = getattr(self, "_gc_callback", None)
        if cb is not None and cb in gc.callbacks:
            gc.callbacks.remove(cb)


class _InCurrency:
    """A money metric with a last label `currency`, filled in from the pool's `cost.currency`:
    callers pass the other labels (`labels(pool)`, `labels(tenant, pool)`) as before, and every
    amount says what it is counted in. One dict lookup more per call, made per request or per
    price update, never per chunk."""

    def __init__(self, metric: Gauge | Counter, labelnames: tuple[str, ...],
                 currencies: dict[str, str], children: LabelChildren) -> None:
        self.metric = metric
        self._labelnames = labelnames
        self._pool = labelnames.index("pool")
        self._currencies = currencies
        self._children = children

    def labels(self, *values: str) -> Any:
        return self._children(self.metric, *values,
                              self._currencies.get(values[self._pool], DEFAULT_CURRENCY))

    def remove_pool(self, pool: str, currency: str) -> None:
        """Drop the pool's series in `currency`. Not under --workers: prometheus_client cannot
        remove a series from the workers' files (it warns), which keep it until they restart."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return
        stale = {tuple(s.labels[n] for n in self._labelnames)
                 for family in self.metric.collect() for s in family.samples
                 if s.labels.get("pool") == pool and s.labels.get("currency") == currency}
        for values in stale:
            self.metric.remove(*values, currency)
            self._children.forget(self.metric, *values, currency)


class DeprecatedAliases(Collector):
    """The old name of each renamed metric (`DEPRECATED_NAMES`), its samples copied from the
    new family at scrape time: nothing on the request path writes twice, and an alias cannot
    drift from its metric. `passthrough` also yields the source's own families (the merged
    multiprocess collector, which is the only collector of its registry)."""

    def __init__(self, source: Callable[[], Iterable[Metric]], passthrough: bool = False) -> None:
        self.source = source
        self.passthrough = passthrough

    def describe(self) -> Iterable[Metric]:
        return [Metric(old, "", "gauge") for old in DEPRECATED_NAMES.values()]

    def collect(self) -> Iterable[Metric]:
        for family in self.source():
            if self.passthrough:
                yield family
            old = DEPRECATED_NAMES.get(family.name)
            if old is not None:
                alias = Metric(old, f"Deprecated: use {family.name}. {family.documentation}",
                               family.type)
                alias.samples = [s._replace(name=old + s.name[len(family.name):])
                                 for s in family.samples]
                yield alias


def exposition_registry(own: CollectorRegistry) -> CollectorRegistry:
    """What `/metrics` renders: this app's registry, or under `gateway serve --workers N`
    (PROMETHEUS_MULTIPROC_DIR set) every worker's samples merged from their files, with the
    deprecated aliases added to the merge."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return own
    # A worker that died (uvicorn starts another) must leave the live gauges; its counters
    # stay, so totals never go backwards.
    for name in os.listdir(path):
        if name.startswith("gauge_live") and name.endswith(".db"):
            pid = int(name.rsplit("_", 1)[1][:-3])
            if not _alive(pid):
                multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    registry = CollectorRegistry()
    merged = multiprocess.MultiProcessCollector(None, path)  # type: ignore[no-untyped-call]
    registry.register(DeprecatedAliases(merged.collect, passthrough=True))
    return registry


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
