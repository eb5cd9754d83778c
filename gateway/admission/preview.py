"""`/gateway/estimate`'s answer: what admission would decide for a request now, and every
number it would decide on, from the same snapshot (`PoolView`) and decision `admit` uses
(gateway/admission/controller.py). Nothing is reserved."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.admission.capacity import Capacity
from gateway.admission.decision import Decision, PoolView, blocks_on
from gateway.admission.pool import Ask, PoolState
from gateway.routing.backends import Backend
from gateway.routing.router import prefix_costs
from gateway.signals.engines import EngineScraper


def explain(ps: PoolState, view: PoolView, d: Decision, ask: Ask, backends: Sequence[Backend],
            scraper: EngineScraper, capacity: Capacity, now: float) -> dict[str, object]:
    """The decision `d` on `view` of `ps` for `ask`, with the pool's and each backend's
    figures (`backends`: the pool's, in the view's order), as JSON-ready data."""
    per_backend: dict[str, object] = {}
    costs = prefix_costs(view.backends, view.prefix, ask.prompt_tokens) \
        if view.prefix is not None else [None] * len(view.backends)
    for b, bv, cost in zip(backends, view.backends, costs, strict=True):
        sample = scraper.fresh(ps.name, b.name)
        per_backend[b.name] = {
            "available": bv.available, "capacity_blocks": ps.capacity[b.name],
            "limit_blocks": bv.limit_blocks, "reserved_blocks": bv.reserved_blocks,
            "prefill_pending_tokens": ps.prefill.get(b.name, 0),
            "engine": None if sample is None else sample.public(now),
            "slot_blocks": bv.slot_blocks,
            "engine_rules_out": capacity.engine_full(ps, b.name),
            "rules_out": bv.ruled_out,
            "prefix": None if view.prefix is None else {
                "cached_tokens": bv.cached_tokens, "shared_blocks": bv.shared_blocks,
                "inflight_tokens": bv.inflight_tokens, "session": bv.affinity,
                "cost_tokens": None if cost is None else round(cost)}}
    out: dict[str, object] = {
        "decision": d.action, "reason": d.reason, "backend": d.backend, "mode": view.mode,
        "predicted_wait_s": None if (d.enforced or d).action == "admit"
        else view.predicted_wait_s,
        "deadline_s": view.deadline_s,
        "pool": {"reserved_tokens": ps.reserved_tokens,
                 "guard_limit_tokens": ps.guard.limit, "token_limit": view.token_limit,
                 "guard_state": ps.guard.state, "queue_depth": len(ps.queue),
                 "drain_rate_tokens_s": ps.drain_rate,
                 # Waits are predicted from the drain measured while the pool was full once it
                 # is measured (pool.py), from the planned one until then.
                 "drain_measured": ps.drain_measured,
                 "planned_drain_rate_tokens_s": ps.planned_drain_rate,
                 "ttft_p99_s": ps.ttft.quantile(0.99), "tpot_p99_s": ps.tpot.quantile(0.99)},
        "tenant": {"held_blocks": view.tenant_held, "max_blocks": view.tenant_max},
        "thresholds": ps.thresholds.as_dict(),
        "backends": per_backend,
    }
    if d.enforced is not None:
        out["shadow"] = {"decision": d.enforced.action, "reason": d.enforced.reason}
    # At the backend chosen: what x-gateway-cached-tokens would say, and what is reserved.
    chosen = next((bv for bv in view.backends if bv.name == d.backend), None)
    out["cached_tokens"] = chosen.cached_tokens if chosen is not None else 0
    out["reserve_blocks"] = blocks_on(chosen, ask.blocks) if chosen is not None else None
    return out
