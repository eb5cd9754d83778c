"""Label children bound once per label set, for the metrics the request path touches.

prometheus_client's `labels(*values)` converts every value with `str`, takes the metric's lock
and looks the tuple up on every call: 2.7 us here, against 0.1 us for a dict lookup, and a
request touched a dozen children that way (reservation, release, decision, prefill backlog,
placement, accounting). The label values come from bounded sets (policy names, tenants, fixed
words), so the table stays small. A series removed from its metric must be forgotten here too
(`forget`), or later updates would go to a child no scrape reads: the money metrics' series are
removed when a reload changes a pool's currency.
"""

from __future__ import annotations

from typing import Any


class LabelChildren:
    __slots__ = ("_bound",)

    def __init__(self) -> None:
        self._bound: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def __call__(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, the same child every time."""
        key = (metric, values)
        child = self._bound.get(key)
        if child is None:
            child = self._bound[key] = metric.labels(*values)
        return child

    def forget(self, metric: Any, *values: str) -> None:
        """`metric.remove(*values)` was called: bind anew on the next use."""
        self._bound.pop((metric, values), None)
