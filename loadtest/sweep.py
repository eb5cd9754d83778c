"""`loadtest sweep`: the same load at rising rates, and the knee where the SLOs stop holding.

The knee is the highest offered rate at which SLO attainment (requests meeting every SLO, as a
share of all sent: a rejection or an error is a miss) is still at or above the target, with
every lower rate above it too: past the first failing rate, a lucky higher one is noise, not
capacity. `--rates auto` doubles from `--start-rate` until a step fails, then bisects between
the last passing and the first failing rate; every search is bounded by `--max-steps`.

With a price (`--gpu-hour P --gpus N`) every step carries its cost figures and the sweep names
the cheapest load: the step at or below the knee with the lowest cost per million goodput
tokens (`loadtest/pricing.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadtest.pricing import add_price_options, cheapest
from loadtest.run_cli import (
    Prepared,
    UsageError,
    add_load_options,
    add_report_option,
    check_urls,
    gateway_poller,
    make_builder,
    note,
    prepare,
    run_command,
    run_once,
    write_json,
)
from loadtest.runner import Runner, resolve_model
from loadtest.workload import PromptBuilder

DEFAULT_TARGET = 99.0
# A step whose target began to serve less than this share of the offered rate fell behind:
# the offer exceeded its capacity. Poisson counting noise over half a minute's sends is a few
# percent, so a step that keeps up does not read under it by chance.
FELL_BEHIND = 0.85
StepHook = Callable[[float, Runner], "asyncio.Task[Any] | None"]


def add_sweep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="auto",
                   help="offered rates (req/s) to run in turn, e.g. 1,2,4,8, or auto (default)")
    p.add_argument("--start-rate", type=float, default=1.0,
                   help="--rates auto: the first rate (default 1 req/s)")
    p.add_argument("--max-steps", type=int, default=8,
                   help="--rates auto: at most this many runs (default 8)")
    p.add_argument("--target-attainment", type=float, default=DEFAULT_TARGET, metavar="PCT",
                   help=f"SLO attainment the knee must keep, percent (default {DEFAULT_TARGET:g})")
    p.add_argument("--pause", type=float, default=1.0, metavar="S",
                   help="idle seconds between steps, so one step's tail does not load the next")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_load_options(p, pace=False)
    add_sweep_options(p)
    add_price_options(p)
    p.add_argument("--out", metavar="FILE.json", help="write every step's report and the knee")
    p.add_argument("--plot", metavar="FILE.png", help="latency percentiles and goodput vs load")
    add_report_option(p)


def parse_rates(text: str) -> list[float] | None:
    """None for auto; else the rates, ascending, each positive."""
    if text.strip() == "auto":
        return None
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise UsageError(f"--rates {text!r}: expected positive numbers like 1,2,4,8, or auto")
    return sorted(set(rates))


@dataclass
class Sweep:
    target_pct: float
    steps: list[dict[str, Any]] = field(default_factory=list)

    def passed(self, step: dict[str, Any]) -> bool:
        att = step["report"].get("slo_attainment_pct")
        return att is not None and att >= self.target_pct

    @property
    def bounded(self) -> bool:
        """Did some rate fail? If not, the knee is only a lower bound on the capacity."""
        return any(not self.passed(s) for s in self.steps)

    @property
    def knee(self) -> float | None:
        best: float | None = None
        for step in sorted(self.steps, key=lambda s: float(s["offered"])):
            if not self.passed(step):
                break
            best = float(step["offered"])
        return best

    @property
    def saturation(self) -> float | None:
        """The most requests per second the target was seen to start serving (a step's
        `served_rate`): its capacity, the rate where throughput stops following the offer,
        when some step fell behind (`saturated`); else only a lower bound. Past saturation a
        vLLM-like engine serves less, not the same: its KV cache fills, it preempts and
        recomputes, so the highest step is not the measure; the best step is. A step counts
        at most its offered rate: a burst of arrivals in a step's second half reads above the
        offer, and that is luck, not capacity."""
        rates = [min(float(r), float(s["offered"])) for s in self.steps
                 if (r := s["report"].get("served_rate")) is not None]
        return max(rates) if rates else None

    @property
    def saturated(self) -> bool:
        """Did some step offer more than the target could start serving?"""
        return any((r := s["report"].get("served_rate")) is not None
                   and r < FELL_BEHIND * float(s["offered"]) for s in self.steps)

    def knee_step(self) -> dict[str, Any] | None:
        knee = self.knee
        return next((s for s in self.steps if s["offered"] == knee), None)

    def cheapest_step(self) -> dict[str, Any] | None:
        """The load at or below the knee with the lowest cost per million goodput tokens."""
        return cheapest(self.steps, self.passed, self.knee)


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def step_line(step: dict[str, Any]) -> str:
    r = step["report"]
    cost = (f" {_fmt(r.get('cost_per_million_goodput_tokens'), 3):>12}" if "cost" in r
            else "")
    return (f"{step['offered']:>8g} {r['sent']:>6} {_fmt(r.get('served_rate'), 2):>7} "
            f"{_fmt(r['request_throughput'], 2):>8} "
            f"{_fmt(r['request_goodput'], 2):>8} {_fmt(r['slo_attainment_pct']):>7} "
            f"{_fmt(r['median_ttft_ms']):>9} {_fmt(r['p99_ttft_ms']):>9} "
            f"{_fmt(r['median_tpot_ms']):>8} {_fmt(r['p99_tpot_ms']):>8} "
            f"{_fmt(r['rejection_rate_pct']):>6} {_fmt(r['error_rate_pct']):>6}{cost}")


HEADER = (f"{'rate':>8} {'sent':>6} {'served':>7} {'req/s':>8} {'goodput':>8} {'SLO%':>7} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>8} {'TPOT p99':>8} {'rej%':>6} "
          f"{'err%':>6}")


def header(currency: str | None) -> str:
    """HEADER, with the cost per million goodput tokens' column when the steps are priced."""
    return HEADER if currency is None else HEADER + f" {currency + '/M good':>12}"


async def run_sweep(urls: list[str], model: str, builder: PromptBuilder, prep: Prepared,
                    args: argparse.Namespace, rates: list[float] | None,
                    hook: StepHook | None = None) -> Sweep:
    """Run the steps (a list, or the auto search) and return them with the knee."""
    sweep = Sweep(args.target_attainment)
    print(header(prep.pricing.currency if prep.pricing is not None else None), flush=True)

    async def step(rate: float) -> bool:
        if sweep.steps:
            await asyncio.sleep(args.pause)
        shape = dataclasses.replace(prep.shape, rate=rate)
        # Same lengths and arrivals, new prompt text: the engines keep earlier steps' prompts
        # in their prefix cache, and a step served from it would look cheaper than it is.
        builder.salt = len(sweep.steps)
        report, _ = await run_once(
            urls, model, builder, prep, args, shape,
            runner_hook=(lambda runner: hook(rate, runner)) if hook is not None else None)
        entry: dict[str, Any] = {"offered": rate, "report": report}
        sweep.steps.append(entry)
        print(step_line(entry), flush=True)
        return sweep.passed(entry)

    if rates is not None:
        for rate in rates:
            await step(rate)
        return sweep
    # auto: double up to the first failing rate, then bisect; all within max_steps runs.
    budget = max(2, args.max_steps)
    rate = args.start_rate
    good: float | None = None
    bad: float | None = None
    while budget > 0:
        budget -= 1
        if await step(rate):
            good = rate
            if bad is not None:
                break
            rate *= 2
        else:
            bad = rate
            if good is not None:
                break
            rate /= 2  # even the start rate fails: look lower, still bounded by the budget
    while budget > 0 and good is not None and bad is not None and bad / good > 1.15:
        budget -= 1
        mid = round(math.sqrt(good * bad), 3)
        if await step(mid):
            good = mid
        else:
            bad = mid
    return sweep


def summary(sweep: Sweep, prep: Prepared, args: argparse.Namespace) -> dict[str, Any]:
    head: dict[str, Any] = {
        "target_attainment_pct": sweep.target_pct, "knee_rate": sweep.knee,
        "saturation_rate": sweep.saturation, "saturated": sweep.saturated, "slo": args.slo,
        "workload": prep.workload.source, "arrival": prep.shape.arrival.describe(),
        "duration_s": args.duration, "rates": [s["offered"] for s in sweep.steps]}
    if prep.pricing is not None:
        best = sweep.cheapest_step()
        head["cost"] = prep.pricing.describe()
        head["cheapest_rate"] = best["offered"] if best is not None else None
        head["cheapest_cost_per_million_goodput_tokens"] = (
            best["report"]["cost_per_million_goodput_tokens"] if best is not None else None)
    return {"sweep": head, "steps": sorted(sweep.steps, key=lambda s: float(s["offered"]))}


def saturation_line(sweep: Sweep) -> str:
    sat = sweep.saturation
    if sat is None:
        return "saturation: unknown (no step lasted long enough to measure)"
    if not sweep.saturated:
        return (f"saturation: at least {sat:.2f} req/s (every step was served as offered; add "
                "higher rates to find where throughput stops following the load)")
    return (f"saturation: {sat:.2f} req/s (the most any step was served; a step offering more "
            "fell behind)")


def cheapest_line(sweep: Sweep, currency: str) -> str:
    best = sweep.cheapest_step()
    if best is None:
        return (f"cheapest: none: no load kept SLO attainment >= {sweep.target_pct:g}% with "
                "every lower load passing")
    r = best["report"]
    return (f"cheapest: {best['offered']:g} req/s at {r['cost_per_million_goodput_tokens']:,.3f}"
            f" {currency} per million goodput tokens ({r['cost_per_million_tokens']:,.3f} per "
            f"million tokens, SLO attainment {r['slo_attainment_pct']:.1f}%)")


async def _run(args: argparse.Namespace) -> int:
    rates = parse_rates(args.rates)
    if not 0 < args.target_attainment <= 100:
        raise UsageError("--target-attainment must be within (0, 100]")
    if args.start_rate <= 0:
        raise UsageError("--start-rate must be positive")
    # A placeholder rate makes prepare() check everything else; each step sets its own.
    prep = prepare(args, rate=(rates or [args.start_rate])[0])
    if not prep.slo:
        raise UsageError("a sweep needs --slo (e.g. ttft=2s,tpot=60ms): the knee is where "
                         "SLO attainment drops")
    urls = check_urls(args.urls)
    model = await resolve_model(urls, args.model, prep.headers)
    builder = make_builder(args, model)
    poller = await gateway_poller(urls, prep) if args.report else None
    polling = poller.start() if poller is not None else None
    try:
        sweep = await run_sweep(urls, model, builder, prep, args, rates)
    finally:
        if polling is not None:
            polling.cancel()
            await asyncio.gather(polling, return_exceptions=True)
    if poller is not None:
        await poller.final()
    knee = sweep.knee
    if knee is None:
        print(f"knee: none: even the lowest rate kept SLO attainment under "
              f"{sweep.target_pct:g}%")
    else:
        print(f"knee: {knee:g} req/s (the highest rate keeping SLO attainment >= "
              f"{sweep.target_pct:g}%)")
        if not sweep.bounded:
            note(f"every rate kept the SLOs: the knee is at least {knee:g} req/s; add higher "
                 "rates to find it")
    print(saturation_line(sweep))
    if prep.pricing is not None:
        print(cheapest_line(sweep, prep.pricing.currency))
    if args.out:
        write_json(args.out, summary(sweep, prep, args))
        note(f"sweep written to {args.out}")
    if args.plot:
        from loadtest.plot import plot_sweep

        best = sweep.cheapest_step()
        plot_sweep(sorted(sweep.steps, key=lambda s: float(s["offered"])), knee, args.plot,
                   f"{model} - {prep.workload.source} - SLO {args.slo}",
                   cheapest=best["offered"] if best is not None else None,
                   currency=prep.pricing.currency if prep.pricing is not None else "USD")
        note(f"plot written to {args.plot}")
    if args.report:
        from loadtest import html_report

        html_report.write_sweep(args.report, summary(sweep, prep, args),
                                title=f"loadtest sweep: {model}, SLO {args.slo}",
                                timeline=poller.rows if poller is not None else None)
        note(f"report written to {args.report}")
    return 0


def run(args: argparse.Namespace) -> int:
    return run_command(args, _run)
