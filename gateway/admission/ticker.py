"""What admission does once a second: drain rates, the latency guard, the shared state.

- Each pool's drain rate (tokens/s released while it was full, an EWMA) is what queue waits
  are predicted from once it is measured (`PoolState.drain_measured`); until then its planned
  rate is (gateway/admission/pace.py), planned again each second from its limit then.
- The latency guard judges the window's P99 TTFT and TPOT, with the streams still in flight
  counted as they stand (an engine in collapse completes nothing, and its streams say so at
  once), and cuts or restores the in-flight token limit.
- Reserved blocks and tokens are re-read from the state backend (other replicas reserve too),
  live leases are refreshed in one round trip, and the replica's heartbeat says how many
  replicas share the budget when the store is down.
"""

from __future__ import annotations

import asyncio

from gateway.admission.capacity import UNKNOWN_CAPACITY_BLOCKS
from gateway.admission.guard import Verdict, combine, verdict
from gateway.admission.pace import planned_drain
from gateway.admission.pool import PoolState
from gateway.observe.metrics import GatewayMetrics
from gateway.signals.streams import TPOT_MARGIN, count_over
from gateway.state import Lease, StateBackend, StateError

TICK_S = 0.05  # how often queues are drained without a release to prompt it
SLOW_TICK_S = 1.0
HEARTBEAT_TTL_S = 5.0


def update_drain_rate(ps: PoolState, elapsed: float, replicas: int = 1) -> None:
    """Measure the last `elapsed` seconds' drain where the pool was full for them, and plan
    it again (the guard and the engines' reports move the limit it is planned from).

    Only a full pool's releases say how fast it drains a queue: an idle one releases what it
    is sent, and an EWMA fed its idle seconds decays toward zero (one warm-up request, then a
    quiet minute and a half, predicted the first burst a wait of 2.3e14 s). Kept, not decayed,
    while the pool is not full: its engines are as fast as when it was."""
    full = ps.pressed or bool(ps.queue)
    ps.pressed = False
    drained, ps.drained_tokens = ps.drained_tokens, 0.0
    released, ps.drained_requests = ps.drained_requests, 0
    plan_drain(ps, replicas)
    if not full:
        return
    rate = drained / elapsed
    ps.drain_rate = rate if ps.drain_rate == 0 else 0.7 * ps.drain_rate + 0.3 * rate
    ps.drain_busy_s += elapsed
    ps.drain_releases += released


def plan_drain(ps: PoolState, replicas: int) -> None:
    """The pool's drain by plan (gateway/admission/pace.py), at its latency guard's limit now;
    none while its capacity is the unknown-capacity stand-in (no architecture, no engine
    report, no cap), which no plan can rest on."""
    unknown = ps.guard.ceiling >= UNKNOWN_CAPACITY_BLOCKS
    ps.planned_drain_rate = 0.0 if unknown else \
        planned_drain(ps.pace, ps.guard.limit, len(ps.capacity), replicas)


def judge_latency(ps: PoolState, now: float, metrics: GatewayMetrics) -> None:
    th = ps.thresholds
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
    metrics.latency_guard_limit.labels(ps.name).set(ps.guard.limit)


async def sync_usage(ps: PoolState, state: StateBackend, metrics: GatewayMetrics) -> None:
    """What every replica has reserved on the pool, as the store has it now."""
    try:
        usage = await state.usage(ps.name)
    except StateError:
        metrics.state_errors.labels("usage").inc()
        return
    for backend in ps.capacity:
        ps.reserved[backend] = usage.blocks.get(backend, 0)
        metrics.kv_blocks_reserved.labels(ps.name, backend).set(ps.reserved[backend])
    ps.reserved_tokens = usage.tokens


async def refresh(shared: list[Lease], local: list[Lease], state: StateBackend,
                  fallback: StateBackend, ttl_s: float, replica_id: str,
                  metrics: GatewayMetrics) -> int | None:
    """Refresh the live leases in their stores (`shared` in `state`, `local` in `fallback`);
    the replicas alive, or None when unknown."""
    replicas = None
    try:
        if shared:
            await state.refresh(shared, ttl_s)
        replicas = await state.heartbeat(replica_id, ttl_s=HEARTBEAT_TTL_S)
    except StateError:
        metrics.state_errors.labels("refresh").inc()
    await fallback.refresh(local, ttl_s)
    return replicas
