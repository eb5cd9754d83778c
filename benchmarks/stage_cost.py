"""What the per-stage histogram costs a request, with it on and off (issue 21).

End to end its cost is below this machine's noise (proxy CPU 7% / 6% and 32% / 34% of a core
with and without it, docs/benchmarks-proxy.md), so this times what it adds on the real
objects: a `Pipeline`'s `_lap` over `GatewayMetrics.request_stage` as a served request calls it
(seven laps and the queue's observation, each a loop-time read and a histogram observe), against
`_no_lap`, the function it is when `server.stage_metrics` is off. Rounds interleave on and off;
medians over rounds. The share is against the gateway's CPU per request, which the caller gives
from a proxy_overhead run (`--request-cpu-us`; part A prints proxy CPU and requests).

    python benchmarks/stage_cost.py --request-cpu-us 2900
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway import pipeline as pl
from gateway.observe.metrics import GatewayMetrics

LAPS = ("read", "parse", "count", "route", "quota", "admission")  # plus queue and headers


def timed_pipeline() -> pl.Pipeline:
    """A Pipeline with only what `_lap` reads: its loop clock and the bound observers."""
    p = object.__new__(pl.Pipeline)
    metrics = GatewayMetrics()
    p.loop_time = asyncio.new_event_loop().time  # type: ignore[method-assign]
    p._timed = True
    p._stage = {name: metrics.request_stage.labels(name).observe for name in pl.STAGES}
    return p


def request(p: pl.Pipeline, lap: object) -> None:
    """The stage bookkeeping one served request does (pipeline.py's prepare and serve)."""
    fn = lap  # _lap or _no_lap
    t = p.loop_time()
    for stage in LAPS:
        t = fn(stage, t)  # type: ignore[operator]
    if fn is not pl._no_lap:
        p._stage["queue"](0.0)
        p._stage["upstream_headers"](p.loop_time() - t)


def per_request_us(p: pl.Pipeline, lap: object, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        request(p, lap)
    return (time.perf_counter() - started) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=20_000, help="requests per round")
    ap.add_argument("--request-cpu-us", type=float, default=0.0,
                    help="the gateway's CPU per request, from a proxy_overhead run")
    args = ap.parse_args()
    p = timed_pipeline()
    on: list[float] = []
    off: list[float] = []
    for r in range(args.rounds):
        pair = [("on", p._lap), ("off", pl._no_lap)]
        for name, lap in pair if r % 2 == 0 else reversed(pair):
            (on if name == "on" else off).append(per_request_us(p, lap, args.n))
    on_us, off_us = statistics.median(on), statistics.median(off)
    print(f"stage bookkeeping per request: on {on_us:.2f} us, off {off_us:.2f} us, "
          f"the histogram's own cost {on_us - off_us:.2f} us "
          f"({args.rounds} rounds of {args.n:,}; on ranged {min(on):.2f}-{max(on):.2f})")
    if args.request_cpu_us:
        share = (on_us - off_us) / args.request_cpu_us
        print(f"against {args.request_cpu_us:,.0f} us of gateway CPU per request: "
              f"{share:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
