"""Windowed latency quantiles from a mergeable sketch.

Each time slice keeps counts in fixed log-spaced buckets (5% apart, 0.5 ms to 20 min), so two
sketches merge by adding counts (across slices here, across replicas if shared) and a quantile
is accurate to one bucket, 5% relative. The window is a ring of slices; old slices are zeroed
as time moves on, so P99 follows the last `window_s` seconds, not all history.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable

_LOW = 0.0005
_RATIO = 1.05
_EDGES: list[float] = [_LOW * _RATIO**i for i in range(int(math.log(1200 / _LOW, _RATIO)) + 2)]


class WindowedQuantiles:
    def __init__(self, window_s: float = 30.0, slice_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slice_s = slice_s
        self.slices = max(1, math.ceil(window_s / slice_s))
        self.clock = clock
        self._counts = [[0] * (len(_EDGES) + 1) for _ in range(self.slices)]
        self._totals = [0] * self.slices
        self._epoch = [-1] * self.slices  # which slice number each ring entry holds

    def _slot(self, now: float) -> int:
        n = int(now // self.slice_s)
        i = n % self.slices
        if self._epoch[i] != n:
            if self._totals[i]:
                self._counts[i] = [0] * (len(_EDGES) + 1)
                self._totals[i] = 0
            self._epoch[i] = n
        return i

    def clear(self) -> None:
        """Forget every sample: the window starts again from now."""
        for i in range(self.slices):
            if self._totals[i]:
                self._counts[i] = [0] * (len(_EDGES) + 1)
                self._totals[i] = 0

    def observe(self, value: float) -> None:
        i = self._slot(self.clock())
        self._counts[i][bisect.bisect_left(_EDGES, value)] += 1
        self._totals[i] += 1

    def merged(self) -> tuple[list[int], int]:
        now_slice = int(self.clock() // self.slice_s)
        merged = [0] * (len(_EDGES) + 1)
        total = 0
        for i in range(self.slices):
            if self._totals[i] and now_slice - self._epoch[i] < self.slices:
                total += self._totals[i]
                for j, c in enumerate(self._counts[i]):
                    if c:
                        merged[j] += c
        return merged, total

    def count(self) -> int:
        return self.merged()[1]

    def count_over(self, value: float) -> int:
        """Samples in the window above `value` (to one bucket, 5%)."""
        merged, _ = self.merged()
        return sum(merged[bisect.bisect_left(_EDGES, value) + 1:])

    def quantile(self, q: float) -> float | None:
        """The q-quantile over the window (upper bucket edge), or None with no samples."""
        merged, total = self.merged()
        if total == 0:
            return None
        rank = max(1, math.ceil(q * total))
        seen = 0
        for j, c in enumerate(merged):
            seen += c
            if seen >= rank:
                return _EDGES[j] if j < len(_EDGES) else _EDGES[-1]
        return _EDGES[-1]
