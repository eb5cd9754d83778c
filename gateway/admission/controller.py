"""Admit now, queue, or reject: the decision for each request, per pool.

A request brings a KV reservation (prompt + expected output, in blocks) and token work. It is
admitted onto the backend with the most KV headroom when the reservation fits under the
backend's block limit (`kv_usage_max` of its capacity, less what the engine reports in use
beyond our own reservations) and the pool's in-flight tokens stay under the limit (the policy's
`inflight_tokens_max`, shrunk by the latency guard while P99 is over the SLO), and the engine's
own waiting queue is under `waiting_max`, and the prompt tokens it has been sent that still
await their first token (its prefill backlog, what TTFT waits on) are under
`prefill_tokens_max`.

Otherwise it waits in the pool's fair queue if its predicted wait (work queued ahead over the
pool's measured drain rate) fits its deadline; if not, it is rejected at once with 503 and a
Retry-After from the same prediction: early rejection, as Mooncake does, instead of a timeout.

The check-and-reserve itself is the state backend's, atomic across replicas. When that store
is unreachable, the pool's `fail_mode` decides: `open` falls back to this replica's share of
the budget (budget / replicas seen alive) in memory, `closed` rejects.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.admission.guard import LatencyGuard, Verdict, combine, verdict
from gateway.admission.queue import PRIORITIES, FairQueue, Waiter
from gateway.admission.thresholds import Thresholds, thresholds_for
from gateway.backends import Backend, Backends
from gateway.errors import GatewayError, NoBackendAvailable, Overloaded, StateUnavailable
from gateway.observe.metrics import GatewayMetrics
from gateway.policy.model import Policy, PoolSpec
from gateway.profiles import get_gpu, ledger
from gateway.signals.engines import EngineSample, EngineScraper
from gateway.signals.quantiles import WindowedQuantiles
from gateway.signals.streams import (
    TPOT_MARGIN,
    LiveStreams,
    StreamProgress,
    Watched,
    count_over,
)
from gateway.state import Lease, Limits, MemoryState, StateBackend, StateError

log = logging.getLogger("gateway.admission")

UNKNOWN_CAPACITY_BLOCKS = 1 << 40  # no architecture and no engine report: only tokens bound
TICK_S = 0.05
# Learn the overbooking ratio only from samples where reservations hold a fair share of the
# backend: an idle engine says nothing about how much reservations overestimate.
OVERBOOK_MIN_LOAD = 0.3
OVERBOOK_SMOOTHING = 0.2


@dataclass(eq=False)
class Ticket:
    pool: str
    backend: Backend
    lease: Lease | None
    store: StateBackend | None
    decision: str  # "admitted" | "queued"
    reason: str
    queue_s: float = 0.0
    overflow: bool = False
    watched: Watched | None = None  # followed by the latency guard while it streams
    prefill: int = 0  # prompt tokens counted in its backend's prefill backlog until 1st byte


@dataclass(frozen=True, slots=True)
class Ask:
    """What admission needs to know of a request."""

    pool: str
    blocks: int  # KV blocks to reserve (prompt + expected output)
    tokens: int  # tokens of work (prompt + expected output)
    priority: int = PRIORITIES["standard"]
    caller: str = "anonymous"
    deadline_s: float | None = None  # a client's shorter queue deadline
    overflow: bool = False
    tenant: str = ""
    tenant_share: float | None = None  # the tenant's max share of the pool's KV budget
    tenant_shadow: bool = False  # the tenant's share is counted, not enforced
    prompt_tokens: int = 0  # what its engine must prefill before the first token


@dataclass(eq=False)
class PoolState:
    name: str
    spec: PoolSpec
    thresholds: Thresholds
    queue: FairQueue
    guard: LatencyGuard
    ttft: WindowedQuantiles
    tpot: WindowedQuantiles
    live: LiveStreams
    capacity: dict[str, int] = field(default_factory=dict)  # backend -> KV blocks
    reserved: dict[str, int] = field(default_factory=dict)  # last known, backend -> blocks
    reserved_tokens: int = 0
    prefill: dict[str, int] = field(default_factory=dict)  # backend -> tokens before 1st byte
    drained_tokens: float = 0.0
    drain_rate: float = 0.0  # tokens/s released, EWMA
    overflow_inflight: int = 0
    overbook: dict[str, float] = field(default_factory=dict)  # backend -> reserved / used
    tenant_blocks: dict[str, int] = field(default_factory=dict)  # this replica's, for shadow
    drain_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Admission:
    def __init__(self, policy: Policy, backends: Backends, state: StateBackend,
                 metrics: GatewayMetrics, scraper: EngineScraper,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.backends = backends
        self.state = state
        self.fallback = MemoryState(clock)
        self.metrics = metrics
        self.scraper = scraper
        self.clock = clock
        self.replicas = 1
        self.replica_id = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
        self._ids = itertools.count(1)
        self.live: dict[str, tuple[StateBackend, Lease]] = {}
        self.pools: dict[str, PoolState] = {}
        for name, spec in policy.pools.items():
            th = thresholds_for(spec)
            ps = PoolState(
                name=name, spec=spec, thresholds=th, queue=FairQueue(spec.admission.queue_size),
                guard=LatencyGuard(ceiling=1.0, floor=1.0),
                ttft=WindowedQuantiles(spec.admission.latency_window_s, clock=clock),
                tpot=WindowedQuantiles(spec.admission.latency_window_s, clock=clock),
                live=LiveStreams())
            for b in spec.backends:
                ps.capacity[b.name] = self._planned_blocks(spec)
                ps.reserved[b.name] = 0
                ps.prefill[b.name] = 0
                metrics.kv_blocks_capacity.labels(name, b.name).set(ps.capacity[b.name])
                metrics.kv_blocks_reserved.labels(name, b.name).set(0)
            self._rescale_guard(ps)
            self.pools[name] = ps

    # --- capacity -----------------------------------------------------------------------------

    def _planned_blocks(self, spec: PoolSpec) -> int:
        if spec.kv_blocks is not None:
            return spec.kv_blocks
        model = self.policy.model(spec.models[0])
        if model is None or model.architecture is None:
            return UNKNOWN_CAPACITY_BLOCKS
        led = ledger(model.architecture.resolve(), get_gpu(spec.gpu), spec.tp, model.dtype,
                     model.kv_cache_dtype, block_size=spec.block_size)
        return max(1, led.num_gpu_blocks)

    def _rescale_guard(self, ps: PoolState) -> None:
        static = ps.thresholds.inflight_tokens_max.value
        kv = ps.thresholds.kv_usage_max.value or 1.0
        capacity_tokens = sum(ps.capacity.values()) * ps.spec.block_size * kv
        ceiling = float(static) if static is not None else capacity_tokens
        ps.guard.rescale(ceiling, floor=min(ceiling, 0.05 * ceiling))
        self.metrics.latency_guard_limit.labels(ps.name).set(ps.guard.limit)

    def on_engine_sample(self, pool: str, backend: str, sample: EngineSample) -> None:
        ps = self.pools.get(pool)
        if ps is None:
            return
        blocks = sample.num_gpu_blocks
        if blocks is None and sample.max_tokens is not None:
            blocks = sample.max_tokens // ps.spec.block_size
        if blocks and ps.spec.kv_blocks is None and ps.capacity.get(backend) != blocks:
            ps.capacity[backend] = blocks  # the engine's own number beats the ledger's
            self.metrics.kv_blocks_capacity.labels(pool, backend).set(blocks)
            self._rescale_guard(ps)
        if sample.kv_usage is not None:
            self.metrics.engine_kv_usage.labels(pool, backend).set(sample.kv_usage)
            self._learn_overbook(ps, backend, sample.kv_usage)

    def _learn_overbook(self, ps: PoolState, backend: str, kv_usage: float) -> None:
        """How much our reservations exceed the blocks the engine really holds."""
        limit = ps.spec.admission.overbook_max
        capacity = ps.capacity[backend]
        reserved = ps.reserved.get(backend, 0)
        if limit <= 1.0 or capacity >= UNKNOWN_CAPACITY_BLOCKS or \
                reserved < OVERBOOK_MIN_LOAD * capacity or kv_usage <= 0:
            return
        ratio = min(limit, max(1.0, reserved / (kv_usage * capacity)))
        old = ps.overbook.get(backend, 1.0)
        ps.overbook[backend] = (1 - OVERBOOK_SMOOTHING) * old + OVERBOOK_SMOOTHING * ratio
        self.metrics.kv_overbook.labels(ps.name, backend).set(ps.overbook[backend])

    def max_blocks(self, ps: PoolState, backend: str) -> int:
        """Blocks our reservations may take on `backend`, engine-reported usage considered."""
        capacity = ps.capacity[backend]
        overbook = ps.overbook.get(backend, 1.0)
        limit = int(capacity * (ps.thresholds.kv_usage_max.value or 1.0) * overbook)
        sample = self.scraper.fresh(ps.name, backend)
        known = capacity < UNKNOWN_CAPACITY_BLOCKS
        if sample is not None and sample.kv_usage is not None and known:
            # Blocks in use that we did not reserve (other traffic, another gateway) are taken.
            external = sample.kv_usage * capacity - ps.reserved.get(backend, 0) / overbook
            if external > 0:
                limit -= int(external * overbook)
        return max(0, limit)

    def _engine_full(self, ps: PoolState, backend: str) -> str | None:
        """Why the engine's own report rules this backend out now, if it does."""
        sample = self.scraper.fresh(ps.name, backend)
        # Unknown (stale or never scraped) is not "idle": the reservation limit still holds.
        if sample is None:
            return None
        waiting_max = ps.thresholds.waiting_max.value
        if waiting_max is not None and sample.waiting is not None \
                and sample.waiting > waiting_max:
            return "engine_waiting"
        # Overbooked reservations rest on averages; the engine's own usage is the hard line.
        kv_max = ps.thresholds.kv_usage_max.value or 1.0
        if ps.overbook.get(backend, 1.0) > 1.0 and sample.kv_usage is not None \
                and sample.kv_usage > kv_max:
            return "engine_kv"
        return None

    def _prefill_full(self, ps: PoolState, backend: str, prompt_tokens: int) -> bool:
        """Would `prompt_tokens` more push the backend's prefill backlog over its limit?

        The backlog is this replica's own count (it sees each stream's first byte), so each
        replica takes its share of the limit, as it does of the budget when Redis is down. An
        idle backend takes any prompt: one longer than the limit must still run somewhere.
        """
        limit = ps.thresholds.prefill_tokens_max.value
        pending = ps.prefill.get(backend, 0)
        return limit is not None and pending > 0 and \
            pending + prompt_tokens > limit / max(1, self.replicas)

    def _ruled_out(self, ps: PoolState, backend: str, prompt_tokens: int) -> str | None:
        """Why `backend` takes no request of `prompt_tokens` now: the engine's own report, or
        its prefill backlog; None when neither rules it out."""
        full = self._engine_full(ps, backend)
        if full is None and self._prefill_full(ps, backend, prompt_tokens):
            return "prefill_tokens"
        return full

    def prefill_done(self, ticket: Ticket) -> None:
        """The first byte came back (or the request ended): its prompt is prefilled."""
        if ticket.prefill:
            ps = self.pools[ticket.pool]
            b = ticket.backend.name
            ps.prefill[b] = max(0, ps.prefill.get(b, 0) - ticket.prefill)
            ticket.prefill = 0
            self.metrics.prefill_tokens_pending.labels(ps.name, b).set(ps.prefill[b])

    # --- the decision -------------------------------------------------------------------------

    async def admit(self, ask: Ask) -> Ticket:
        ps = self.pools[ask.pool]
        if not ps.spec.admission.enabled:
            backend = self.backends.pick(ask.pool)
            if backend is None:
                raise _no_backend(ask.pool)
            return Ticket(ask.pool, backend, None, None, "admitted", "admission_disabled")
        if ask.overflow:
            target = self.pools[ask.pool].spec
            cap = next((p.overflow_max_concurrent for p in self.policy.pools.values()
                        if p.overflow_to == ask.pool), target.overflow_max_concurrent)
            if ps.overflow_inflight >= cap:
                self._count(ask.pool, "rejected", "overflow_cap")
                raise Overloaded(f"The long-context pool is unavailable and pool `{ask.pool}` "
                                 f"already runs {cap} overflowed long request(s).",
                                 retry_after_s=5, reason="overflow_cap")
        if ps.spec.admission.mode == "static":
            return self._static(ps, ask)
        if ps.spec.admission.shadow:
            return await self._shadow(ps, ask)
        ticket, reason = await self._try(ps, ask)
        if ticket is not None:
            self._count(ask.pool, "admitted", reason)
            return ticket
        return await self._wait(ps, ask, reason)

    def _static(self, ps: PoolState, ask: Ask) -> Ticket:
        """The static rule: the least-loaded backend whose engine reports at most `waiting_max`
        waiting and KV usage at most `kv_usage_max`; none: 503. No reservation, no queue."""
        waiting_max = ps.thresholds.waiting_max.value
        waiting_max = 5 if waiting_max is None else waiting_max
        th = ps.thresholds.kv_usage_max
        kv_max = th.value if th.source != "default" and th.value is not None else 0.8
        now = self.clock()
        best: Backend | None = None
        for b in self.backends.pools[ps.name]:
            if not b.available(now):
                continue
            s = self.scraper.fresh(ps.name, b.name)
            if s is not None and ((s.waiting or 0) > waiting_max or
                                  (s.kv_usage or 0) > kv_max):
                continue
            if best is None or b.outstanding < best.outstanding:
                best = b
        if best is None:
            if not any(b.available(now) for b in self.backends.pools[ps.name]):
                raise _no_backend(ps.name)
            self._count(ps.name, "rejected", "static_rule")
            raise Overloaded(f"Pool `{ps.name}` is at capacity: every engine reports more "
                             f"than {waiting_max:g} waiting or KV usage over {kv_max:g}.",
                             retry_after_s=1, reason="static_rule")
        self._count(ps.name, "admitted", "static_rule")
        return Ticket(ps.name, best, None, None, "admitted", "static_rule")

    async def _shadow(self, ps: PoolState, ask: Ask) -> Ticket:
        """Decide exactly as if enforcing and count it; then forward whatever was decided.

        A request that would have waited or been refused is still reserved (beyond the
        limits), so the next decisions see the load the engines really carry.
        """
        ticket, reason = await self._try(ps, ask)
        if ticket is not None:
            self.metrics.shadow_decisions.labels(ps.name, "admitted", reason).inc()
            return ticket
        predicted, deadline = self._outlook(ps, ask)
        would_wait = ps.spec.admission.queue_size > 0 and predicted <= deadline
        self.metrics.shadow_decisions.labels(
            ps.name, "queued" if would_wait else "rejected",
            reason if would_wait or predicted <= deadline else "predicted_wait").inc()
        now = self.clock()
        backend = max((b for b in self.backends.pools[ps.name] if b.available(now)),
                      key=lambda b: self.max_blocks(ps, b.name) - ps.reserved.get(b.name, 0),
                      default=None)
        if backend is None:
            raise _no_backend(ps.name)
        forced, _ = await self._reserve(ps, ask, backend, force=True)
        assert forced is not None
        forced.reason = "shadow"
        return forced

    async def _try(self, ps: PoolState, ask: Ask) -> tuple[Ticket | None, str]:
        """One attempt on each backend, most headroom first; (ticket, reason)."""
        now = self.clock()
        candidates = [b for b in self.backends.pools[ps.name] if b.available(now)]
        if not candidates:
            raise _no_backend(ps.name)
        scored = sorted(candidates, key=lambda b: self.max_blocks(ps, b.name)
                        - ps.reserved.get(b.name, 0), reverse=True)
        reason = "kv_blocks"
        for backend in scored:
            full = self._ruled_out(ps, backend.name, ask.prompt_tokens)
            if full is not None:
                reason = full
                continue
            ticket, reason = await self._reserve(ps, ask, backend)
            if ticket is not None or reason == "inflight_tokens":
                return ticket, reason
        return None, reason

    async def _reserve(self, ps: PoolState, ask: Ask, backend: Backend,
                       force: bool = False) -> tuple[Ticket | None, str]:
        max_blocks = self.max_blocks(ps, backend.name)
        # A reservation larger than a whole backend would never fit; cap it at the limit so
        # the request runs alone rather than waiting forever.
        blocks = min(ask.blocks, max(1, max_blocks))
        lease = Lease(ps.name, backend.name, f"{self.replica_id}-{next(self._ids)}", blocks,
                      ask.tokens, ask.tenant)
        guard_limit = int(ps.guard.limit) if ps.guard.limit < ps.guard.ceiling or \
            ps.thresholds.inflight_tokens_max.value is not None else None
        tenant_max = None
        if ask.tenant_share is not None and not ask.tenant_shadow:
            budget = sum(int(c * (ps.thresholds.kv_usage_max.value or 1.0))
                         for c in ps.capacity.values())
            tenant_max = max(1, int(budget * ask.tenant_share))
        limits = Limits(max_blocks, guard_limit, tenant_max)
        if force:
            limits = Limits(UNKNOWN_CAPACITY_BLOCKS, None, None)
        store = self.state
        try:
            result = await store.reserve(lease, limits, ps.spec.admission.lease_ttl_s)
        except StateError as exc:
            self.metrics.state_errors.labels("reserve").inc()
            if ps.spec.admission.fail_mode == "closed":
                raise StateUnavailable(f"Admission state is unavailable and pool `{ps.name}` "
                                       "fails closed.", retry_after_s=1) from exc
            store = self.fallback
            share = max(1, self.replicas)
            limits = Limits(max_blocks // share,
                            None if limits.max_tokens is None else limits.max_tokens // share)
            result = await store.reserve(lease, limits, ps.spec.admission.lease_ttl_s)
        if store is self.state:
            ps.reserved[backend.name] = result.backend_blocks
            ps.reserved_tokens = result.pool_tokens
            self.metrics.kv_blocks_reserved.labels(ps.name, backend.name).set(
                result.backend_blocks)
        if not result.ok:
            return None, result.reason
        if ask.tenant_shadow and ask.tenant_share is not None:
            self._shadow_tenant_share(ps, ask, lease)
        self.live[lease.lease_id] = (store, lease)
        if ask.overflow:
            ps.overflow_inflight += 1
        ps.tenant_blocks[lease.tenant] = ps.tenant_blocks.get(lease.tenant, 0) + lease.blocks
        ps.prefill[backend.name] = ps.prefill.get(backend.name, 0) + ask.prompt_tokens
        self.metrics.prefill_tokens_pending.labels(ps.name, backend.name).set(
            ps.prefill[backend.name])
        return Ticket(ps.name, backend, lease, store, "admitted",
                      "fallback" if store is self.fallback else "fits",
                      overflow=ask.overflow, prefill=ask.prompt_tokens), "fits"

    def preview(self, ask: Ask) -> dict[str, object]:
        """The decision `admit` would take now, without reserving: for /gateway/estimate."""
        ps = self.pools[ask.pool]
        now = self.clock()
        backends = {}
        best: tuple[int, str] | None = None
        ruled_out = "no_backend"
        for b in self.backends.pools[ps.name]:
            limit = self.max_blocks(ps, b.name)
            reserved = ps.reserved.get(b.name, 0)
            sample = self.scraper.fresh(ps.name, b.name)
            backends[b.name] = {
                "available": b.available(now), "capacity_blocks": ps.capacity[b.name],
                "limit_blocks": limit, "reserved_blocks": reserved,
                "prefill_pending_tokens": ps.prefill.get(b.name, 0),
                "engine": None if sample is None else {
                    "kv_usage": sample.kv_usage, "waiting": sample.waiting,
                    "running": sample.running, "age_s": round(now - sample.at, 3)},
                "engine_rules_out": self._engine_full(ps, b.name)}
            full = self._ruled_out(ps, b.name, ask.prompt_tokens)
            if b.available(now) and full is not None:
                ruled_out = full
            elif b.available(now):
                headroom = limit - reserved
                if best is None or headroom > best[0]:
                    best = (headroom, b.name)
        limit_tokens = ps.guard.limit
        if best is None:
            decision, reason = ("reject", "no_backend") if ruled_out == "no_backend" \
                else ("wait", ruled_out)
        elif min(ask.blocks, max(1, best[0] + ps.reserved.get(best[1], 0))) > best[0]:
            decision, reason = "wait", "kv_blocks"
        elif ps.reserved_tokens and ps.reserved_tokens + ask.tokens > limit_tokens:
            decision, reason = "wait", "inflight_tokens"
        else:
            decision, reason = "admit", "fits"
        predicted = None
        if decision == "wait":
            predicted, deadline = self._outlook(ps, ask)
            ok = ps.spec.admission.queue_size > 0 and predicted <= deadline
            decision = "queue" if ok else "reject"
            if not ok:
                reason = "predicted_wait" if ps.spec.admission.queue_size else reason
        return {
            "decision": decision, "reason": reason,
            "backend": best[1] if best and decision == "admit" else None,
            "predicted_wait_s": predicted,
            "pool": {"reserved_tokens": ps.reserved_tokens,
                     "guard_limit_tokens": limit_tokens, "guard_state": ps.guard.state,
                     "queue_depth": len(ps.queue), "drain_rate_tokens_s": ps.drain_rate,
                     "ttft_p99_s": ps.ttft.quantile(0.99), "tpot_p99_s": ps.tpot.quantile(0.99)},
            "thresholds": ps.thresholds.as_dict(),
            "backends": backends,
        }

    def _shadow_tenant_share(self, ps: PoolState, ask: Ask, lease: Lease) -> None:
        """A tenant rule in shadow mode: count when its share would have been exceeded."""
        assert ask.tenant_share is not None
        budget = sum(int(c * (ps.thresholds.kv_usage_max.value or 1.0))
                     for c in ps.capacity.values())
        held = ps.tenant_blocks.get(ask.tenant, 0)
        if held and held + lease.blocks > budget * ask.tenant_share:
            self.metrics.shadow_decisions.labels(ps.name, "rejected", "tenant_share").inc()

    async def _wait(self, ps: PoolState, ask: Ask, reason: str) -> Ticket:
        spec = ps.spec.admission
        predicted, deadline = self._outlook(ps, ask)
        if spec.queue_size == 0 or deadline <= 0:
            self._count(ps.name, "rejected", reason)
            raise self._overloaded(ps, reason, predicted, deadline)
        if predicted > deadline:
            self._count(ps.name, "rejected", "predicted_wait")
            raise self._overloaded(ps, reason, predicted, deadline, "predicted_wait")
        loop = asyncio.get_running_loop()
        now = self.clock()
        waiter = Waiter(ask.priority, ask.caller, ask.tokens, now, now + deadline,
                        loop.create_future(), ask=ask)
        out = ps.queue.push(waiter)
        if out is waiter:
            self._count(ps.name, "rejected", "queue_full")
            raise self._overloaded(ps, reason, predicted, deadline, "queue_full")
        if out is not None:
            self._count(ps.name, "rejected", "shed")
            out.future.set_exception(self._overloaded(ps, reason, predicted, deadline, "shed"))
        self._publish_queue(ps)
        try:
            async with asyncio.timeout(deadline):
                ticket_reason = await waiter.future
        except TimeoutError:
            self._count(ps.name, "rejected", "queue_timeout")
            raise self._overloaded(ps, reason, predicted, deadline, "queue_timeout") from None
        except BaseException:
            # Cancelled (the caller left) just as the dispatcher reserved for it: give it back.
            if waiter.ticket is not None:
                await asyncio.shield(self.release(waiter.ticket, completed=False))
            raise
        finally:
            ps.queue.remove(waiter)
            self._publish_queue(ps)
            if not waiter.future.done():
                waiter.future.cancel()
        ticket: Ticket = waiter.ticket
        ticket.decision = "queued"
        ticket.reason = ticket_reason
        ticket.queue_s = self.clock() - now
        self.metrics.queue_wait.labels(ps.name).observe(ticket.queue_s)
        self._count(ps.name, "queued", reason)
        return ticket

    @staticmethod
    def _outlook(ps: PoolState, ask: Ask) -> tuple[float, float]:
        """(predicted wait, deadline) for `ask` joining the queue now: the work queued ahead
        of it and its own, over the pool's measured drain rate (0 until one is measured)."""
        ahead = ps.queue.work_ahead(ask.priority, ask.caller)
        predicted = (ahead + ask.tokens) / ps.drain_rate if ps.drain_rate > 0 else 0.0
        deadline = ps.spec.admission.queue_wait_max_s
        if ask.deadline_s is not None:
            deadline = min(deadline, ask.deadline_s)
        return predicted, deadline

    def _overloaded(self, ps: PoolState, cause: str, predicted: float, deadline: float,
                    outcome: str | None = None) -> Overloaded:
        """503 saying what is full (`cause`) and, if it got that far, why waiting won't do."""
        retry = max(1, math.ceil(predicted if predicted > 0 else min(deadline, 5.0) or 1))
        full = {
            "kv_blocks": "its engines' KV cache is at the admission limit",
            "inflight_tokens": "its in-flight token limit is reached",
            "engine_waiting": "its engines are already queueing requests",
            "prefill_tokens": "its engines' prefill backlog is at the limit",
            "engine_kv": "its engines report their KV cache fuller than kv_usage_max",
            "tenant_share": "this tenant holds its whole share of the pool's KV cache",
        }.get(cause, cause)
        then = {
            None: "",
            "predicted_wait": f", and the predicted wait ({predicted:.1f}s) exceeds the queue "
                              f"deadline ({deadline:g}s)",
            "queue_full": ", and its queue is full",
            "shed": ", and a request of higher priority took this one's place in the queue",
            "queue_timeout": f", and no capacity freed up within the queue deadline "
                             f"({deadline:g}s)",
        }[outcome]
        return Overloaded(f"Pool `{ps.name}` is at capacity: {full}{then}. Retry after "
                          f"{retry}s.",
                          retry_after_s=retry, reason=outcome or cause)

    async def drain(self, ps: PoolState) -> None:
        """Admit waiters in order while they fit; called on every release and on a tick."""
        if not ps.queue or ps.drain_lock.locked():
            return
        async with ps.drain_lock:
            while True:
                head = ps.queue.head()
                if head is None:
                    return
                if head.future.done():
                    ps.queue.remove(head)
                    continue
                ask: Ask = head.ask
                try:
                    ticket, reason = await self._try(ps, ask)
                except GatewayError as exc:
                    ps.queue.remove(head)
                    if not head.future.done():
                        head.future.set_exception(exc)
                    continue
                if ticket is None:
                    return
                ps.queue.remove(head)
                ps.queue.charge(head.caller, head.tokens)
                if head.future.done():  # gave up while we reserved: hand it back
                    await self.release(ticket)
                    continue
                head.ticket = ticket
                head.future.set_result(reason)

    def watch(self, ticket: Ticket, progress: StreamProgress, started: float,
              expected_tokens: int = 0) -> None:
        """Follow a stream the guard should see before it ends (`started`: loop time;
        `expected_tokens`: the output the cost model expects of it)."""
        ps = self.pools[ticket.pool]
        if ps.spec.admission.mode == "static" or ticket.lease is None:
            return
        ticket.watched = ps.live.add(progress, started, self.clock(), expected_tokens)

    async def release(self, ticket: Ticket, *, completed: bool = True) -> None:
        ps = self.pools[ticket.pool]
        self.prefill_done(ticket)
        if ticket.watched is not None:
            ps.live.discard(ticket.watched)
            ticket.watched = None
        if ticket.overflow:
            ps.overflow_inflight -= 1
        if ticket.lease is None or ticket.store is None:
            return
        self.live.pop(ticket.lease.lease_id, None)
        held = ps.tenant_blocks.get(ticket.lease.tenant, 0) - ticket.lease.blocks
        if held > 0:
            ps.tenant_blocks[ticket.lease.tenant] = held
        else:
            ps.tenant_blocks.pop(ticket.lease.tenant, None)
        try:
            await ticket.store.release(ticket.lease)
        except StateError:
            # Not refreshed any more: the lease expires by itself within its TTL.
            self.metrics.state_errors.labels("release").inc()
        if ticket.store is self.state:
            b = ticket.lease.backend
            ps.reserved[b] = max(0, ps.reserved.get(b, 0) - ticket.lease.blocks)
            ps.reserved_tokens = max(0, ps.reserved_tokens - ticket.lease.tokens)
            self.metrics.kv_blocks_reserved.labels(ps.name, b).set(ps.reserved[b])
        if completed:
            ps.drained_tokens += ticket.lease.tokens
        await self.drain(ps)

    def observe_latency(self, pool: str, ttft: float | None, tpot: float | None,
                        admitted_s_ago: float = 0.0) -> None:
        ps = self.pools[pool]
        # The guard judges a limit by the requests it admitted: one admitted before the last
        # cut carries the load that caused the cut, and would cut again for it.
        if self.clock() - admitted_s_ago < ps.guard.last_cut:
            return
        if ttft is not None:
            ps.ttft.observe(ttft)
        if tpot is not None:
            ps.tpot.observe(tpot)

    # --- background ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Refresh leases, update guards and drain rates, poll usage, drain queues."""
        loop = asyncio.get_running_loop()
        last_slow = loop.time()
        while True:
            await asyncio.sleep(TICK_S)
            for ps in self.pools.values():
                await self.drain(ps)
            now = loop.time()
            if now - last_slow >= 1.0:
                await self._slow_tick(now - last_slow)
                last_slow = now

    async def _slow_tick(self, elapsed: float) -> None:
        now = self.clock()
        for ps in self.pools.values():
            rate = ps.drained_tokens / elapsed
            ps.drained_tokens = 0.0
            ps.drain_rate = rate if ps.drain_rate == 0 else 0.7 * ps.drain_rate + 0.3 * rate
            th = ps.thresholds
            # Completed requests in the window, and those still in flight as they stand now:
            # an engine in collapse completes nothing, and its streams say so at once.
            live_ttft, live_tpot = ps.live.latencies(
                asyncio.get_running_loop().time(), since=ps.guard.last_cut,
                pace=ps.tpot.quantile(0.5) or 0.0)
            verdicts: list[Verdict] = []
            for line, window, live, margin in (
                    (th.ttft_p99_max_s.value, ps.ttft, live_ttft, 1.0),
                    (th.tpot_p99_max_s.value, ps.tpot, live_tpot, TPOT_MARGIN)):
                if line is not None:
                    over = window.count_over(line) + count_over(live, line * margin)
                    verdicts.append(verdict(over, window.count() + len(live)))
            cut = ps.guard.update(now, combine(*verdicts) if verdicts else "unsure",
                                  inflight=ps.reserved_tokens)
            if cut:  # judge the new limit by what it admits, not by the window before it
                ps.ttft.clear()
                ps.tpot.clear()
            self.metrics.latency_guard_limit.labels(ps.name).set(ps.guard.limit)
            try:
                usage = await self.state.usage(ps.name)
            except StateError:
                self.metrics.state_errors.labels("usage").inc()
                continue
            for backend in ps.capacity:
                ps.reserved[backend] = usage.blocks.get(backend, 0)
                self.metrics.kv_blocks_reserved.labels(ps.name, backend).set(
                    ps.reserved[backend])
            ps.reserved_tokens = usage.tokens
        leases = [lease for store, lease in self.live.values() if store is self.state]
        local = [lease for store, lease in self.live.values() if store is self.fallback]
        ttl = min(p.spec.admission.lease_ttl_s for p in self.pools.values())
        try:
            if leases:
                await self.state.refresh(leases, ttl)
            self.replicas = await self.state.heartbeat(self.replica_id, ttl_s=5.0)
        except StateError:
            self.metrics.state_errors.labels("refresh").inc()
        await self.fallback.refresh(local, ttl)

    # --- metrics --------------------------------------------------------------------------------

    def _count(self, pool: str, decision: str, reason: str) -> None:
        self.metrics.admission_decisions.labels(pool, decision, reason).inc()

    def _publish_queue(self, ps: PoolState) -> None:
        for name, n in ps.queue.depth_by_priority().items():
            self.metrics.queue_depth.labels(ps.name, name).set(n)


def _no_backend(pool: str) -> GatewayError:
    return NoBackendAvailable(f"No healthy backend in pool `{pool}`.", retry_after_s=1)

