"""How fast a full pool drains its queue by plan, before it has been seen full.

Queue waits are predicted from the drain a pool is measured to have while full (ticker.py).
Until it has been, they are predicted from this plan, by Little's law: the tokens the pool may
hold in flight (its latency guard's limit: the in-flight cap from the policy, calibration or
the planner, else its KV budget) are released once in the time a request holds them. That
time is the planner's roofline of the pool's model, GPU and TP (gateway/planner/throughput.py)
for a request of the planner's lengths (`INFLIGHT_PROMPT` tokens of prompt, the policy's
expected output) at the batch the limit holds on each engine: its prefill, then its output at
the roofline's time per output token. For a model without an architecture, the pool's latency
lines stand in for the roofline (the TTFT line, then the output at the TPOT line: the slowest
the latency guard lets the pool run); with neither, there is no plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.thresholds import Thresholds
from gateway.cost.pricing import PREFILL_EFFICIENCY
from gateway.cost.profiles import GpuProfile, ModelProfile, roofline_gpu
from gateway.planner.limits import INFLIGHT_PROMPT, prefill_seconds
from gateway.planner.throughput import Lengths, throughput
from gateway.policy.model import Policy, PoolSpec


@dataclass(frozen=True, slots=True)
class Roofline:
    model: ModelProfile
    gpu: GpuProfile
    tp: int
    dtype: str
    kv_dtype: str
    lengths: Lengths


@dataclass(frozen=True, slots=True)
class Pace:
    """What the plan knows of how long a request holds its reservation in one pool."""

    request_tokens: int  # the planned request's prompt and expected output
    output: int
    roofline: Roofline | None
    ttft_line_s: float | None
    tpot_line_s: float | None

    def hold_s(self, batch: int) -> float | None:
        """A request's time from admission to release with `batch` requests on its engine."""
        if self.roofline is not None:
            r = self.roofline
            t = throughput(r.model, r.gpu, r.tp, 1, r.dtype, r.kv_dtype, r.lengths, None,
                           max(1, batch))
            if t is not None and t.tpot_s is not None:
                return t.prefill_s + self.output * t.tpot_s
        if self.tpot_line_s is None:
            return None
        return (self.ttft_line_s or 0.0) + self.output * self.tpot_line_s


def pace_for(pool: PoolSpec, policy: Policy, thresholds: Thresholds) -> Pace | None:
    """The pool's pace, at the lengths the planner's limits are computed at (planner/limits)."""
    output = max(1, min(policy.defaults.expected_output_tokens,
                        pool.max_tokens_default or policy.defaults.max_tokens,
                        pool.max_model_len // 2))
    prompt = max(1, min(INFLIGHT_PROMPT, pool.max_model_len - output))
    roofline = None
    spec = policy.model(pool.models[0])
    gpu = roofline_gpu(pool.gpu)  # None on CPUs: the SLO's lines only
    if spec is not None and spec.architecture is not None and gpu is not None:
        model = spec.architecture.resolve()
        # The roofline's prefill with the TP all-reduce in it, as the FLOPs that take as long.
        flops = prefill_seconds(model, gpu, pool.tp, spec.dtype, prompt) \
            * gpu.peak_flops(spec.dtype) * pool.tp * PREFILL_EFFICIENCY
        roofline = Roofline(model, gpu, pool.tp, spec.dtype, spec.kv_cache_dtype,
                            Lengths(float(prompt), float(output), flops, "plan"))
    pace = Pace(prompt + output, output, roofline, thresholds.ttft_p99_max_s.value,
                thresholds.tpot_p99_max_s.value)
    return pace if pace.hold_s(1) is not None else None


def planned_drain(pace: Pace | None, limit_tokens: float, engines: int, replicas: int) -> float:
    """Tokens/s a full pool releases by plan (0: no plan): `limit_tokens` in flight over
    `engines`, released once a hold; each of `replicas` gateway replicas queues its own
    requests for the same engines, so it gets its share."""
    if pace is None or limit_tokens <= 0:
        return 0.0
    batch = int(limit_tokens / max(1, engines) // pace.request_tokens)
    hold = pace.hold_s(batch)
    if hold is None or hold <= 0:
        return 0.0
    return limit_tokens / hold / max(1, replicas)
