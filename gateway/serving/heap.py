"""Keeping garbage collection out of the streams' way.

A full collection traverses every tracked object in the process while every stream waits. An
open stream kept 100-140 of them alive when this keeper was written (uvicorn's and aiohttp's
per-connection callbacks, the coroutines of its await chain, the request's own objects), ~50
since the gateway serves with its own HTTP/1.1 protocol and client, and start-up leaves
~67,000 more (modules, classes, functions, the policy): with Python's own thresholds a full
collection held the loop 100-250 ms at 1,000 open streams, several times a minute (issue 21).
Those traversals find nothing: over 4,300 streamed requests the collector freed no object in
any generation after start-up (`gc.get_stats()`), because the request path makes no
reference cycles.

So the keeper splits the heap three ways:

- **Start-up's objects are frozen** (`gc.freeze()` once serving is ready) and no collection
  walks them again. Only a policy reload makes garbage of them (the old runtime), so a reload
  asks for one full pass (below).
- **Survivors are moved to the old generation within one interval.** Every
  `server.gc_freeze_interval_s` the keeper collects the two young generations (`gc.collect(1)`,
  a walk of what was born since the last tick and still lives: ~0.1-0.5 ms), and Python's own
  young collections promote what survives two of them (the middle generation's threshold is
  0). Without the tick young survivors pile up: Python collects the young generation when
  allocations minus deallocations pass 700, and an old stream's objects freed as it ends count
  as deallocations, so new streams' objects gathered there until one collection walked
  thousands (10-25 ms at 1,000 open streams).
- **The old generation is collected only by the keeper's sweep** (its threshold is out of
  reach): a walk of what lives beyond start-up, ~15,000 objects at 300 open streams (~25,000
  and 5-20 ms on a 2-core VM before the gateway's own protocol), which finds any cycle the
  request path makes.
  Every open stream waits for that walk, so a sweep that falls due
  (`server.gc_sweep_interval_s`) waits for a moment with no request open, where it stalls
  nobody. Under load that never pauses it waits until garbage could be piling up: until the
  interpreter's allocated blocks (`sys.getallocatedblocks()`, 0.05-0.1 ms to read) have grown
  `server.gc_sweep_growth` past what the last sweep left (by default twice as many), beyond
  what the requests opened since then explain (`STREAM_BLOCKS` each). A steady load's objects
  die by reference count and leave that figure flat, so no sweep stalls it; a path that starts
  to make cycles grows it, and is swept at a bounded cost in memory (the blocks are the small
  objects', ~280,000 at start-up as shipped). A load that rises grows it too, with objects a
  sweep would walk and not free (~210-240 blocks per open stream as shipped: idle to 1,200
  streams +88-95%), so that share is not growth: without it a ramp to ~1,300 open streams
  would run a due sweep at its peak, the costliest moment (a sweep forced at 1,200: up to
  100 ms), to free nothing. A sweep that finds little doubles the wait for the next (up to 16
  times).

Until this split the survivors were frozen too and a sweep unfroze and walked everything,
start-up's tables included: 25-30 ms at 300 open streams. Until the sweep waited on growth it
ran under load within one more interval, and a machine slower than the one it was timed on
took 10-23 ms over it. `gateway_gc_collected_objects_total` counts what collections find, so a
path that starts to make cycles shows there, and `gateway_gc_sweeps_total{trigger}` says
whether sweeps ran in lulls or on growth.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable

from gateway.observe.metrics import GatewayMetrics

SWEEP_FOUND_RESET = 1_000  # a sweep finding this many objects in cycles resets the backoff
SWEEP_BACKOFF_MAX = 16  # sweeps at least every 16 x gc_sweep_interval_s (~2.7 h by default)
OLD_THRESHOLD = 2**31 - 1  # Python never collects the old generation on its own (a C int)
# Blocks one open request may add before its share counts as growth: ~2x the 210-240 measured
# per open chat stream as shipped (its connection's objects and the request's). Prompt text
# and token arrays are large allocations, outside the count.
STREAM_BLOCKS = 512


class HeapKeeper:
    def __init__(self, metrics: GatewayMetrics, freeze_interval_s: float,
                 sweep_interval_s: float, open_requests: Callable[[], int] = lambda: 0,
                 sweep_growth: float = 1.0,
                 blocks: Callable[[], int] = sys.getallocatedblocks) -> None:
        self.metrics = metrics
        self.young_interval_s = freeze_interval_s  # 0: the keeper is off
        self.sweep_interval_s = sweep_interval_s
        self.open_requests = open_requests  # requests in flight now (a sweep waits for none)
        self.sweep_growth = sweep_growth
        self.blocks = blocks  # the interpreter's allocated memory blocks, now
        self._swept_blocks = 0  # what the last sweep (or start-up) left
        self._swept_open = 0  # the requests open then
        self.sweeps = 0
        self._full_asked = False  # a reload retired objects frozen with start-up
        self._thresholds: tuple[int, int, int] | None = None

    def install(self) -> None:
        """Promote young survivors at once, and leave the old generation to the sweep."""
        if self.young_interval_s > 0 and self._thresholds is None:
            self._thresholds = gc.get_threshold()
            gc.set_threshold(self._thresholds[0], 0, OLD_THRESHOLD)

    def uninstall(self) -> None:
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None

    def settle(self) -> None:
        """After start-up: collect what loading left behind, freeze the rest (imports, the
        tokenizers' tables, the policy) out of every later collection."""
        gc.collect()
        gc.freeze()
        self._mark()
        # Counted here only: `gc.get_freeze_count()` walks the frozen list, one cold pointer
        # per object (4-11 ms at 67,000-103,000 objects), and nothing later adds to it.
        self.metrics.gc_frozen.set(gc.get_freeze_count())

    def ask_full(self) -> None:
        """A reload retired a runtime frozen at start-up (or at the last reload): walk
        everything once, at the next lull (or on growth, as a sweep)."""
        self._full_asked = True

    async def run(self) -> None:
        if self.young_interval_s <= 0:
            return  # off: Python's own thresholds decide, over the whole heap
        loop = asyncio.get_running_loop()
        interval = self.sweep_interval_s
        next_sweep = loop.time() + interval
        sweeps = self.metrics.gc_sweeps_by
        while True:
            await asyncio.sleep(self.young_interval_s)
            now = loop.time()
            full = self._full_asked
            trigger = self._trigger() if full or now >= next_sweep else None
            if trigger is None:
                gc.collect(1)
                continue
            sweeps[trigger].inc()
            if full:
                self._full_asked = False
                self.resettle()  # it walks the old generation too
            else:
                # One that found nothing doubles the wait for the next, up to
                # SWEEP_BACKOFF_MAX times the policy's; one that found garbage brings it back.
                found = self.sweep()
                interval = self.sweep_interval_s if found >= SWEEP_FOUND_RESET else \
                    min(interval * 2, self.sweep_interval_s * SWEEP_BACKOFF_MAX)
            self._mark()
            next_sweep = now + interval

    def _mark(self) -> None:
        """What a sweep (or start-up) left: later growth is measured from it."""
        self._swept_blocks = self.blocks()
        self._swept_open = self.open_requests()

    def _trigger(self) -> str | None:
        """What lets a due sweep run now: no request open, or enough growth since the last
        that garbage may be piling up; None while it should wait."""
        open_now = self.open_requests()
        if not open_now:
            return "lull"
        if self.sweep_growth == 0:
            return "growth"  # the policy's "at once"
        # Requests opened since the last sweep hold objects a sweep would walk, not free.
        explained = STREAM_BLOCKS * max(0, open_now - self._swept_open)
        if self.blocks() > self._swept_blocks * (1 + self.sweep_growth) + explained:
            return "growth"
        return None

    def sweep(self) -> int:
        """Collect everything but start-up's frozen objects: any cycle the request path made
        goes. Returns how many unreachable objects it found."""
        self.sweeps += 1
        return gc.collect(2)

    def resettle(self) -> int:
        """The one pass over everything, start-up's objects included, then freeze again: the
        old runtime a reload retired goes. Its open streams' objects freeze with the rest (freed
        by reference count as they end; a cycle among them would wait for the next reload)."""
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self.metrics.gc_frozen.set(gc.get_freeze_count())
        return found
