"""`loadtest fleet`: the thousand-GPU deployment as a simulation, validated first.

    loadtest fleet --validate          # the real-process admission benchmark's scale, sim vs real
    loadtest fleet                     # 125 x TP=8 of the 70B at 1x and 2x the saturation rate
    loadtest fleet --tp 4 --replicas 250 --long-share 0,0.2 --loads 1,2 --duration 30

`--validate` runs benchmarks/admission_goodput.py's part A for the 70B reference (two TP=4
replicas of Llama-3.3-70B, engines 4x slower than real, the Azure conversation trace's lengths
with Poisson arrivals seeded as `loadtest run --seed 1`, 60 s, the same policies) through the
simulation and prints its goodput beside the figures that benchmark measured with real
processes (docs/benchmarks.md, issue 5 and issue 20 sections), with the ratio; the goal is
within 15%.

The fleet: the saturation rate of one replica is found as `loadtest calibrate` finds it (the
most requests a second served, by first tokens in a step's second half; direct, on rising
rates), the cluster's is that times the replicas, and the trace is superposed and compressed
to 1x and 2x it (loadtest/fleet_traffic.py). Through the gateway (the planner's limits for the
SLO: the pool's protection before any calibration), each run reports goodput, the cost per
million tokens that met the SLO (every GPU paid for the run's length, `gateway/cost/pricing.py`),
and the gateway tier it needs (gateway/planner/tier.py's rule on the run's own request rate,
output lengths and open streams).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from gateway.cost import pricing
from gateway.planner.tier import TierDelay, size_tier
from loadtest import fleet_traffic as traffic
from loadtest.fleet import FleetResult, FleetSpec, Job, simulate
from loadtest.sim.config import ConfigError

# benchmarks/admission_goodput.py's 70B part A, as docs/benchmarks.md reports its real runs.
TIME_SCALE = 4.0
SLO_REAL = (2.0, 0.05)
ADMISSION = ("    admission:\n      kv_usage_max: 0.9\n      queue_size: {queue}\n"
             "      queue_wait_max_s: {wait:g}\n")
LEARNED = ("      learned: {inflight_tokens_max: 92229, prefill_tokens_max: 3588, "
           "waiting_max: 0, ttft_p99_max_s: 8.0, tpot_p99_max_s: 0.21}\n")
STATIC = "    admission: {mode: static}\n"
# (name, configuration, rate (wall req/s), seconds of arrivals, the real run's goodput (wall
# req/s), where from). Issue 20's (p) ran with --quick: 30 s of arrivals.
REAL = (
    ("(b) gateway, learned", "b", 12.27, 60.0, 1.98, "issue 5, run 1"),
    ("(b) gateway, learned", "b", 12.0, 60.0, 2.64, "issue 5, run 2"),
    ("(c) gateway, static rule", "c", 12.27, 60.0, 0.97, "issue 5, run 1"),
    ("(c) gateway, static rule", "c", 12.0, 60.0, 1.11, "issue 5, run 2"),
    ("(p) gateway, planner's limits", "p", 10.28, 30.0, 1.50, "issue 20 (--quick)"),
    ("(a) direct", "a", 12.27, 60.0, 0.0, "issue 5, both runs"),
)
GOAL = 0.15
SAT_RATES = (2.0, 3.0, 4.0, 5.0, 6.5, 8.0, 10.0, 12.5, 16.0, 20.0, 25.0, 32.0)
DEFAULT_PRICE = 2.50  # USD per GPU-hour: docs/cost.md's example, not a quote


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--validate", action="store_true",
                   help="run the real-process admission benchmark's scale; sim vs real")
    p.add_argument("--model", default="llama-3.3-70b")
    p.add_argument("--gpu", default="h100-sxm-80gb")
    p.add_argument("--tp", default="8", help="tensor-parallel sizes, comma-separated (8)")
    p.add_argument("--replicas", default="125", help="replica counts, comma-separated (125)")
    p.add_argument("--loads", default="1,2", help="multiples of the saturation rate (1,2)")
    p.add_argument("--long-share", default="0", help="shares of long-context requests "
                   "(Mooncake's >= 8,192-token prompts), comma-separated (0)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (30)")
    p.add_argument("--state", default="redis+quota", choices=("memory", "redis", "redis+quota"),
                   help="the gateway tier's state, for its delay and its size (redis+quota)")
    p.add_argument("--seed", type=int, default=1)
    pricing.add_price_arguments(p, "docs/benchmarks.md", price_of=f" (default "
                                f"{DEFAULT_PRICE:.2f}, an example)",
                                input_share_default="not used: one price per token")
    p.add_argument("--out", help="write every figure as JSON here")


class UsageError(ValueError):
    """A flag the fleet cannot run with; the message names it."""


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag}: expected positive integers, comma-separated, got {text!r}")
    return values


def _floats(flag: str, text: str, low: float, high: float) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(low <= v <= high for v in values):
        raise UsageError(f"{flag}: expected numbers from {low:g} to {high:g}, comma-separated, "
                         f"got {text!r}")
    return values


def validation_spec(config: str) -> FleetSpec:
    slo = (SLO_REAL[0] * TIME_SCALE, SLO_REAL[1] * TIME_SCALE)
    admission = ADMISSION.format(queue=64, wait=slo[0] * 0.75)
    configs: dict[str, tuple[str, str, Literal["gateway", "direct"]]] = {
        "b": (admission + LEARNED, "", "gateway"),
        "c": (STATIC, "", "gateway"),
        "p": (admission + f"      ttft_p99_max_s: {slo[0]:g}\n      tpot_p99_max_s: "
              f"{slo[1]:g}\n",
              f"defaults: {{slo: {{ttft_p95_s: {SLO_REAL[0]:g}, tpot_p95_s: {SLO_REAL[1]:g}}}}}\n",
              "gateway"),
        "a": ("", "", "direct"),
    }
    yaml, top, mode = configs[config]
    return FleetSpec(model="llama-3.3-70b", tp=4, replicas=2, time_scale=TIME_SCALE,
                     mode=mode, admission_yaml=yaml, policy_top=top, slo_ttft_s=slo[0],
                     slo_tpot_s=slo[1], drain_s=60.0)


def validate(seed: int = 1, rows: Sequence[tuple[str, str, float, float, float, str]] = REAL
             ) -> dict[str, Any]:
    azure = traffic.load(traffic.AZURE)
    out: list[dict[str, Any]] = []
    print("Validation: benchmarks/admission_goodput.py part A, 70B reference (2 x TP=4, engines "
          "4x slower, SLO 8 s / 200 ms wall), sim vs the real processes' figures\n")
    print(f"{'configuration':<31} {'rate':>6} {'sim':>7} {'real':>6} {'sim/real':>8}  "
          f"{'sim: SLO met of completed, rejected, P99 TTFT':<44} real run")
    for name, config, rate, duration_s, real, source in rows:
        t0 = time.process_time()
        res = simulate(validation_spec(config), traffic.poisson(azure, rate, duration_s, seed))
        f = res.figures()
        good = float(f["request_goodput"] or 0.0)
        ratio = good / real if real else None
        print(f"{name:<31} {rate:>6.2f} {good:>7.2f} {real:>6.2f} "
              f"{'n/a' if ratio is None else f'{ratio:.2f}':>8}  "
              f"{f['slo_attainment_completed_pct'] or 0:5.1f}%, {f['rejection_rate_pct']:4.1f}%, "
              f"{f['p99_ttft_s'] or 0:5.2f} s{'':<18} {source}  "
              f"({time.process_time() - t0:.1f} s CPU)")
        out.append({"name": name, "config": config, "rate": rate, "duration_s": duration_s,
                    "real_goodput": real,
                    "source": source, "ratio": ratio, "sim": f, "reasons": res.reasons()})
    b = [r for r in out if r["config"] == "b"]
    sim_b = sum(r["sim"]["request_goodput"] for r in b) / len(b)
    real_b = sum(r["real_goodput"] for r in b) / len(b)
    verdict = abs(sim_b / real_b - 1) <= GOAL
    print(f"\n(b), the gateway as shipped with its calibration: sim {sim_b:.2f} vs real "
          f"{real_b:.2f} req/s (mean of the two runs) = {sim_b / real_b:.2f} "
          f"(goal within {GOAL:.0%}: {'met' if verdict else 'NOT met'})")
    return {"rows": out, "b_sim": sim_b, "b_real": real_b, "b_ratio": sim_b / real_b,
            "met": verdict}


def fleet_spec(model: str, gpu: str, tp: int, replicas: int, state: str) -> FleetSpec:
    """The fleet's pool: the planner's limits for the SLO (as a pool is before calibration),
    the queue deadline at 3/4 of the TTFT target as in the benchmark, 32 queued per replica."""
    ttft, tpot = SLO_REAL
    yaml = ADMISSION.format(queue=32 * replicas, wait=ttft * 0.75) + (
        f"      ttft_p99_max_s: {ttft:g}\n      tpot_p99_max_s: {tpot:g}\n")
    top = f"defaults: {{slo: {{ttft_p95_s: {ttft:g}, tpot_p95_s: {tpot:g}}}}}\n"
    return FleetSpec(model=model, gpu=gpu, tp=tp, replicas=replicas, admission_yaml=yaml,
                     policy_top=top, slo_ttft_s=ttft, slo_tpot_s=tpot, drain_s=30.0,
                     tier=TierDelay(state))


def jobs_for(rate: float, duration: float, share: float, max_model_len: int,
             seed: int) -> list[Job]:
    base = traffic.superposed(traffic.load(traffic.AZURE), rate, duration, seed)
    if share <= 0:
        return base
    return traffic.with_long_share(base, share, traffic.long_requests(traffic.MOONCAKE,
                                                                      max_model_len), seed + 1)


def saturation(spec: FleetSpec, share: float, duration: float, seed: int) -> float:
    """One replica's saturation rate, direct, on rising rates: the most served (by first
    tokens in the second half) before the served rate falls."""
    one = replace(spec, replicas=1, mode="direct")
    best = 0.0
    for rate in SAT_RATES:
        served = simulate(one, jobs_for(rate, duration, share, spec.max_model_len, seed)
                          ).served_rate()
        if served < 0.9 * best:
            break
        best = max(best, served)
    return best


def report(res: FleetResult, price: float, state: str) -> dict[str, Any]:
    """A run's figures: the whole run as `loadtest run` counts it, and its steady state (the
    second half of the arrivals), whose cost is every GPU for that window over the tokens of
    the requests that arrived in it and met the SLO."""
    spec = res.spec
    steady = res.steady()
    spend = pricing.gpu_spend(price * spec.gpus, float(steady["window_s"] or 0.0))
    good_tokens = int(steady["good_tokens"] or 0)
    tier = size_tier(float(steady["offered_rate"] or 0.0),
                     float(steady["streamed_tokens_per_request"] or 0.0), res.mean_streams(),
                     state, spec.replicas)
    return {"run": res.figures(), "steady": steady, "gpus": spec.gpus, "spend": spend,
            "cost_per_m_good_tokens": spend / good_tokens * 1e6 if good_tokens else None,
            "tier": tier.to_dict(), "reasons": res.reasons(), "steps": res.steps}


def run(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {}
    try:
        price_obj = pricing.price_from_args(args)
    except pricing.PriceError as exc:
        print(f"loadtest fleet: {exc}", file=sys.stderr)
        return 2
    price = price_obj.per_gpu_hour if price_obj is not None else DEFAULT_PRICE
    currency = price_obj.currency if price_obj is not None else "USD"
    grid: tuple[list[float], list[int], list[int], list[float]] | None = None
    if not args.validate:
        try:  # every flag before the traces: a bad one is told at once, wherever it runs
            grid = (_floats("--long-share", args.long_share, 0.0, 1.0),
                    _ints("--tp", args.tp), _ints("--replicas", args.replicas),
                    _floats("--loads", args.loads, 0.01, 100.0))
            if not args.duration > 0:
                raise UsageError(f"--duration: must be positive, got {args.duration:g}")
            for tp in grid[1]:  # the engine's own checks (model, GPU, TP), before any run
                engine = fleet_spec(args.model, args.gpu, tp, 1, args.state).engine()
                if engine.model.num_attention_heads % tp:
                    raise UsageError(f"--tp: must divide the model's attention heads "
                                     f"({engine.model.num_attention_heads}), got {tp}")
        except (UsageError, ConfigError) as exc:
            print(f"loadtest fleet: {exc}", file=sys.stderr)
            return 2
    for path in (traffic.AZURE, traffic.MOONCAKE):
        if not path.exists():
            print(f"loadtest fleet: missing trace {path} (the traces ship in the repository's "
                  "traces/, not in the package: run it from a clone)", file=sys.stderr)
            return 1
    if grid is None:
        out["validation"] = validate(args.seed)
    else:
        out["fleet"] = fleet(args, price, currency, *grid)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    return 0


def fleet(args: argparse.Namespace, price: float, currency: str, shares: list[float],
          tps: list[int], replica_counts: list[int], loads: list[float]
          ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    print(f"{'TP x replicas':<14} {'GPUs':>5} {'long':>5} {'load':>5} {'offered':>8} "
          f"{'goodput':>8} {'SLO met':>8} {'reject':>7} {'P99 TTFT':>8} {'P99 TPOT':>8} "
          f"{currency + '/M good':>11} {'gw workers':>10} {'shards':>6} {'CPU s':>6}")
    for share in shares:
        for tp in tps:
            base = fleet_spec(args.model, args.gpu, tp, 1, args.state)
            sat = saturation(base, share, args.duration, args.seed)
            for replicas in replica_counts:
                spec = fleet_spec(args.model, args.gpu, tp, replicas, args.state)
                for load in loads:
                    rate = load * sat * replicas
                    t0 = time.process_time()
                    res = simulate(spec, jobs_for(rate, args.duration, share,
                                                  spec.max_model_len, args.seed))
                    r = report(res, price, args.state)
                    r.update(tp=tp, replicas=replicas, long_share=share, load=load,
                             saturation_per_replica=sat, cpu_s=time.process_time() - t0)
                    rows.append(r)
                    cost = r["cost_per_m_good_tokens"]
                    st = r["steady"]
                    print(f"{f'{tp} x {replicas}':<14} {spec.gpus:>5} {share:>5.2f} "
                          f"{load:>5.1f} {st['offered_rate']:>8.1f} {st['good_rate']:>8.1f} "
                          f"{st['slo_attainment_pct'] or 0:>7.1f}% "
                          f"{st['rejection_rate_pct'] or 0:>6.1f}% {st['p99_ttft_s'] or 0:>8.2f} "
                          f"{(st['p99_tpot_s'] or 0) * 1000:>6.0f}ms "
                          f"{'n/a' if cost is None else f'{cost:.3f}':>11} "
                          f"{r['tier']['workers']:>10} {r['tier']['shards']:>6} "
                          f"{r['cpu_s']:>6.1f}", flush=True)
    print(f"\nsaturation per replica found directly (served first tokens/s); figures of the "
          f"second half of {args.duration:g} s of arrivals; {currency}/M good: every GPU at "
          f"{price:.2f}/h for the run over the tokens that met the SLO (TTFT "
          f"{SLO_REAL[0]:g} s, TPOT {SLO_REAL[1] * 1000:.0f} ms); gateway tier for the offered "
          f"rate with state {args.state} (gateway/planner/tier.py)")
    return rows
