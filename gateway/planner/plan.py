"""`gateway plan`: the capacity planner's command line (docs/planner.md).

Flags to a `PlanInput` (a named model or one described by its architecture, lengths from flags or
a trace, concurrency stated or by Little's law, a price), `gateway/planner/capacity.py` computes
the plan, and this module prints it as the text an SRE reads or, with `--json`, every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from gateway.cost import pricing
from gateway.cost.pricing import PriceError
from gateway.cost.profiles import GB, GiB, ModelProfile, ProfileError, get_gpu, get_model
from gateway.cost.traces import TraceError, read_trace
from gateway.planner import token_price
from gateway.planner.capacity import TIER_STATES, PlanInput, PlanResult, plan
from gateway.planner.tier import MEASURED, STREAMS_PER_WORKER, TierSize

KiB = 2**10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="profile name from gateway/cost/profiles.py "
                   "(or give --layers ...)")
    arch = p.add_argument_group("architecture (override or replace --model)")
    for flag, help_text in (("--layers", "decoder layers"), ("--heads", "query heads"),
                            ("--kv-heads", "KV heads (GQA)"), ("--head-dim", "head dimension"),
                            ("--hidden", "hidden size (default heads x head-dim)"),
                            ("--intermediate", "MLP size (default 3.5 x hidden)"),
                            ("--vocab", "vocabulary (default 128256)")):
        arch.add_argument(flag, type=int, help=help_text)
    arch.add_argument("--params", type=_params, help="parameters, e.g. 70e9 or 70B")
    p.add_argument("--gpu", required=True, help="GPU name from gateway/cost/profiles.py")
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
    p.add_argument("--tier-state", default="redis+quota", choices=TIER_STATES,
                   help="with --rate, size the gateway tier for this state: memory (one "
                   "replica), redis, or redis+quota (tenants with two quota buckets; default)")
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
        tier_state=args.tier_state,
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
    if r.tier is not None:
        lines += render_tier(r.tier)
    if r.cost_model is not None and r.lengths is not None:
        lines += token_price.render(r.cost_model, r.gpus, r.lengths, r.rate, r.concurrency,
                                    [(lay.tp, lay.replicas, lay.throughput, lay.cost)
                                     for lay in r.layouts if lay.cost is not None])
    return "\n".join(lines)


def render_tier(t: TierSize) -> list[str]:
    """The gateway tier for the planned rate (gateway/planner/tier.py's rule and constants)."""
    lines = ["", f"gateway tier at {t.rate:,.1f} requests/s, {t.output_tokens:,.0f} output "
             f"tokens each, {t.streams:,.0f} streams open, {t.backends:,} backends "
             f"(state: {t.state}):",
             f"  gateway workers    {t.workers:,} (CPU: {t.workers_for_cpu:,} at "
             f"{t.cpu_per_request_s * 1e3:.2f} ms a request; streams: "
             f"{t.workers_for_streams:,} at {STREAMS_PER_WORKER} a worker)"]
    if t.state != "memory":
        lines.append(f"  Redis shards       {t.shards:,} ({t.redis_us_per_s / 1e6:.2f} s of "
                     f"Redis a second; the pool's own shard {t.pool_shard_share:.0%} busy"
                     + (": split the pool" if t.pool_shard_share > 0.7 else "") + ")")
    lines.append(f"  (constants measured {MEASURED}; docs/operations.md, Sizing the gateway "
                 "tier)")
    return lines
