"""The priority of the threads that count prompts: below the event loop's."""

from __future__ import annotations

import os
import threading

# How much less CPU weight a counting thread has than the event loop under Linux's fair
# scheduler: nice 5 is ~3x less. The loop relays every open stream; a count waits for it.
WORKER_NICE = 5


def below_the_loop() -> None:
    """A counting thread's start: below the event loop's priority. The encoder releases the GIL
    for its Rust work, so a worker and the loop compete for the CPU only; on a core they share,
    the loop (its streams' chunks, the next request's bytes upstream) goes first. A process run
    at a real-time priority (SCHED_RR or FIFO, as benchmarks/proxy_overhead.py --realtime runs
    it) would otherwise let a worker keep the core for its whole time slice (100 ms), back to
    back through a queue of counts, while the loop waits: measured here, loop lags to 250 ms
    with long prompts counted behind; the worker leaves real-time for the fair scheduler."""
    tid = threading.get_native_id()
    try:
        if os.sched_getscheduler(tid) in (os.SCHED_RR, os.SCHED_FIFO):
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE))
    except (AttributeError, OSError):  # not Linux, or not allowed: the threads keep the loop's
        pass
