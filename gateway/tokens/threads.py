"""The priority of the threads that count prompts: never above the event loop's."""

from __future__ import annotations

import os
import threading


def below_the_loop() -> None:
    """A counting thread's start. The encoder releases the GIL for its Rust work, so a worker and
    the loop compete for the CPU only. In a process run at a real-time priority (SCHED_RR or
    FIFO, as benchmarks/proxy_overhead.py --realtime runs it, as some deployments pin a
    gateway), a worker inherits it and keeps the core for its whole time slice (100 ms), back
    to back through a queue of counts, while the loop waits: measured here, loop lags to 250 ms
    with long prompts being counted. The worker leaves real time for the fair scheduler, where
    the loop, real-time, always goes first. Under the fair scheduler nothing changes: a lower
    nice was tried and dropped, since it also puts counting below every other process on the
    host (a simulated engine's first count then missed its TTFT in the suite)."""
    tid = threading.get_native_id()
    try:
        if os.sched_getscheduler(tid) in (os.SCHED_RR, os.SCHED_FIFO):
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed: the threads keep the loop's
        pass
