"""Where a stream's stall came from: each benchmark process's garbage-collection pauses and
event-loop lateness, stamped with `time.perf_counter()` (CLOCK_MONOTONIC on Linux, one clock
for every process), so a stall the client saw can be laid beside what each process was doing
then (benchmarks/proxy_overhead.py `--trace-stalls`).

Each process appends lines to `$STALL_TRACE_DIR/<role>-<pid>.txt`:

    gc <start> <ms> <generation>     a collection that took over 1 ms
    late <start> <ms>                a 1 ms loop heartbeat that ran over 3 ms late

The heartbeat costs each traced process about a thousand wake-ups a second, so traced runs
explain stalls; untraced runs give the figures. Loaded into the gateway and the engine by
`sitecustomize.py` beside it (PYTHONPATH), and into the client by `start`.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
from typing import IO, Any

ENV = "STALL_TRACE_DIR"
GC_MIN_S = 0.001
LATE_MIN_S = 0.003
BEAT_S = 0.001

_out: list[IO[str]] = []


def start(role: str) -> bool:
    """Record this process's GC pauses from now on, into $STALL_TRACE_DIR; False if unset."""
    folder = os.environ.get(ENV)
    if not folder or _out:
        return bool(_out)
    _out.append(open(os.path.join(folder, f"{role}-{os.getpid()}.txt"), "a", buffering=1))
    began = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
            return
        took = time.perf_counter() - began[0]
        if took > GC_MIN_S:
            _out[0].write(f"gc {began[0]:.6f} {took * 1e3:.2f} {info['generation']}\n")

    gc.callbacks.append(on_gc)
    return True


def beat(loop: asyncio.AbstractEventLoop) -> None:
    """Write when this loop runs a 1 ms timer more than LATE_MIN_S late (after `start`)."""
    last = [time.perf_counter()]

    def tick() -> None:
        now = time.perf_counter()
        late = now - last[0] - BEAT_S
        if late > LATE_MIN_S and _out:
            _out[0].write(f"late {last[0] + BEAT_S:.6f} {late * 1e3:.2f}\n")
        last[0] = now
        loop.call_later(BEAT_S, tick)

    loop.call_later(BEAT_S, tick)


def install_from_env() -> None:
    """For sitecustomize: trace this process, and beat on every uvloop loop it runs
    (the gateway and the stub engine start theirs with `uvloop.run`)."""
    role = os.path.basename(sys.argv[0]).removesuffix(".py") if sys.argv and sys.argv[0] \
        else "python"
    if not start(role):
        return
    try:
        import uvloop
    except ImportError:
        return
    plain_new = uvloop.new_event_loop
    plain_run = uvloop.run

    def new_event_loop() -> uvloop.Loop:
        loop = plain_new()
        beat(loop)
        return loop

    def run(main: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("loop_factory", new_event_loop)
        return plain_run(main, **kwargs)

    uvloop.new_event_loop = new_event_loop
    uvloop.run = run


def read(folder: str) -> list[tuple[float, str, str, float, str]]:
    """Every traced event: (start, role, kind, ms, generation or '')."""
    events = []
    for name in os.listdir(folder):
        role = name.rsplit("-", 1)[0]
        with open(os.path.join(folder, name)) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[0] in ("gc", "late"):
                    events.append((float(parts[1]), role, parts[0], float(parts[2]),
                                   parts[3] if len(parts) > 3 else ""))
    events.sort()
    return events


NOTE_S = 0.005  # stalls past the token interval by more than this are explained
_NAMES = {"gateway": "gateway", "stub_engine": "engine", "client": "client"}


def explain(folder: str, stalls: list[tuple[float, float]], window: float = 0.002) -> list[str]:
    """One line per burst of stalls: `stalls` are (when a stream's longest gap began, how far
    past the token interval it ran), in seconds; the bursts are those within 30 ms of each
    other, and beside each, the traced events that overlap it (give or take `window`)."""
    events = read(folder)
    bursts: list[list[tuple[float, float]]] = []
    for at, excess in sorted(s for s in stalls if s[1] > NOTE_S):
        if bursts and at - bursts[-1][-1][0] < 0.03:
            bursts[-1].append((at, excess))
        else:
            bursts.append([(at, excess)])
    lines = []
    for burst in bursts:
        begin = burst[0][0]
        end = max(at + excess for at, excess in burst) + 0.02  # the gap: interval + excess
        near = [f"{_NAMES.get(role, role)} {kind}{' gen' + gen if gen else ''} "
                f"{ms:.1f} ms at +{(start - begin) * 1e3:.0f} ms"
                for start, role, kind, ms, gen in events
                if start <= end + window and start + ms / 1e3 >= begin - window]
        lines.append(f"{len(burst)} streams stalled up to {max(e for _, e in burst) * 1e3:.1f} "
                     f"ms from {begin:.3f}: " + ("; ".join(near) or "nothing traced"))
    return lines
