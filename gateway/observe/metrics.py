"""Every Prometheus metric the gateway exports, defined in one place.

Names follow the Prometheus guide: one `gateway_` prefix, base units as suffixes, labels only
from bounded sets (pool, backend, model and tenant names come from the policy; status codes and
error kinds from fixed lists), never a request id or prompt. Latency buckets reach minutes
because long generations and queueing under overload do.

Each app gets its own registry, so several gateways can run in one process (tests) and the
label children used on the hot path are bound once and cached. Under `gateway serve
--workers N` each gauge's `multiprocess_mode` says how the workers' values combine.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from gateway.policy.model import Policy

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                0.5, 1.0, 2.5)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# A stage takes microseconds (routing) to seconds (a long prompt's tokens, a queue).
STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

UPSTREAM_ERROR_KINDS = ("connect", "timeout", "status_5xx", "disconnect", "protocol")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
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
        # (gateway/pipeline.py names them): the gateway's own cost, request by request.
        self.request_stage = Histogram(
            "gateway_request_stage_seconds",
            "Time each request spends in each stage before its first byte goes upstream, and "
            "the engine's answer headers after it.", ["stage"], buckets=STAGE_BUCKETS,
            registry=r)
        self.gc_pause = Histogram(
            "gateway_gc_pause_seconds", "Garbage-collection pauses, by generation.",
            ["generation"], buckets=LAG_BUCKETS, registry=r)
        # --- admission ---
        self.admission_decisions = Counter(
            "gateway_admission_decisions_total",
            "Admission decisions: admitted (at once), queued (admitted after waiting), "
            "rejected; with the reason.", ["pool", "decision", "reason"], registry=r)
        self.queue_depth = Gauge(
            "gateway_queue_depth", "Requests waiting for admission.", ["pool", "priority"],
            registry=r, multiprocess_mode="livesum")
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds", "Time admitted requests spent in the queue.",
            ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_blocks_reserved = Gauge(
            "gateway_kv_blocks_reserved", "KV blocks reserved by in-flight requests "
            "(all replicas sharing the state backend).", ["pool", "backend"], registry=r,
            multiprocess_mode="livemostrecent")
        self.prefill_tokens_pending = Gauge(
            "gateway_prefill_tokens_pending", "Prompt tokens this replica sent to the backend "
            "that still await their first token: the engine's prefill backlog.",
            ["pool", "backend"], registry=r, multiprocess_mode="livesum")
        self.kv_blocks_capacity = Gauge(
            "gateway_kv_blocks_capacity", "KV blocks of the backend: from the engine's "
            "vllm:cache_config_info, else the policy, else the planner's ledger.",
            ["pool", "backend"], registry=r, multiprocess_mode="livemostrecent")
        self.kv_overbook = Gauge(
            "gateway_kv_overbook_ratio", "Learned ratio of reserved KV blocks to the blocks the "
            "engine reports in use; reservations may exceed the budget by it.",
            ["pool", "backend"], registry=r, multiprocess_mode="livemostrecent")
        self.engine_kv_usage = Gauge(
            "gateway_engine_kv_usage_ratio", "The engine's own KV cache usage (0-1), scraped.",
            ["pool", "backend"], registry=r, multiprocess_mode="livemostrecent")
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
        self.cost_per_hour = Gauge(
            "gateway_cost_per_hour", "What the pool's GPUs cost per hour (policy cost model).",
            ["pool"], registry=r, multiprocess_mode="livemax")
        self.cost_per_million = Gauge(
            "gateway_cost_per_million_tokens", "Cost per million input or output tokens over "
            "the pool's cost window.", ["pool", "kind"], registry=r,
            multiprocess_mode="livemostrecent")
        self.tenant_cost = Counter(
            "gateway_tenant_cost_total", "Spend attributed to tenants: their tokens at the "
            "pool's current prices.", ["tenant", "pool"], registry=r)
        self.token_estimate_error = Histogram(
            "gateway_token_estimate_error_ratio",
            "Relative error of prompt-token estimates for models with tokenizer `none` "
            "(|estimate - engine's count| / engine's count).", ["model"],
            buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0), registry=r)
        for op in ("reserve", "release", "refresh", "usage", "quota"):
            self.state_errors.labels(op)  # from 0, so a single error is an increase
            self.state_timeouts.labels(op)
        self._children: dict[tuple[str, ...], Any] = {}

    def publish_policy(self, policy: Policy) -> None:
        """Targets and quotas from the policy in force, as gauges dashboards can draw."""
        for name, pool in policy.pools.items():
            for kind, value in (("ttft_p99", pool.admission.ttft_p99_max_s),
                                ("tpot_p99", pool.admission.tpot_p99_max_s)):
                if value is not None:
                    self.slo_target.labels(name, kind).set(value)
        for t in policy.tenants:
            for window, value in (("minute", t.tokens_per_minute), ("day", t.tokens_per_day)):
                if value is not None:
                    self.quota_limit.labels(t.name, window).set(value)

    # Children cached by key: `labels()` takes a lock and builds a tuple on every call.
    def request_done(self, pool: str, model: str, status: int) -> None:
        key = ("req", pool, model, str(status))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(pool, model, str(status))
        child.inc()

    def pool_children(self, pool: str) -> tuple[Any, Any, Any, Any]:
        key = ("pool", pool)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.duration.labels(pool), self.ttft.labels(pool), self.tpot.labels(pool),
                self.inflight.labels(pool))
        return children

    def install_gc_callback(self) -> None:
        """Time every collection: a full one stalls every open stream for its duration."""
        started: list[float] = [0.0]
        children = [self.gc_pause.labels(str(g)) for g in range(3)]

        # CPU time of the collecting thread, not wall time: a collection holds the GIL, but the
        # Python callback around it may wait for the GIL, which is not the collection's pause.
        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                started[0] = time.thread_time()
            else:
                children[info["generation"]].observe(time.thread_time() - started[0])

        gc.callbacks.append(on_gc)
        self._gc_callback = on_gc

    def remove_gc_callback(self) -> None:
        cb = getattr(self, "_gc_callback", None)
        if cb is not None and cb in gc.callbacks:
            gc.callbacks.remove(cb)


def exposition_registry(own: CollectorRegistry) -> CollectorRegistry:
    """What `/metrics` renders: this app's registry, or under `gateway serve --workers N`
    (PROMETHEUS_MULTIPROC_DIR set) every worker's samples merged from their files."""
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
    multiprocess.MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]
    return registry


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
