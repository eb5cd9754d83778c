"""The capacity planner's computation: how many requests of a given length one deployment can hold.

The design documents' ledger, computed rather than done by hand: weights per GPU, KV bytes per
token (whole model and one TP rank's share), the KV budget each GPU has left, the largest
concurrency at the P50 and P99 lengths, the KV demand of a stated concurrency (or one derived with
Little's law from an arrival rate and a mean latency), one TP=N replica beside two TP=N/2 ones,
and, with a trace, the probability that the KV demand of `concurrency` requests drawn from real
traffic exceeds the budget. With a price per GPU-hour, each layout's cost per million input and
output tokens at the planned load (and, with a trace, per million tokens that meet the SLO):
the roofline is `gateway/planner/throughput.py`, the price of its tokens
`gateway/planner/token_price.py`, by the gateway's own rule (`gateway/cost/pricing.py`). `plan()` is
pure and returns a dataclass; `gateway/planner/plan.py` (the command line) prints it as text or
JSON.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

from gateway.cost.pricing import Price
from gateway.cost.profiles import (
    GpuProfile,
    Ledger,
    ModelProfile,
    ProfileError,
    blocks_for,
    dtype_bytes,
    ledger,
)
from gateway.cost.traces import TraceRequest
from gateway.planner import throughput, token_price
from gateway.planner.throughput import Lengths, Throughput
from gateway.planner.tier import RPS_PER_CPU, TierSize, size_tier
from gateway.planner.token_price import LayoutPrice

TIER_STATES = tuple(RPS_PER_CPU)


@dataclass(frozen=True, slots=True)
class PlanInput:
    model: ModelProfile
    gpu: GpuProfile
    gpus: int
    tp: int
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9
    reserve_bytes: float | None = None  # None: the profile's estimate of vLLM's reserve
    kv_budget_bytes: float | None = None  # per GPU; None: computed by the ledger
    block_size: int = 16
    concurrency: int | None = None
    avg_tokens: int | None = None
    prompt_p50: int = 2048
    prompt_p99: int = 16384
    output_tokens: int = 0
    trace: tuple[TraceRequest, ...] = ()
    samples: int = 10_000
    seed: int = 0
    rate: float | None = None  # arrivals/s: the planned load in tokens/s
    prompt_mean: float | None = None  # None: the trace's mean, else lognormal from P50 and P99
    cost: Price | None = None
    tier_state: str = "redis+quota"  # the gateway tier's state, for its size at --rate


@dataclass(frozen=True, slots=True)
class Layout:
    """One way to cut the GPUs into replicas, and what each replica holds."""

    tp: int
    replicas: int
    weights_per_gpu_bytes: float
    reserve_per_gpu_bytes: float
    kv_budget_per_gpu_bytes: float
    kv_budget_explicit: bool
    kv_bytes_per_token_per_gpu: int
    kv_blocks_per_replica: int
    kv_tokens_per_replica: int
    weights_fit: bool  # weights per GPU within GPU memory x utilisation
    fits: bool  # a positive KV budget is left (or was stated)
    max_concurrency_p50: int  # per replica, at prompt P50 + output tokens
    max_concurrency_p99: int
    total_concurrency_p50: int  # all replicas
    total_concurrency_p99: int
    overflow_probability: float | None  # trace only: P(KV demand of the concurrency > budget)
    overflow_probability_mid_decode: float | None
    # trace only: share of requests preempted (newest first, as vLLM does) to fit the budget
    preempted_share: float | None = None
    throughput: Throughput | None = None  # the roofline at the planned load
    cost: LayoutPrice | None = None  # with a price


@dataclass(frozen=True, slots=True)
class Demand:
    """KV demand of `concurrency` requests of `tokens` tokens each, on the primary layout."""

    concurrency: int
    tokens: int
    total_bytes: int
    per_gpu_bytes: float  # one replica's share of the requests, on one of its GPUs
    fraction_of_budget: float | None  # None: no KV budget at all


@dataclass(frozen=True, slots=True)
class PlanResult:
    model: str
    gpu: str
    gpus: int
    dtype: str
    kv_dtype: str
    block_size: int
    weights_bytes: float
    kv_bytes_per_token: int
    prompt_p50: int
    prompt_p99: int
    output_tokens: int
    concurrency: int | None
    concurrency_source: str  # "stated", "little's law", "roofline" (from --rate), or "none"
    primary: Layout
    layouts: tuple[Layout, ...]
    demand_avg: Demand | None
    demand_p50: Demand | None
    demand_p99: Demand | None
    trace_requests: int
    rate: float | None = None
    lengths: Lengths | None = None  # mean lengths the throughput and cost are computed at
    cost_model: Price | None = None
    tier: TierSize | None = None  # the gateway tier for --rate (gateway/planner/tier.py)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _layout(inp: PlanInput, tp: int, explicit_budget: bool,
            per_replica: int | None = None) -> Layout:
    led: Ledger = ledger(inp.model, inp.gpu, tp, inp.dtype, inp.kv_dtype,
                         inp.gpu_memory_utilization, inp.reserve_bytes, inp.block_size)
    per_token_gpu = led.kv_bytes_per_token_per_gpu
    budget = inp.kv_budget_bytes if explicit_budget and inp.kv_budget_bytes is not None \
        else led.kv_budget_per_gpu
    # vLLM sizes the cache in blocks that every rank holds its share of; a replica's block count
    # is one GPU's budget over one rank's bytes per block.
    blocks = max(0, int(budget // (per_token_gpu * inp.block_size)))
    replicas = inp.gpus // tp
    p50 = blocks // max(1, blocks_for(inp.prompt_p50 + inp.output_tokens, inp.block_size))
    p99 = blocks // max(1, blocks_for(inp.prompt_p99 + inp.output_tokens, inp.block_size))
    overflow = mid = preempted = None
    if per_replica is None and inp.concurrency:
        per_replica = math.ceil(inp.concurrency / replicas)
    if inp.trace and per_replica:
        overflow, mid, preempted = _overflow(inp, blocks, per_replica)
    return Layout(
        tp=tp,
        replicas=replicas,
        weights_per_gpu_bytes=led.weights_per_gpu,
        reserve_per_gpu_bytes=0.0 if explicit_budget else led.reserve_per_gpu,
        kv_budget_per_gpu_bytes=budget,
        kv_budget_explicit=explicit_budget,
        kv_bytes_per_token_per_gpu=per_token_gpu,
        kv_blocks_per_replica=blocks,
        kv_tokens_per_replica=blocks * inp.block_size,
        weights_fit=led.weights_per_gpu <= inp.gpu.memory_bytes * inp.gpu_memory_utilization,
        fits=budget > 0,
        max_concurrency_p50=p50,
        max_concurrency_p99=p99,
        total_concurrency_p50=p50 * replicas,
        total_concurrency_p99=p99 * replicas,
        overflow_probability=overflow,
        overflow_probability_mid_decode=mid,
        preempted_share=preempted,
    )


def _overflow(inp: PlanInput, blocks: int, per_replica: int) -> tuple[float, float, float]:
    """Monte Carlo: how often `per_replica` requests drawn from the trace need > `blocks`.

    Two readings of "concurrent": every request at its final length (prompt + all its output, the
    most it will hold) and each at a uniformly random point of its decode (a snapshot in time).
    Also the share of requests preempted at final length: the drawn order is arrival order, and
    vLLM preempts the newest request until the rest fit.
    """
    rng = random.Random(inp.seed)
    final = [blocks_for(r.prompt_tokens + r.output_tokens, inp.block_size) for r in inp.trace]
    over_final = over_mid = preempted = 0
    indices = range(len(inp.trace))
    for _ in range(inp.samples):
        drawn = rng.choices(indices, k=per_replica)
        need = sum(final[i] for i in drawn)
        if need > blocks:
            over_final += 1
            for i in reversed(drawn):
                need -= final[i]
                preempted += 1
                if need <= blocks:
                    break
        mid = sum(
            blocks_for(inp.trace[i].prompt_tokens
                       + int(rng.random() * (inp.trace[i].output_tokens + 1)), inp.block_size)
            for i in drawn
        )
        if mid > blocks:
            over_mid += 1
    return (over_final / inp.samples, over_mid / inp.samples,
            preempted / (inp.samples * per_replica))


def _demand(inp: PlanInput, layout: Layout, concurrency: int, tokens: int) -> Demand:
    per_replica = math.ceil(concurrency / layout.replicas)
    per_gpu = per_replica * tokens * layout.kv_bytes_per_token_per_gpu
    budget = layout.kv_budget_per_gpu_bytes
    return Demand(
        concurrency=concurrency,
        tokens=tokens,
        total_bytes=concurrency * tokens * inp.model.kv_bytes_per_token(inp.kv_dtype),
        per_gpu_bytes=float(per_gpu),
        fraction_of_budget=per_gpu / budget if budget > 0 else None,
    )


def validate(inp: PlanInput) -> None:
    """Raise ProfileError naming the field and the rule."""
    inp.model.validate()
    dtype_bytes(inp.dtype)
    dtype_bytes(inp.kv_dtype)
    if inp.dtype == "fp8":
        inp.gpu.peak_flops("fp8")  # raises for GPUs without FP8 tensor cores
    for field in ("gpus", "tp", "block_size", "samples"):
        value = getattr(inp, field)
        if value <= 0:
            raise ProfileError(f"{field}: must be a positive integer, got {value}")
    if inp.gpus % inp.tp:
        raise ProfileError(f"gpus: must be a multiple of tp ({inp.tp}), got {inp.gpus}")
    if inp.model.num_attention_heads % inp.tp:
        raise ProfileError(
            f"tp: must divide num_attention_heads ({inp.model.num_attention_heads}), got {inp.tp}"
        )
    for field in ("prompt_p50", "prompt_p99", "output_tokens"):
        if getattr(inp, field) < 0:
            raise ProfileError(f"{field}: must not be negative, got {getattr(inp, field)}")
    if inp.prompt_p99 < inp.prompt_p50:
        raise ProfileError(
            f"prompt_p99: must be at least prompt_p50 ({inp.prompt_p50}), got {inp.prompt_p99}"
        )
    if inp.concurrency is not None and inp.concurrency < 0:
        raise ProfileError(f"concurrency: must not be negative, got {inp.concurrency}")
    if inp.kv_budget_bytes is not None and inp.kv_budget_bytes <= 0:
        raise ProfileError(f"kv_budget: must be positive, got {inp.kv_budget_bytes}")
    if inp.rate is not None and not (math.isfinite(inp.rate) and inp.rate >= 0):
        raise ProfileError(f"rate: must be a non-negative number of arrivals/s, got {inp.rate}")
    if inp.tier_state not in TIER_STATES:
        raise ProfileError(f"tier_state: expected one of {', '.join(TIER_STATES)}, "
                           f"got {inp.tier_state!r}")
    if inp.prompt_mean is not None and not inp.prompt_mean >= 0:
        raise ProfileError(f"prompt_mean: must not be negative, got {inp.prompt_mean}")


def _costed(inp: PlanInput, tp: int, explicit_budget: bool, lengths: Lengths) -> Layout:
    """A layout with its roofline at the planned load and, with a price, what its tokens cost."""
    replicas = inp.gpus // tp
    tput = throughput.throughput(inp.model, inp.gpu, tp, replicas, inp.dtype, inp.kv_dtype,
                               lengths, inp.rate, inp.concurrency)
    per_replica = None
    if tput is not None and inp.concurrency is None and not tput.saturated:
        per_replica = math.ceil(tput.concurrency_per_replica - 1e-9)  # from --rate alone
    lay = _layout(inp, tp, explicit_budget, per_replica)
    lay = dataclasses.replace(lay, throughput=tput)
    if inp.cost is None:
        return lay
    note = throughput.shortfall(lay.weights_fit, lay.fits, tput, lay.kv_blocks_per_replica,
                                inp.block_size, lengths)
    p_meets = None if lay.preempted_share is None else 1.0 - lay.preempted_share
    return dataclasses.replace(lay, cost=token_price.price_layout(inp.cost, inp.gpus, tput,
                                                                  not note, note, p_meets))


def plan(inp: PlanInput, concurrency_source: str = "stated") -> PlanResult:
    validate(inp)
    lengths = throughput.lengths(inp.model, inp.prompt_p50, inp.prompt_p99, inp.output_tokens,
                                 inp.prompt_mean, inp.trace)
    primary = _costed(inp, inp.tp, inp.kv_budget_bytes is not None, lengths)
    # The documents' comparison: all GPUs as one replica beside two replicas of half the TP.
    tps = [inp.gpus]
    if inp.gpus % 2 == 0 and inp.model.num_attention_heads % (inp.gpus // 2) == 0:
        tps.append(inp.gpus // 2)
    if inp.tp not in tps:
        tps.append(inp.tp)
    layouts = tuple(_costed(inp, tp, False, lengths) for tp in tps
                    if inp.model.num_attention_heads % tp == 0)
    c = inp.concurrency
    t = primary.throughput
    if c is None and t is not None and not t.saturated:
        c, concurrency_source = math.ceil(t.concurrency_per_replica * primary.replicas - 1e-9), \
            "roofline"
    tier = None
    if inp.rate is not None:
        # Streams open at once: the requests holding KV (stated, Little's law or the
        # roofline's); a saturated layout has no steady state, so its KV-bound most is used.
        streams = c if c is not None else primary.total_concurrency_p50
        tier = size_tier(inp.rate, lengths.mean_output, float(streams), inp.tier_state,
                         primary.replicas)
    return PlanResult(
        model=inp.model.name,
        gpu=inp.gpu.name,
        gpus=inp.gpus,
        dtype=inp.dtype,
        kv_dtype=inp.kv_dtype,
        block_size=inp.block_size,
        weights_bytes=inp.model.weight_bytes(inp.dtype),
        kv_bytes_per_token=inp.model.kv_bytes_per_token(inp.kv_dtype),
        prompt_p50=inp.prompt_p50,
        prompt_p99=inp.prompt_p99,
        output_tokens=inp.output_tokens,
        concurrency=c,
        concurrency_source=concurrency_source if c is not None else "none",
        primary=primary,
        layouts=layouts,
        demand_avg=_demand(inp, primary, c, inp.avg_tokens) if c and inp.avg_tokens else None,
        demand_p50=_demand(inp, primary, c, inp.prompt_p50 + inp.output_tokens) if c else None,
        demand_p99=_demand(inp, primary, c, inp.prompt_p99 + inp.output_tokens) if c else None,
        trace_requests=len(inp.trace),
        rate=inp.rate,
        lengths=lengths,
        cost_model=inp.cost,
        tier=tier,
    )
