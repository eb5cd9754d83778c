"""What one access-log line costs the event loop: the queue and listener thread the gateway used
until the fourth session, against the batching handler it uses now, side by side in one run.

The event loop's thread logs a ready-made JSON line at a steady rate (default 5,000 lines/s,
a busy gateway's request rate), busy-waiting between lines as a loaded loop would be busy. For
each handler it prints the mean time a `log.info` call holds the loop's thread and the CPU the
process spends per line beyond the loop's own busy time (the writer thread, its wake-ups, the
GIL hand-offs), medians over repeats, and the ratios new / old. Output goes to /dev/null, so
the terminal's speed does not enter.

    .venv/bin/python benchmarks/access_log.py [--lines N] [--rate R] [--repeats K]
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import queue
import resource
import statistics
import time
from collections.abc import Callable
from typing import TextIO

import orjson

from gateway.observe.accesslog import BatchingHandler

LINE = orjson.dumps({"event": "request", "id": "3f2a9c", "endpoint": "chat", "model": "m",
                     "pool": "default", "backend": "e0", "status": 200, "stream": True,
                     "prompt_tokens": 812, "completion_tokens": 240, "ttft_ms": 51.2,
                     "duration_ms": 4810.3}).decode()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _handler(kind: str, out: TextIO) -> tuple[logging.Handler, Callable[[], None]]:
    fmt = logging.Formatter("%(message)s")
    if kind == "queue":  # what configure_logging built before: one wake-up per record
        q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        sink = logging.StreamHandler(out)
        sink.setFormatter(fmt)
        listener = logging.handlers.QueueListener(q, sink)
        listener.start()
        return logging.handlers.QueueHandler(q), listener.stop
    batching = BatchingHandler(out)
    batching.setFormatter(fmt)
    batching.start()
    return batching, batching.stop


def measure(kind: str, lines: int, rate: float) -> tuple[float, float]:
    """(mean µs a call holds the loop's thread, waits for the GIL included; µs of CPU per
    line beyond the loop's busy time)."""
    gap = 1.0 / rate
    with open("/dev/null", "w") as out:
        handler, stop = _handler(kind, out)
        log = logging.getLogger(f"bench.access.{kind}.{time.monotonic_ns()}")
        log.handlers[:] = [handler]
        log.setLevel(logging.INFO)
        log.propagate = False
        cpu0, held = _cpu(), 0.0
        for _ in range(lines):
            t = time.perf_counter()
            log.info(LINE)
            held += time.perf_counter() - t
            while time.perf_counter() - t < gap:  # the loop's own work until the next request
                pass
        stop()
        extra = _cpu() - cpu0 - lines * gap
    return held / lines * 1e6, extra / lines * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=5_000.0, help="lines per second")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    got: dict[str, list[tuple[float, float]]] = {"queue": [], "batching": []}
    for rep in range(args.repeats):
        for kind in (("queue", "batching") if rep % 2 == 0 else ("batching", "queue")):
            got[kind].append(measure(kind, args.lines, args.rate))
    med = {k: (statistics.median(c for c, _ in v), statistics.median(x for _, x in v))
           for k, v in got.items()}
    print(f"{args.lines} lines at {args.rate:g}/s, {args.repeats} repeats, medians:")
    for kind, (held, extra) in med.items():
        print(f"  {kind:<9} call holds the loop {held:6.2f} us; CPU per line beyond it "
              f"{extra:6.2f} us")
    print(f"  batching / queue: call {med['batching'][0] / med['queue'][0]:.2f}x, "
          f"CPU per line {med['batching'][1] / med['queue'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
