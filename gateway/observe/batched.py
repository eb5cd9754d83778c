"""Histogram observations kept as plain counts on the request path, added to the metric in
batches.

prometheus_client's `Histogram.observe` checks the metric, takes its value lock twice (the
sum and the bucket) and walks the bounds in Python: ~1.3 us here, and a served request
observes eight stages (gateway/pipeline/). At 1,000 streams those observations were ~4.7%
of the worker's samples (py-spy, docs/benchmarks-proxy.md), where the issue allows the stage
histogram 2% of the gateway's CPU. Here an observation is one `bisect` and two additions; it
is made on the event loop's thread only, so nothing is locked. `flush` adds what was counted
to the histogram's own values: the loop-lag monitor calls it every tick (0.1 s) and `/metrics`
before it renders, so a scrape misses nothing its process observed, and with `--workers` the
other processes' observations are at most a tick old.

The child's values are prometheus_client's own attributes (`_upper_bounds`, `_buckets`,
`_sum`): a release without them gets the child's plain `observe`, and
tests/test_batched_observe.py holds the batches to what observing each value gives (the
sum to its float rounding).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Any

Observe = Callable[[float], None]


class BatchedObserve:
    """One histogram child's observations since the last `flush`, by bucket."""

    __slots__ = ("_bounds", "_buckets", "_counts", "_sum", "_total")

    def __init__(self, bounds: list[float], buckets: list[Any], total: Any) -> None:
        self._bounds = bounds  # upper bounds, +Inf last, as the child holds them
        self._buckets = buckets
        self._total = total
        self._counts = [0] * len(bounds)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        # The first bound at or above the amount, as the child's `observe` picks it.
        self._counts[bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def flush(self) -> None:
        if not any(self._counts):  # nothing observed since the last flush (an idle tick)
            return
        counts, self._counts = self._counts, [0] * len(self._bounds)
        amount, self._sum = self._sum, 0.0
        for bucket, n in zip(self._buckets, counts, strict=True):
            if n:
                bucket.inc(n)
        self._total.inc(amount)


def batched(child: Any, batches: list[BatchedObserve]) -> Observe:
    """An observe function for a histogram child: batched (and added to `batches`, which the
    owner flushes) where the child's values are as expected, else the child's own."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if not (isinstance(bounds, list) and isinstance(buckets, list)
            and len(bounds) == len(buckets) and hasattr(total, "inc")
            and all(hasattr(b, "inc") for b in buckets)):
        observe: Observe = child.observe
        return observe
    batch = BatchedObserve(bounds, buckets, total)
    batches.append(batch)
    return batch.observe
