"""Keeping garbage collection out of the streams' way.

A full collection traverses every tracked object in the process while every stream waits. An
open stream keeps about 140 of them alive (uvicorn's and aiohttp's per-connection callbacks,
the coroutines of its await chain, the request's own objects), so a full collection held the
loop 6-10 ms at 300 open streams and 100-250 ms at 1,000 (measured here, issue 21), and
Python's own thresholds take several a minute under load. Those traversals find nothing: over
4,300 streamed requests the collector freed no object in any generation after start-up
(`gc.get_stats()`), because the request path makes no reference cycles.

So every `server.gc_freeze_interval_s`, and after every young collection, the keeper moves
whatever has survived into the permanent generation (`gc.freeze()`, O(1)). Automatic
collections then traverse only what was born since; a frozen object is still freed by its
reference count when its stream ends. The interval alone let the survivors of several young
collections pile up in the middle generation between freezes, and at 1,000 open streams its
collections (every tenth young one) walked them for up to 10-25 ms; frozen as they survive,
the middle generation stays empty. The interval still bounds the young generation: Python
collects it when allocations minus deallocations pass 700, and frozen objects freed as their
streams end count as deallocations, so young survivors can pile up there too. What
freezing gives up is collecting a reference cycle among frozen objects, so every
`server.gc_sweep_interval_s` the keeper unfreezes everything and collects once in full: one
pause of the whole heap's size (start-up's tables included) where Python would otherwise take
dozens, and a cycle a rare path makes lives at most that long. It is the one stall over
10 ms left (60-80 ms at 300 open streams), so a sweep that finds little doubles the wait for
the next (up to 16 times), and one that falls due waits for a moment with no request open,
for up to one more interval: under unbroken load it comes at most that late, and wherever
traffic pauses it stalls nobody.
`gateway_gc_collected_objects_total` counts what collections find, so a path that starts to
make cycles shows there.
"""

from __future__ import annotations

import asyncio
import gc
import traceback
from collections.abc import Callable

from gateway.observe.metrics import GatewayMetrics

SWEEP_FOUND_RESET = 1_000  # a sweep finding this many objects in cycles resets the backoff
SWEEP_BACKOFF_MAX = 16  # sweeps at least every 16 x gc_sweep_interval_s (~2.7 h by default)


class HeapKeeper:
    def __init__(self, metrics: GatewayMetrics, freeze_interval_s: float,
                 sweep_interval_s: float, open_requests: Callable[[], int] = lambda: 0
                 ) -> None:
        self.metrics = metrics
        self.freeze_interval_s = freeze_interval_s
        self.sweep_interval_s = sweep_interval_s
        self.open_requests = open_requests  # requests in flight now (a sweep waits for none)
        self.sweeps = 0
        self._sweeping = False  # an unfreeze is to be collected, not frozen again

    def install(self) -> None:
        """Freeze the survivors of each young collection as it ends (off with the keeper)."""
        if self.freeze_interval_s > 0:
            gc.callbacks.append(self._after_collection)

    def uninstall(self) -> None:
        if self._after_collection in gc.callbacks:
            gc.callbacks.remove(self._after_collection)

    def _after_collection(self, phase: str, info: dict[str, int]) -> None:
        # Called by the collector with its work done: the generations' lists are whole, and
        # `collecting` is still set, so nothing here can start another collection.
        if phase == "stop" and info["generation"] == 0 and not self._sweeping:
            gc.freeze()

    def settle(self) -> None:
        """After start-up: collect what loading left behind, freeze the rest (imports, the
        tokenizers' tables, the policy) out of every later collection."""
        gc.collect()
        gc.freeze()
        self.metrics.gc_frozen.set(gc.get_freeze_count())

    async def run(self) -> None:
        if self.freeze_interval_s <= 0:
            return  # off: Python's own thresholds decide, over the whole heap
        loop = asyncio.get_running_loop()
        interval = self.sweep_interval_s
        next_sweep = loop.time() + interval
        while True:
            await asyncio.sleep(self.freeze_interval_s)
            now = loop.time()
            if now >= next_sweep and (not self.open_requests()
                                      or now >= next_sweep + interval):
                # A sweep walks the whole heap (~60-80 ms at 300 open streams here): one that
                # found nothing doubles the wait for the next, up to SWEEP_BACKOFF_MAX times
                # the policy's; one that found garbage brings it back.
                found = self.sweep()
                interval = self.sweep_interval_s if found >= SWEEP_FOUND_RESET else \
                    min(interval * 2, self.sweep_interval_s * SWEEP_BACKOFF_MAX)
                next_sweep = now + interval
                continue
            # No count of the frozen here: `gc.get_freeze_count()` walks the frozen list, one
            # cold pointer per object, with the loop held: 4-11 ms at 67,000-103,000 objects
            # (300 open streams), the stall over 10 ms that came every 15 s when the gauge was
            # brought up to date on this loop. It is counted where the heap is walked anyway.
            gc.freeze()

    def sweep(self) -> int:
        """The one full pass over everything: any cycle among the formerly frozen goes.
        Returns how many unreachable objects it found."""
        self._sweeping = True
        self.sweeps += 1
        try:
            gc.unfreeze()
            found = gc.collect()
        finally:
            self._sweeping = False
        gc.freeze()
        self.metrics.gc_frozen.set(gc.get_freeze_count())
        return found


def forget(exc: BaseException | None) -> None:
    """Break the reference cycles a caught exception closes, so its reference count frees it.

    A traceback holds the frames the exception passed through, and a frame that still holds
    the exception (aiohttp keeps the cause in a local while it wraps it in its own error)
    closes a cycle that only a full collection frees: with the heap frozen, the next sweep.
    Called where the gateway catches an engine's connect or read error, once it has taken the
    words it logs. Clearing the frame we are in fails and is skipped, as it must be.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
