"""A pool's first admission limits, from its roofline and the SLO, before any calibration.

`loadtest calibrate` learns a pool's limits from a sweep of its engines; until someone runs
it, the gateway would otherwise guard only the KV cache, and a burst of long prompts would
wait minutes for its first tokens. The planner already knows each layout's roofline
(`gateway/planner/throughput.py`: prefill tokens per second, decode step time, KV capacity from
model, GPU and TP), so it derives, for the policy's SLO (`defaults.slo`):

- `prefill_tokens_max` (per engine): the prompt tokens its roofline prefills in
  `BACKLOG_SHARE` of the TTFT target, at `BACKLOG_PROMPT` tokens a prompt (attention grows
  with the prompt, so long prompts are the slow ones), with the TP all-reduce the roofline
  leaves out added (`prefill_seconds`: a third again as much as the compute at TP=8 on H100s).
  A request admitted behind a full backlog waits at most that long for its prefill to start.
- `queue_wait_max_s`: the rest of the TTFT target, `QUEUE_SHARE` of it: a request that cannot
  reach an engine within it would miss its TTFT anyway, so it gets its 503 and Retry-After then.
  The two shares leave room for what the roofline does not see (decode steps between prefill
  chunks, kernels short of their peak).
- `inflight_tokens_max` (the pool): the tokens in flight (prompt + expected output of every
  request, what admission reserves) at which the roofline's time per output token reaches the
  TPOT target, counting the decode steps that prefill takes from each replica (the roofline at
  a stated concurrency: `throughput(..., concurrency=B)`, its prefill with the all-reduce), at
  `INFLIGHT_PROMPT` tokens a prompt and the policy's expected output, times the replicas.
- the latency guard's lines: the SLO's targets themselves (what calibrate writes when the knee
  meets them).

Values an SRE writes in the pool's `admission`, and values calibrate learned, win over these
(gateway/admission/thresholds.py).

A pool on CPUs (`gpu: cpu`, vLLM's CPU build) has no roofline (`slo_limits`): no
`prefill_tokens_max` or `inflight_tokens_max` from the planner, only the SLO's own lines (the
latency guard's targets and the queue's deadline); `loadtest calibrate` learns the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.cost.pricing import PREFILL_EFFICIENCY
from gateway.cost.profiles import GpuProfile, ModelProfile, ProfileError, ledger
from gateway.planner.throughput import Lengths, throughput

# The roofline leaves out the TP all-reduce (docs/planner.md, Limits), which a decode step barely
# notices but a prefill does: two per layer of every prompt token's hidden state, over NVLink
# (a ring moves 2 (TP-1)/TP of it), at this share of the link's bandwidth.
NVLINK_EFFICIENCY = 0.7
ACTIVATION_BYTES = 2
BACKLOG_SHARE = 0.5  # of the TTFT target: the longest a full prefill backlog takes to clear
QUEUE_SHARE = 0.25 # of the TTFT target: the queue's deadline
BACKLOG_PROMPT = 8192  # prompt length the prefill rate is taken at (vLLM's chunk on H100s)
INFLIGHT_PROMPT = 2048  # prompt length the in-flight ceiling is computed at (`gateway plan`'s P50)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class PlannerLimits:
    """What the planner derives for one pool, and the figures it derived them from."""

    prefill_tokens_max: int | None  # per engine; None: no roofline (an engine on a CPU)
    inflight_tokens_max: int | None  # the whole pool; None: no roofline
    queue_wait_max_s: float
    ttft_p99_max_s: float
    tpot_p99_max_s: float
    prefill_tokens_s: float  # one replica's roofline, at BACKLOG_PROMPT tokens a prompt
    batch_per_replica: int  # requests a replica decodes at the TPOT target
    kv_tokens_per_replica: int

    @property
    def roofline(self) -> bool:
        """Whether the roofline's limits are in it (not on a CPU)."""
        return self.prefill_tokens_max is not None

    def explain(self) -> dict[str, str]:
        """One line per limit saying where its number comes from (for `gateway check`)."""
        return {
            "prefill_tokens_max": f"roofline prefill {self.prefill_tokens_s:,.0f} tokens/s per "
                                  f"engine x {BACKLOG_SHARE:g} of the TTFT target",
            "inflight_tokens_max": f"{self.batch_per_replica} requests of {INFLIGHT_PROMPT:,} + "
                                   "expected output tokens per engine at the TPOT target",
            "queue_wait_max_s": f"{QUEUE_SHARE:g} of the TTFT target",
            "ttft_p99_max_s": "the SLO's TTFT target",
            "tpot_p99_max_s": "the SLO's TPOT target",
        }


def slo_limits(slo: Slo) -> PlannerLimits:
    """What the planner derives without a roofline (engines on CPUs): the SLO's lines only."""
    return PlannerLimits(
        prefill_tokens_max=None, inflight_tokens_max=None,
        queue_wait_max_s=round(slo.ttft_s * QUEUE_SHARE, 3),
        ttft_p99_max_s=slo.ttft_s, tpot_p99_max_s=slo.tpot_s,
        prefill_tokens_s=0.0, batch_per_replica=0, kv_tokens_per_replica=0)


def prefill_seconds(model: ModelProfile, gpu: GpuProfile, tp: int, dtype: str,
                    tokens: int) -> float:
    """One replica's prefill of a `tokens`-token prompt: the roofline's compute (FLOPs over
    peak x TP x PREFILL_EFFICIENCY) and the TP all-reduce the roofline leaves out."""
    compute = model.prefill_flops(tokens) / (gpu.peak_flops(dtype) * tp * PREFILL_EFFICIENCY)
    if tp == 1:
        return compute
    link = gpu.interconnect_gb_s * 1e9 * NVLINK_EFFICIENCY
    allreduce = 2 * model.num_layers * 2 * (tp - 1) / tp * tokens * model.hidden_size \
        * ACTIVATION_BYTES / link
    return compute + allreduce


def planner_limits(model: ModelProfile, gpu: GpuProfile, tp: int, dtype: str, kv_dtype: str,
                   replicas: int, slo: Slo, *, expected_output: int, max_model_len: int,
                   block_size: int = 16, kv_blocks: int | None = None) -> PlannerLimits | None:
    """The pool's limits for `slo`; None when the layout cannot run the model at all."""
    try:
        kv_tokens = (kv_blocks if kv_blocks is not None else
                     ledger(model, gpu, tp, dtype, kv_dtype, block_size=block_size)
                     .num_gpu_blocks) * block_size
    except ProfileError:
        return None
    if kv_tokens <= 0:
        return None
    prompt = max(1, min(BACKLOG_PROMPT, max_model_len))
    rate = prompt / prefill_seconds(model, gpu, tp, dtype, prompt)
    output = max(1, min(expected_output, max_model_len // 2))
    short = max(1, min(INFLIGHT_PROMPT, max_model_len - output))
    # The roofline's prefill time with the all-reduce in it, as the FLOPs that take that long.
    flops = prefill_seconds(model, gpu, tp, dtype, short) * gpu.peak_flops(dtype) * tp \
        * PREFILL_EFFICIENCY
    lens = Lengths(float(short), float(output), flops, "planner")
    per_request = lens.mean_prompt + lens.mean_output
    most = max(1, int(kv_tokens // per_request))  # what one replica's KV cache holds

    def meets(batch: int) -> bool:
        t = throughput(model, gpu, tp, 1, dtype, kv_dtype, lens, None, batch)
        return t is not None and t.tpot_s is not None and t.tpot_s <= slo.tpot_s

    lo, hi = 1, most  # the largest batch meeting the TPOT target (TPOT grows with the batch)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if meets(mid):
            lo = mid
        else:
            hi = mid - 1
    return PlannerLimits(
        prefill_tokens_max=max(1, int(rate * slo.ttft_s * BACKLOG_SHARE)),
        inflight_tokens_max=max(1, int(lo * per_request * replicas)),
        queue_wait_max_s=round(slo.ttft_s * QUEUE_SHARE, 3),
        ttft_p99_max_s=slo.ttft_s, tpot_p99_max_s=slo.tpot_s,
        prefill_tokens_s=rate, batch_per_replica=lo, kv_tokens_per_replica=kv_tokens)
