"""Percentiles and small summaries for load-test figures."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return percentile_sorted(ordered, q)


def percentile_sorted(ordered: Sequence[float], q: float) -> float:
    """`percentile` for values already sorted ascending (sort once, ask many quantiles)."""
    if not ordered:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def quantiles(values: Iterable[float], qs: Sequence[float] = (50.0, 90.0, 99.0)
              ) -> dict[float, float]:
    ordered = sorted(values)
    return {q: percentile_sorted(ordered, q) for q in qs}


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)
