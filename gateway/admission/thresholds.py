"""The thresholds in force for a pool, and where each came from.

An SRE's value in the policy wins over a learned one (written by `loadtest calibrate`); with
neither, the planner's (derived from the pool's roofline and `defaults.slo`,
gateway/planner/limits.py) applies, and without an SLO or an architecture, the default.
`/admin/state` and `/gateway/estimate` show the source, so "why was this rejected?" has an
answer that names the number and its origin.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from gateway.cost.profiles import roofline_gpu
from gateway.planner.limits import PlannerLimits, Slo, planner_limits, slo_limits
from gateway.policy.model import Policy, PoolSpec

Source = Literal["policy", "learned", "planner", "default"]

DEFAULT_KV_USAGE_MAX = 0.9
DEFAULT_QUEUE_WAIT_MAX_S = 10.0


@dataclass(frozen=True, slots=True)
class Threshold:
    value: float | None
    source: Source


@dataclass(frozen=True, slots=True)
class Thresholds:
    kv_usage_max: Threshold
    inflight_tokens_max: Threshold
    waiting_max: Threshold
    prefill_tokens_max: Threshold
    ttft_p99_max_s: Threshold
    tpot_p99_max_s: Threshold
    queue_wait_max_s: Threshold

    def as_dict(self) -> dict[str, dict[str, float | str | None]]:
        out: dict[str, dict[str, float | str | None]] = {}
        for f in fields(self):
            t: Threshold = getattr(self, f.name)
            out[f.name] = {"value": t.value, "source": t.source}
        return out


def _pick(mine: float | None, learned: float | None, planned: float | None,
          default: float | None) -> Threshold:
    if mine is not None:
        return Threshold(mine, "policy")
    if learned is not None:
        return Threshold(learned, "learned")
    if planned is not None:
        return Threshold(planned, "planner")
    return Threshold(default, "default")


def pool_planner_limits(pool: PoolSpec, policy: Policy | None) -> PlannerLimits | None:
    """The planner's limits for `pool` (its first model's architecture, GPU, TP, replicas and
    the policy's SLO); None without an SLO or an architecture. A pool on CPUs (`gpu: cpu`)
    has no roofline: only the SLO's own lines (latency guard, queue deadline)."""
    if policy is None or policy.defaults.slo is None:
        return None
    model = policy.model(pool.models[0])
    if model is None or model.architecture is None:
        return None
    slo = policy.defaults.slo
    gpu = roofline_gpu(pool.gpu)
    if gpu is None:
        return slo_limits(Slo(slo.ttft_p95_s, slo.tpot_p95_s))
    return planner_limits(
        model.architecture.resolve(), gpu, pool.tp, model.dtype,
        model.kv_cache_dtype, len(pool.backends), Slo(slo.ttft_p95_s, slo.tpot_p95_s),
        expected_output=min(policy.defaults.expected_output_tokens,
                            pool.max_tokens_default or policy.defaults.max_tokens),
        max_model_len=pool.max_model_len, block_size=pool.block_size, kv_blocks=pool.kv_blocks)


def thresholds_for(pool: PoolSpec, policy: Policy | None = None) -> Thresholds:
    """The pool's thresholds: the policy's, else learned, else the planner's (with `policy`,
    for its models and SLO), else the default."""
    a = pool.admission
    learned = a.learned
    plan = pool_planner_limits(pool, policy)

    def planned(name: str) -> float | None:
        value: float | None = None if plan is None else getattr(plan, name)
        return value

    return Thresholds(
        kv_usage_max=_pick(a.kv_usage_max, learned.kv_usage_max if learned else None, None,
                           DEFAULT_KV_USAGE_MAX),
        inflight_tokens_max=_pick(a.inflight_tokens_max,
                                  learned.inflight_tokens_max if learned else None,
                                  planned("inflight_tokens_max"), None),
        waiting_max=_pick(a.waiting_max, learned.waiting_max if learned else None, None, None),
        prefill_tokens_max=_pick(a.prefill_tokens_max,
                                 learned.prefill_tokens_max if learned else None,
                                 planned("prefill_tokens_max"), None),
        ttft_p99_max_s=_pick(a.ttft_p99_max_s, learned.ttft_p99_max_s if learned else None,
                             planned("ttft_p99_max_s"), None),
        tpot_p99_max_s=_pick(a.tpot_p99_max_s, learned.tpot_p99_max_s if learned else None,
                             planned("tpot_p99_max_s"), None),
        # Not learned: a queue deadline follows the TTFT target, not the engines' knee.
        queue_wait_max_s=_pick(a.queue_wait_max_s if "queue_wait_max_s" in a.model_fields_set
                               else None, None, planned("queue_wait_max_s"),
                               DEFAULT_QUEUE_WAIT_MAX_S),
    )
