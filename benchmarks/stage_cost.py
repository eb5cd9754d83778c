"""What the per-stage histogram costs a request, with it on and off (issue 21).

End to end its cost is below this machine's noise (proxy CPU 7% / 6% and 32% / 34% of a core
with and without it, docs/benchmarks-proxy.md), so this times what it adds on the real
objects: a `Pipeline`'s `_lap` as a served request calls it (six laps, the queue's observation
and the answer headers', each a loop-time read and an observation), against `_no_lap`, the
function it is when `server.stage_metrics` is off. Two ways of observing, side by side: as
shipped (`GatewayMetrics.stage_observer`: plain counts, flushed into the histogram every 64
requests here, every 0.1 s in the gateway; gateway/observe/batched.py) and prometheus_client's
own `observe` on each child, as before. Rounds interleave; medians over rounds. The share is
against the gateway's CPU per request, which the caller gives from a proxy_overhead run
(`--request-cpu-us`; part A prints proxy CPU and requests).

    python benchmarks/stage_cost.py --request-cpu-us 2900
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway import pipeline as pl
from gateway.observe.metrics import GatewayMetrics

LAPS = ("read", "parse", "count", "route", "quota", "admission")  # plus queue and headers
FLUSH_EVERY = 64  # requests between flushes of the batched counts (~0.1 s at 650 a second)


def timed_pipeline(metrics: GatewayMetrics, batched: bool) -> pl.Pipeline:
    """A Pipeline with only what `_lap` reads: its loop clock and the bound observers."""
    p = object.__new__(pl.Pipeline)
    p.loop_time = asyncio.new_event_loop().time  # type: ignore[method-assign]
    p._timed = True
    p._stage = {name: metrics.stage_observer(name) if batched
                else metrics.request_stage.labels(name).observe for name in pl.STAGES}
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


def per_request_us(p: pl.Pipeline, lap: object, n: int,
                   flush: Callable[[], None] | None = None) -> float:
    started = time.perf_counter()
    for i in range(n):
        request(p, lap)
        if flush is not None and not i % FLUSH_EVERY:
            flush()
    return (time.perf_counter() - started) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--n", type=int, default=20_000, help="requests per round")
    ap.add_argument("--request-cpu-us", type=float, default=0.0,
                    help="the gateway's CPU per request, from a proxy_overhead run")
    args = ap.parse_args()
    metrics = GatewayMetrics()
    shipped, plain = timed_pipeline(metrics, True), timed_pipeline(metrics, False)
    runs: dict[str, list[float]] = {"batched": [], "observe": [], "off": []}
    for r in range(args.rounds):
        order = [("batched", shipped, shipped._lap, metrics.flush_batched),
                 ("observe", plain, plain._lap, None), ("off", plain, pl._no_lap, None)]
        for name, p, lap, flush in order[r % 3:] + order[:r % 3]:
            runs[name].append(per_request_us(p, lap, args.n, flush))
    med = {name: statistics.median(v) for name, v in runs.items()}
    for name in ("batched", "observe"):
        print(f"stage bookkeeping per request, {name}: {med[name]:.2f} us, off "
              f"{med['off']:.2f} us, the histogram's own cost {med[name] - med['off']:.2f} us "
              f"({args.rounds} rounds of {args.n:,}; ranged {min(runs[name]):.2f}-"
              f"{max(runs[name]):.2f})")
        if args.request_cpu_us:
            share = (med[name] - med["off"]) / args.request_cpu_us
            print(f"  against {args.request_cpu_us:,.0f} us of gateway CPU per request: "
                  f"{share:.2%}")
    print(f"batched / observe, the histogram's own cost: "
          f"{(med['batched'] - med['off']) / (med['observe'] - med['off']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
