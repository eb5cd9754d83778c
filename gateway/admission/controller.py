"""Admit now, queue, or reject: admission for every pool, acting on one decision function.

A request brings a KV reservation (prompt + expected output, in blocks) and token work. For
each request the controller takes a snapshot of its pool (`view`), asks the pure decision
function (gateway/admission/decision.py) what to do, and does it: reserves on the chosen
backend, queues (gateway/admission/waiting.py) or raises the refusal. `/gateway/estimate`
asks the same function about the same snapshot (`preview`, answered by preview.py), and
reserves nothing.

What each backend can take is gateway/admission/capacity.py's; the once-a-second work (drain
rates, the latency guard, the shared state) is gateway/admission/ticker.py's.

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

from gateway.admission import ticker, waiting
from gateway.admission.capacity import UNKNOWN_CAPACITY_BLOCKS, Capacity
from gateway.admission.decision import (
    AskView,
    BackendView,
    Decision,
    PoolView,
    decide,
    place,
    reservation_blocks,
)
from gateway.admission.guard import LatencyGuard
from gateway.admission.pace import pace_for
from gateway.admission.pool import Ask, PoolState, Ticket
from gateway.admission.prefixes import PrefixPlacement, rule_of
from gateway.admission.preview import explain
from gateway.admission.queue import FairQueue
from gateway.admission.thresholds import thresholds_for
from gateway.errors import GatewayError, NoBackendAvailable, Overloaded, StateUnavailable
from gateway.observe.metrics import GatewayMetrics
from gateway.policy.model import Policy
from gateway.prefix import PrefixIndexes
from gateway.routing.backends import Backend, Backends
from gateway.signals.engines import EngineSample, EngineScraper
from gateway.signals.quantiles import WindowedQuantiles
from gateway.signals.streams import LiveStreams, StreamProgress
from gateway.state import Lease, Limits, MemoryState, StateBackend, StateError

__all__ = ["Admission", "Ask", "Overloaded", "Ticket"]

log = logging.getLogger("gateway.admission")

_WORD = {"admit": "admitted", "queue": "queued", "reject": "rejected"}


class Admission:
    def __init__(self, policy: Policy, backends: Backends, state: StateBackend,
                 metrics: GatewayMetrics, scraper: EngineScraper,
                 clock: Callable[[], float] = time.monotonic,
                 prefix: PrefixIndexes | None = None) -> None:
        self.policy = policy
        self.backends = backends
        self.state = state
        # `prefill_done` bound once, for the forwarder to call on each stream's first byte.
        self.on_first_byte: Callable[[Ticket], None] = self.prefill_done
        self.fallback = MemoryState(clock)
        self.metrics = metrics
        self.scraper = scraper
        self.clock = clock
        self.replicas = 1
        self.replica_id = f"{os.uname().nodename}-{os.getpid()}-{os.urandom(3).hex()}"
        self.capacity = Capacity(policy, scraper, metrics, lambda: self.replicas)
        # Every backend's prefix index; a reload hands the same registry on (gateway/runtime).
        self.prefix = PrefixPlacement(prefix or PrefixIndexes(), metrics)
        self.rules = {name: rule_of(spec) for name, spec in policy.pools.items()}
        self._ids = itertools.count(1)
        # Live leases by the store that holds them (the shared state, or the in-memory
        # fallback while it is down), refreshed by the slow tick.
        self.live: dict[str, Lease] = {}
        self.live_local: dict[str, Lease] = {}
        self.pools: dict[str, PoolState] = {}
        for name, spec in policy.pools.items():
            ps = PoolState(
                name=name, spec=spec, thresholds=thresholds_for(spec, policy),
                queue=FairQueue(spec.admission.queue_size),
                guard=LatencyGuard(ceiling=1.0, floor=1.0),
                ttft=WindowedQuantiles(spec.admission.latency_window_s, clock=clock),
                tpot=WindowedQuantiles(spec.admission.latency_window_s, clock=clock),
                live=LiveStreams(),
                # The cap is the long pool's to set: it names how much overflow it sends.
                overflow_cap=next((p.overflow_max_concurrent for p in policy.pools.values()
                                   if p.overflow_to == name), spec.overflow_max_concurrent))
            for b in spec.backends:
                ps.capacity[b.name] = self.capacity.planned_blocks(spec)
                ps.reserved[b.name] = 0
                ps.prefill[b.name] = 0
                ps.inflight_tokens[b.name] = 0
                metrics.kv_blocks_capacity.labels(name, b.name).set(ps.capacity[b.name])
                metrics.kv_blocks_reserved.labels(name, b.name).set(0)
            self.capacity.rescale_guard(ps)
            ps.pace = pace_for(spec, policy, ps.thresholds)
            ticker.plan_drain(ps, self.replicas)
            self.prefix.configure(ps)
            self.pools[name] = ps

    # --- what the engines report --------------------------------------------------------------

    def on_engine_sample(self, pool: str, backend: str, sample: EngineSample) -> None:
        ps = self.pools.get(pool)
        if ps is not None:
            self.capacity.on_engine_sample(ps, backend, sample)
            self.prefix.on_sample(ps, backend, sample)

    def max_blocks(self, ps: PoolState, backend: str) -> int:
        return self.capacity.max_blocks(ps, backend)

    # --- the snapshot the decision reads ------------------------------------------------------

    def view(self, ask: Ask, refused: dict[str, str] | None = None) -> PoolView:
        """The pool as it stands for `ask`: everything `decide` reads, and nothing else.
        `refused`: backends the store has just refused this request on, and why."""
        ps = self.pools[ask.pool]
        now = self.clock()
        cap = self.capacity
        rule = self.rules[ps.name]
        held = [self.prefix.at(ps, ask, b.name) if rule else (0, 0)
                for b in self.backends.pools[ps.name]]
        # The session's backend, where nothing of the prompt is cached anywhere (or always,
        # in mode `session`).
        session = self.prefix.affinity(ps, ask) if rule and (
            ps.spec.routing.prefix.mode == "session" or not any(c for c, _ in held)) else None
        backends = tuple(
            BackendView(name=b.name, available=b.available(now) and (
                            ask.backend is None or ask.backend == b.name),
                        limit_blocks=cap.max_blocks(ps, b.name),
                        reserved_blocks=ps.reserved.get(b.name, 0), outstanding=b.outstanding,
                        ruled_out=(refused or {}).get(b.name)
                        or cap.ruled_out(ps, b.name, ask.prompt_tokens - cached),
                        over_static_rule=cap.over_static_rule(ps, b.name),
                        slot_blocks=ps.slot_blocks.get(b.name),
                        cached_tokens=cached, shared_blocks=shared,
                        inflight_tokens=ps.inflight_tokens.get(b.name, 0),
                        prefill_tokens=ps.prefill.get(b.name, 0), affinity=b.name == session)
            for b, (cached, shared) in zip(self.backends.pools[ps.name], held, strict=True))
        predicted, deadline = waiting.outlook(ps, ask)
        return PoolView(
            name=ps.name, mode=ps.mode, backends=backends,
            reserved_tokens=ps.reserved_tokens, token_limit=self._token_limit(ps),
            tenant_held=ps.tenant_blocks.get(ask.tenant, 0),
            tenant_max=self._tenant_max(ps, ask), overflow_inflight=ps.overflow_inflight,
            overflow_cap=ps.overflow_cap if ask.overflow else None,
            queue_size=ps.spec.admission.queue_size,
            queue_admits=ps.queue.admits(ask.priority), predicted_wait_s=predicted,
            deadline_s=deadline, ttft_budget_s=ps.thresholds.ttft_p99_max_s.value,
            prefix=rule)

    def _token_limit(self, ps: PoolState) -> int | None:
        """The in-flight token limit, where one binds: the static one (as the guard scales
        it), or the guard's own once it has cut below its ceiling."""
        if ps.guard.limit < ps.guard.ceiling or self.capacity.static_tokens(ps) is not None:
            return int(ps.guard.limit)
        return None

    def _tenant_max(self, ps: PoolState, ask: Ask) -> int | None:
        if ask.tenant_share is None or ask.tenant_shadow:
            return None
        return max(1, int(self.capacity.kv_budget(ps) * ask.tenant_share))

    # --- preview and admit --------------------------------------------------------------------

    def preview(self, ask: Ask) -> dict[str, object]:
        """What `admit` would decide now, and the numbers it would decide on; reserves nothing."""
        ps = self.pools[ask.pool]
        view = self.view(ask)
        return explain(ps, view, decide(view, _ask_view(ask)), ask,
                       self.backends.pools[ps.name], self.scraper, self.capacity, self.clock())

    async def admit(self, ask: Ask) -> Ticket:
        """Admit `ask` now (a ticket), queue it until it fits (a ticket, later), or raise the
        refusal; whichever `decide` says."""
        ps = self.pools[ask.pool]
        refused: dict[str, str] = {}
        view = self.view(ask)
        d = decide(view, _ask_view(ask))
        if view.prefix is not None and not view.prefix.act and d.backend is not None:
            self.prefix.shadow(view, ask, d.backend)
        while d.action == "admit":
            ticket, reason = await self._act(ps, ask, d, view)
            if ticket is not None:
                return ticket
            # The store refused what this replica's view allowed (another replica took the
            # room first, or the fallback store's share is spent): its answer is in the view
            # now, and that backend is out for this request; decide again.
            assert d.backend is not None and reason is not None
            refused[d.backend] = reason
            view = self.view(ask, refused)
            d = decide(view, _ask_view(ask))
        if d.action == "queue":
            return await self._wait(ps, ask, d.reason)
        if d.reason != "no_backend":
            self._count(ps.name, "rejected", d.reason)
        raise self._refusal(ps, ask, d)

    async def _act(self, ps: PoolState, ask: Ask, d: Decision, view: PoolView
                   ) -> tuple[Ticket | None, str | None]:
        assert d.backend is not None
        backend = self._backend(ps, d.backend)
        if d.reason == "admission_disabled":
            return Ticket(ps.name, backend, None, None, "admitted", d.reason), None
        if d.reason == "static_rule":
            self._count(ps.name, "admitted", d.reason)
            return Ticket(ps.name, backend, None, None, "admitted", d.reason), None
        if d.enforced is not None:  # shadow: count what enforcing would do, then admit
            e = d.enforced
            self.metrics.shadow_decisions.labels(ps.name, _WORD[e.action], e.reason).inc()
            ticket, _ = await self._reserve(ps, ask, backend, view, force=d.reason == "shadow")
            if ticket is None:  # lost the room to another replica: admitted all the same
                ticket, _ = await self._reserve(ps, ask, backend, force=True)
            assert ticket is not None
            if d.reason == "shadow":
                ticket.reason = "shadow"
            return ticket, None
        ticket, refused = await self._reserve(ps, ask, backend, view)
        if ticket is not None:
            self._count(ps.name, "admitted", d.reason)
        return ticket, refused

    async def _place(self, ps: PoolState, ask: Ask) -> Ticket | None:
        """For the drain: the queue's head onto a backend if it fits now, else None."""
        refused: dict[str, str] = {}
        while True:
            view = self.view(ask, refused)
            if not refused and not any(b.available for b in view.backends):
                raise _no_backend(ps.name)
            placed = place(view, _ask_view(ask))
            if placed.backend is None:
                return None
            ticket, reason = await self._reserve(ps, ask, self._backend(ps, placed.backend),
                                                 view)
            if ticket is not None:
                return ticket
            refused[placed.backend] = reason or "kv_blocks"

    def _backend(self, ps: PoolState, name: str) -> Backend:
        return next(b for b in self.backends.pools[ps.name] if b.name == name)

    async def _reserve(self, ps: PoolState, ask: Ask, backend: Backend,
                       view: PoolView | None = None, force: bool = False
                       ) -> tuple[Ticket | None, str | None]:
        """Reserve in the store with the limits `view` decided on (taken now if None; the
        caller's, when nothing was awaited since it was taken); (ticket, refusal)."""
        if view is None:
            view = self.view(ask)
        on = _backend_view(view, backend.name)
        rule = view.prefix
        cached = on.cached_tokens
        # The blocks of its prompt that requests in flight there hold are shared, not new.
        lease = Lease(ps.name, backend.name, f"{self.replica_id}-{next(self._ids)}",
                      reservation_blocks(ask.blocks, on.limit_blocks, on.slot_blocks,
                                         on.shared_blocks),
                      ask.tokens, ask.tenant)
        limits = Limits(UNKNOWN_CAPACITY_BLOCKS, None, None) if force else \
            Limits(on.limit_blocks, view.token_limit, view.tenant_max)
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
            limits = Limits(limits.max_blocks // share,
                            None if limits.max_tokens is None else limits.max_tokens // share)
            result = await store.reserve(lease, limits, ps.spec.admission.lease_ttl_s)
        if store is self.state:
            ps.reserved[backend.name] = result.backend_blocks
            ps.reserved_tokens = result.pool_tokens
            self.metrics.child(self.metrics.kv_blocks_reserved, ps.name, backend.name).set(
                result.backend_blocks)
        if not result.ok:
            return None, result.reason
        if ask.tenant_shadow and ask.tenant_share is not None:
            self._shadow_tenant_share(ps, ask, lease)
        self.live_in(store)[lease.lease_id] = lease
        if ask.overflow:
            ps.overflow_inflight += 1
        ps.tenant_blocks[lease.tenant] = ps.tenant_blocks.get(lease.tenant, 0) + lease.blocks
        # What the engine will find cached it does not prefill: off the backend's backlog.
        prefill = ask.prompt_tokens - cached
        self.capacity.prefill_add(ps, backend.name, prefill)
        ps.inflight_tokens[backend.name] = ps.inflight_tokens.get(backend.name, 0) + ask.tokens
        ticket = Ticket(ps.name, backend, lease, store, "admitted",
                        "fallback" if store is self.fallback else "fits",
                        overflow=ask.overflow, prefill=prefill, cached_tokens=cached,
                        tokens=ask.tokens)
        if rule is not None:
            by = "prefix" if cached else \
                "affinity" if self.prefix.affinity(ps, ask) == backend.name else "headroom"
            self.prefix.admitted(ps, ask, ticket, by)
        return ticket, None

    def _shadow_tenant_share(self, ps: PoolState, ask: Ask, lease: Lease) -> None:
        """A tenant rule in shadow mode: count when its share would have been exceeded."""
        assert ask.tenant_share is not None
        held = ps.tenant_blocks.get(ask.tenant, 0)
        if held and held + lease.blocks > self.capacity.kv_budget(ps) * ask.tenant_share:
            self.metrics.shadow_decisions.labels(ps.name, "rejected", "tenant_share").inc()

    async def _wait(self, ps: PoolState, ask: Ask, cause: str) -> Ticket:
        start = self.clock()
        ticket = await waiting.wait(
            ps, ask, cause, start, lambda decision, reason: self._count(ps.name, decision,
                                                                         reason),
            lambda: self._publish_queue(ps), lambda t: self.release(t, completed=False))
        ticket.queue_s = self.clock() - start
        self.metrics.queue_wait.labels(ps.name).observe(ticket.queue_s)
        return ticket

    def _refusal(self, ps: PoolState, ask: Ask, d: Decision) -> GatewayError:
        if d.reason == "no_backend":
            return _no_backend(ps.name)
        if d.reason == "overflow_cap":
            return Overloaded(f"The long-context pool is unavailable and pool `{ps.name}` "
                              f"already runs {ps.overflow_cap} overflowed long request(s).",
                              retry_after_s=5, reason="overflow_cap")
        if d.reason == "static_rule":
            waiting_max, kv_max = self.capacity.static_lines(ps)
            return Overloaded(f"Pool `{ps.name}` is at capacity: every engine reports more "
                              f"than {waiting_max:g} waiting or KV usage over {kv_max:g}.",
                              retry_after_s=1, reason="static_rule")
        if d.reason == "ttft_spent":
            return Overloaded(f"The request spent {ask.waited_s:.1f}s in the gateway before "
                              f"pool `{ps.name}` could take it, its whole TTFT target "
                              f"({ps.thresholds.ttft_p99_max_s.value:g}s): the gateway is "
                              "working through a burst.", reason="ttft_spent",
                              retry_after_s=max(1, math.ceil(ask.waited_s)))
        predicted, deadline = waiting.outlook(ps, ask)
        cause = d.cause or d.reason
        return waiting.overloaded(ps, cause, predicted, deadline,
                                  None if d.reason == cause else d.reason)

    # --- while it runs, and after -------------------------------------------------------------

    def prefill_done(self, ticket: Ticket) -> None:
        """The first byte came back (or the request ended): its prompt is prefilled."""
        if ticket.prefill:
            self.capacity.prefill_remove(self.pools[ticket.pool], ticket.backend.name,
                                         ticket.prefill)
            ticket.prefill = 0

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
        if ticket.tokens:
            b = ticket.backend.name
            ps.inflight_tokens[b] = max(0, ps.inflight_tokens.get(b, 0) - ticket.tokens)
            ticket.tokens = 0
        self.prefix.released(ticket)
        if ticket.watched is not None:
            ps.live.discard(ticket.watched)
            ticket.watched = None
        if ticket.overflow:
            ps.overflow_inflight -= 1
        if ticket.lease is None or ticket.store is None:
            return
        self.live_in(ticket.store).pop(ticket.lease.lease_id, None)
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
            self.metrics.child(self.metrics.kv_blocks_reserved, ps.name, b).set(ps.reserved[b])
        if completed:
            ps.drained_tokens += ticket.lease.tokens
            ps.drained_requests += 1
        await self.drain(ps)

    async def drain(self, ps: PoolState) -> None:
        await waiting.drain(ps, self._place, self.release)

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
        """Drain queues every tick; once a second, the ticker's work (gateway/admission/ticker)."""
        loop = asyncio.get_running_loop()
        last_slow = loop.time()
        while True:
            await asyncio.sleep(ticker.TICK_S)
            for ps in self.pools.values():
                await self.drain(ps)
            now = loop.time()
            if now - last_slow >= ticker.SLOW_TICK_S:
                await self._slow_tick(now - last_slow)
                last_slow = now

    async def _slow_tick(self, elapsed: float) -> None:
        now = self.clock()
        for ps in self.pools.values():
            ticker.update_drain_rate(ps, elapsed, self.replicas)
            ticker.judge_latency(ps, now, self.metrics)
            await ticker.sync_usage(ps, self.state, self.metrics)
        ttl = min(p.spec.admission.lease_ttl_s for p in self.pools.values())
        replicas = await ticker.refresh(list(self.live.values()), list(self.live_local.values()),
                                        self.state, self.fallback, ttl, self.replica_id,
                                        self.metrics)
        if replicas is not None:
            self.replicas = replicas

    def live_in(self, store: StateBackend) -> dict[str, Lease]:
        """The live leases `store` holds."""
        return self.live if store is self.state else self.live_local

    def leases_live(self) -> int:
        return len(self.live) + len(self.live_local)

    # --- metrics ------------------------------------------------------------------------------

    def _count(self, pool: str, decision: str, reason: str) -> None:
        self.metrics.child(self.metrics.admission_decisions, pool, decision, reason).inc()

    def _publish_queue(self, ps: PoolState) -> None:
        for name, n in ps.queue.depth_by_priority().items():
            self.metrics.child(self.metrics.queue_depth, ps.name, name).set(n)


def _backend_view(view: PoolView, name: str) -> BackendView:
    for b in view.backends:
        if b.name == name:
            return b
    raise KeyError(name)


def _ask_view(ask: Ask) -> AskView:
    return AskView(ask.blocks, ask.tokens, ask.overflow, ask.waited_s, ask.prompt_tokens)


def _no_backend(pool: str) -> NoBackendAvailable:
    return NoBackendAvailable(f"No healthy backend in pool `{pool}`.", retry_after_s=1)

