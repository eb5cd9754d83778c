"""`gateway plan`: how many requests of a given length one deployment can hold in KV cache.

The design documents' ledger, computed rather than done by hand: weights per GPU, KV bytes per
token (whole model and one TP rank's share), the KV budget each GPU has left, the largest
concurrency at the P50 and P99 lengths, the KV demand of a stated concurrency (or one derived with
Little's law from an arrival rate and a mean latency), one TP=N replica beside two TP=N/2 ones,
and, with a trace, the probability that the KV demand of `concurrency` requests drawn from real
traffic exceeds the budget. With a price per GPU-hour, each layout's cost per million input and
output tokens at the planned load (and, with a trace, per million tokens that meet the SLO):
the roofline is `gateway/planner/throughput.py`, the price of its tokens
`gateway/planner/token_price.py`, by the gateway's own rule (`gateway/pricing.py`). `plan()` is
pure and returns a dataclass; the text and `--json` outputs both print it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
from dataclasses import dataclass
from typing import Any

from gateway import pricing
from gateway.cost.traces import TraceError, TraceRequest, read_trace
from gateway.planner import throughput, token_price
from gateway.planner.throughput import Lengths, Throughput
from gateway.planner.token_price import LayoutPrice
from gateway.pricing import Price, PriceError
from gateway.profiles import (
    GB,
    GiB,
    GpuProfile,
    Ledger,
    ModelProfile,
    ProfileError,
    blocks_for,
    dtype_bytes,
    get_gpu,
    get_model,
    ledger,
)

KiB = 2**10
MiB = 2**20


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
    )


# ---- command line --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="profile name from gateway/profiles.py (or give --layers ...)")
    arch = p.add_argument_group("architecture (override or replace --model)")
    for flag, help_text in (("--layers", "decoder layers"), ("--heads", "query heads"),
                            ("--kv-heads", "KV heads (GQA)"), ("--head-dim", "head dimension"),
                            ("--hidden", "hidden size (default heads x head-dim)"),
                            ("--intermediate", "MLP size (default 3.5 x hidden)"),
                            ("--vocab", "vocabulary (default 128256)")):
        arch.add_argument(flag, type=int, help=help_text)
    arch.add_argument("--params", type=_params, help="parameters, e.g. 70e9 or 70B")
    p.add_argument("--gpu", required=True, help="GPU name from gateway/profiles.py")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the deployment (default 8)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default --gpus)")
    p.add_argument("--dtype", default="bf16", help="weight dtype: bf16, fp16, fp8, int8, int4")
    p.add_argument("--kv-dtype", default="bf16", help="KV cache dtype (default bf16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserve-gb", type=float, help="runtime reserve per GPU in GB (1e9 B)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-budget-gib", type=float, help="KV budget per GPU in GiB (2^30 B), "
                        "instead of the ledger's")
    budget.add_argument("--kv-budget-gb", type=float, help="the same in GB (1e9 B)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, help="concurrent requests to check")
    p.add_argument("--avg-tokens", type=int, help="average tokens each concurrent request holds")
    p.add_argument("--rate", type=float, help="arrivals per second: the planned load (with "
                   "--mean-latency: concurrency by Little's law; alone: by the roofline)")
    p.add_argument("--mean-latency", type=float, help="mean seconds a request stays")
    p.add_argument("--prompt-p50", type=int, help="prompt tokens P50 (default 2048 or the trace's)")
    p.add_argument("--prompt-p99", type=int, help="prompt tokens P99 (default 16384 or trace's)")
    p.add_argument("--output-tokens", type=int, help="output tokens per request (default 0, "
                   "or the trace's mean)")
    p.add_argument("--trace", help="Azure CSV or Mooncake JSONL trace to sample lengths from")
    p.add_argument("--samples", type=int, default=10_000, help="Monte Carlo samples (trace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-mean", type=float, help="mean prompt tokens for throughput and "
                   "cost (default the trace's, or the lognormal through P50 and P99)")
    pricing.add_price_arguments(p, "docs/planner.md",
                                input_share_default=pricing.ESTIMATED_SHARE)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _params(text: str) -> float:
    scale = {"B": 1e9, "M": 1e6, "T": 1e12}.get(text[-1:].upper(), 1.0)
    try:
        return float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}") from None


def _model_from_args(args: argparse.Namespace) -> ModelProfile:
    given = {"num_layers": args.layers, "num_attention_heads": args.heads,
             "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "params": args.params,
             "hidden_size": args.hidden, "intermediate_size": args.intermediate,
             "vocab_size": args.vocab}
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.model:
        base = get_model(args.model)
        return dataclasses.replace(base, name=base.name + ("+custom" if overrides else ""),
                                   **overrides)
    required = (("--layers", "num_layers"), ("--heads", "num_attention_heads"),
                ("--kv-heads", "num_kv_heads"), ("--head-dim", "head_dim"), ("--params", "params"))
    missing = [flag for flag, key in required if key not in overrides]
    if missing:
        raise ProfileError(f"model: give --model NAME or all of {', '.join(missing)}")
    heads, head_dim = overrides["num_attention_heads"], overrides["head_dim"]
    hidden = overrides.get("hidden_size", heads * head_dim)
    return ModelProfile(
        name="custom",
        num_layers=overrides["num_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=overrides["num_kv_heads"],
        head_dim=head_dim,
        intermediate_size=overrides.get("intermediate_size", int(hidden * 3.5)),
        vocab_size=overrides.get("vocab_size", 128256),
        params=overrides["params"],
        max_position_embeddings=131072,
    )


def input_from_args(args: argparse.Namespace) -> tuple[PlanInput, str]:
    """Parsed flags -> PlanInput (raises ProfileError, TraceError or PriceError for bad
    input)."""
    model = _model_from_args(args)
    trace = tuple(read_trace(args.trace)) if args.trace else ()
    concurrency, source = args.concurrency, "stated"
    if concurrency is None and args.mean_latency is not None:
        if args.rate is None or args.rate < 0 or args.mean_latency < 0:
            raise ProfileError("rate: --mean-latency needs --rate, both non-negative")
        concurrency, source = math.ceil(args.rate * args.mean_latency - 1e-9), "little's law"
    cost = pricing.price_from_args(args)
    p50, p99, out = args.prompt_p50, args.prompt_p99, args.output_tokens
    if trace:
        prompts = sorted(r.prompt_tokens for r in trace)
        p50 = p50 if p50 is not None else _nearest_rank(prompts, 0.5)
        p99 = p99 if p99 is not None else _nearest_rank(prompts, 0.99)
        out = out if out is not None else round(sum(r.output_tokens for r in trace) / len(trace))
    budget = (args.kv_budget_gib * GiB if args.kv_budget_gib is not None
              else args.kv_budget_gb * GB if args.kv_budget_gb is not None else None)
    return PlanInput(
        model=model,
        gpu=get_gpu(args.gpu),
        gpus=args.gpus,
        tp=args.tp if args.tp is not None else args.gpus,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        reserve_bytes=args.reserve_gb * GB if args.reserve_gb is not None else None,
        kv_budget_bytes=budget,
        block_size=args.block_size,
        concurrency=concurrency,
        avg_tokens=args.avg_tokens,
        prompt_p50=p50 if p50 is not None else 2048,
        prompt_p99=p99 if p99 is not None else 16384,
        output_tokens=out if out is not None else 0,
        trace=trace,
        samples=args.samples,
        seed=args.seed,
        rate=args.rate,
        prompt_mean=args.prompt_mean,
        cost=cost,
    ), source


def _nearest_rank(ordered: list[int], q: float) -> int:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def run(args: argparse.Namespace) -> int:
    try:
        inp, source = input_from_args(args)
        result = plan(inp, source)
    except (ProfileError, TraceError, PriceError) as exc:
        print(f"gateway plan: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_dict(), indent=2) if args.json else render_text(result))
    return 0


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def render_text(r: PlanResult) -> str:
    """The plan as an SRE reads it; every figure is also in `--json`."""
    p = r.primary
    seq50, seq99 = r.prompt_p50 + r.output_tokens, r.prompt_p99 + r.output_tokens
    budget_note = "stated" if p.kv_budget_explicit else (
        f"{r.gpu} x util - weights - reserve {p.reserve_per_gpu_bytes / GB:.1f} GB")
    lines = [
        f"model {r.model} on {r.gpus} x {r.gpu}, TP={p.tp} ({p.replicas} replica"
        f"{'s' if p.replicas != 1 else ''}), weights {r.dtype}, KV {r.kv_dtype}, "
        f"block {r.block_size}",
        "",
        f"weights            {r.weights_bytes / GB:,.1f} GB in all, "
        f"{p.weights_per_gpu_bytes / GB:,.2f} GB per GPU",
        f"KV per token       {r.kv_bytes_per_token:,} B ({r.kv_bytes_per_token / KiB:,.0f} KiB) "
        f"in all, {p.kv_bytes_per_token_per_gpu:,} B "
        f"({p.kv_bytes_per_token_per_gpu / KiB:,.0f} KiB) per GPU",
        f"KV budget per GPU  {_gib(p.kv_budget_per_gpu_bytes)} ({budget_note})"
        + ("" if p.weights_fit else f"  -- weights ({p.weights_per_gpu_bytes / GB:.1f} GB per "
           "GPU) do not fit this GPU")
        + ("" if p.fits else "  -- no room left for KV cache"),
        f"KV per replica     {p.kv_blocks_per_replica:,} blocks = "
        f"{p.kv_tokens_per_replica:,} tokens",
        f"max concurrency    {p.max_concurrency_p50:,} per replica at P50 ({seq50:,} tokens), "
        f"{p.max_concurrency_p99:,} at P99 ({seq99:,} tokens)",
    ]
    if r.concurrency:
        lines += ["", f"demand of {r.concurrency} concurrent requests ({r.concurrency_source}):"]
        for label, d in (("avg", r.demand_avg), ("P50", r.demand_p50), ("P99", r.demand_p99)):
            if d is not None:
                share = "no budget" if d.fraction_of_budget is None \
                    else f"{d.fraction_of_budget:.0%} of budget"
                lines.append(f"  {label:>3} {d.tokens:>7,} tokens  {_gib(d.total_bytes):>12} "
                             f"in all, {_gib(d.per_gpu_bytes)} per GPU ({share})")
    lines += ["", "layouts (memory ledger per GPU):",
              "  TP x replicas  weights/GPU  KV budget/GPU  KV tokens/replica  "
              "max conc. P50  max conc. P99" + ("  P(KV > budget)" if r.trace_requests else "")]
    for lay in r.layouts:
        row = (f"  TP={lay.tp:<2} x {lay.replicas:<5}  {lay.weights_per_gpu_bytes / GB:>8.1f} GB  "
               f"{_gib(lay.kv_budget_per_gpu_bytes):>13}  {lay.kv_tokens_per_replica:>17,}  "
               f"{lay.total_concurrency_p50:>13,}  {lay.total_concurrency_p99:>13,}")
        if lay.overflow_probability is not None:
            row += (f"  {lay.overflow_probability:.2%} (at final length), "
                    f"{lay.overflow_probability_mid_decode:.2%} (mid-decode)")
        lines.append(row)
    if r.trace_requests and r.concurrency:
        lines.append(f"  (trace: {r.trace_requests:,} requests; P(KV > budget) samples "
                     + (f"{r.concurrency} concurrent requests split over the replicas)"
                        if r.concurrency_source != "roofline" else
                        "each layout's roofline concurrency at --rate per replica)"))
    if r.cost_model is not None and r.lengths is not None:
        lines += token_price.render(r.cost_model, r.gpus, r.lengths, r.rate, r.concurrency,
                                    [(lay.tp, lay.replicas, lay.throughput, lay.cost)
                                     for lay in r.layouts if lay.cost is not None])
    return "\n".join(lines)
