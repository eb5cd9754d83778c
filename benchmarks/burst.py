"""The issue-20 burst: 300 prompts of 9,000 tokens (unique text) sent at once to the demo.

The demo's pool (policies/demo.yaml: two simulated Qwen2.5-72B replicas, TP=8 on 8 x H100,
real time) gets one pair of engines for the whole benchmark; in front of them, in turn:

  (a) the gateway as it was before issue 20: no SLO (`defaults.slo: null`), so no limits from
      the planner and nothing learned: it guards only the KV cache;
  (b) the gateway uncalibrated: the planner's limits for the default SLO (TTFT P95 2 s, TPOT
      P95 60 ms);
  (c) after `loadtest calibrate` on the same engines (9,000-token prompts, the same SLO), the
      gateway with the learned block (the planner's queue deadline still holds: not learned).

Each gets the same burst (new prompt text each time), on engines left idle before it. Goals
(docs/benchmarks.md, issue 20): (b)'s admitted P99 TTFT <= 4 s, and (b) serves within the SLO
>= 80% of what (c) does.

    .venv/bin/python benchmarks/burst.py [--requests 300] [--out results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from benchmarks import harness
from gateway.policy import load_policy
from loadtest.gateway_metrics import parse
from loadtest.overload import DEMO_POLICY, policy_for, stack

SLO = "ttft=2s,tpot=60ms"


def idle(urls: list[str], timeout: float = 300) -> None:
    """Wait until every engine runs and queues nothing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [harness.get_json(url + "/admin/state") for url in urls]
        if not sum(int(s["running"]) + int(s["waiting"]) for s in states):
            return
        time.sleep(0.5)
    raise TimeoutError("engines still busy")


def gateway(policy_text: str, tmp: Path) -> contextlib.AbstractContextManager[harness.Proc]:
    return harness.start(harness.gateway_command(policy_text, tmp), tmp)


def burst(url: str, n: int, seed: int, out: Path) -> dict[str, Any]:
    return harness.loadtest("run", "--url", url, "--model", "qwen2.5-72b", "--synthetic",
                            "in=9000,out=256", "--concurrency", str(n), "--ramp", "0",
                            "--max-requests", str(n), "--duration", "900", "--drain", "600",
                            "--timeout", "900", "--slo", SLO, "--seed", str(seed),
                            "--no-progress", out=out)


def decisions(url: str) -> dict[str, int]:
    got = parse(harness.get(url + "/metrics").decode())["decisions"]
    return {k: int(v) for k, v in sorted(got.items(), key=lambda kv: -kv[1]) if v}


def row(name: str, r: dict[str, Any]) -> str:
    p99, p50 = (r.get("p99_ttft_ms") or 0) / 1000, (r.get("median_ttft_ms") or 0) / 1000
    return (f"{name:<34} {r['completed']:>9} {r['good']:>6} {r['rejected']:>8} {p99:>9.2f} "
            f"{p50:>9.2f} {(r.get('p99_tpot_ms') or 0):>9.1f} "
            f"{r.get('retry_after_median_s') or 0:>7g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rates", default="1,1.5,2,2.5,3,4",
                    help="calibrate's rates (req/s of 9,000-token prompts)")
    ap.add_argument("--step", type=float, default=20.0, help="calibrate's step duration (s)")
    ap.add_argument("--only", default="abc", help="configurations to run (default abc)")
    ap.add_argument("--out", help="write every report as JSON")
    args = ap.parse_args()
    policy = load_policy(str(DEMO_POLICY))
    results: dict[str, Any] = {"machine": harness.machine()}
    with tempfile.TemporaryDirectory(prefix="burst-") as d:
        tmp = Path(d)
        with stack(policy, "default", str(DEMO_POLICY), tmp, gateway=False) as (engines, _):
            base = yaml.safe_load(policy_for(str(DEMO_POLICY), "default", engines))
            configs: list[tuple[str, dict[str, Any]]] = []
            no_slo = {**base, "defaults": {**base.get("defaults", {}), "slo": None}}
            configs.append(("(a) KV cache only (no SLO)", no_slo))
            configs.append(("(b) uncalibrated: the planner's", base))
            for seed, (name, doc) in enumerate(configs, start=1):
                if name[1] not in args.only:
                    continue
                idle(engines)
                with gateway(yaml.safe_dump(doc, sort_keys=False), tmp) as gw:
                    r = burst(gw.url, args.requests, seed, tmp / f"{seed}.json")
                    r["decisions"] = decisions(gw.url)
                results[name] = r
                print(row(name, r), flush=True)
            if "c" in args.only:
                idle(engines)
                path = tmp / "calibrate.yaml"
                path.write_text(yaml.safe_dump(base, sort_keys=False))
                print("calibrating on the same engines ...", flush=True)
                started = time.monotonic()
                sweep = harness.loadtest(
                    "calibrate", "--policy", str(path), "--pool", "default", "--synthetic",
                    "in=9000,out=256", "--arrival", "poisson", "--rates", args.rates,
                    "--duration", str(args.step), "--slo", SLO, "--target-attainment", "95",
                    "--seed", "7", "--write", "--no-progress", "--report",
                    str(tmp / "calibrate.html"), out=tmp / "calibrate.json", quiet=False)
                learned = yaml.safe_load(path.read_text())["pools"]["default"]["admission"][
                    "learned"]
                results["calibration"] = {"learned": learned,
                                          "seconds": round(time.monotonic() - started),
                                          "sweep": sweep["sweep"]}
                print(f"learned: {learned}", flush=True)
                idle(engines)
                name = "(c) calibrated: learned"
                with gateway(path.read_text(), tmp) as gw:
                    r = burst(gw.url, args.requests, 9, tmp / "c.json")
                    r["decisions"] = decisions(gw.url)
                results[name] = r
    print(f"\n{'configuration':<34} {'completed':>9} {'good':>6} {'rejected':>8} {'p99TTFT':>9}"
          f" {'p50TTFT':>9} {'p99TPOT':>9} {'retry':>7}")
    for name, r in results.items():
        if name.startswith("("):
            print(row(name, r))
    b = results.get("(b) uncalibrated: the planner's")
    c = results.get("(c) calibrated: learned")
    if b is not None:
        print(f"\n(b) admitted P99 TTFT {b['p99_ttft_ms'] / 1000:.2f} s (goal <= 4 s)")
    if b is not None and c is not None:
        ratio = b["good"] / c["good"] if c["good"] else None
        print(f"(b) served within the SLO {b['good']} against (c) {c['good']}: "
              f"{'n/a' if ratio is None else f'{ratio:.2f}'} (goal >= 0.8)")
    if args.out:
        harness.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
