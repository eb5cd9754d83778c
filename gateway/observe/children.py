"""Label children bound once per label set, for the metrics the request path touches.

prometheus_client's `labels(*values)` converts every value with `str`, takes the metric's lock
and looks the tuple up on every call: 2.7 us here, against 0.1 us for a dict lookup, and a
request touched a dozen children that way (reservation, release, decision, prefill backlog,
placement, accounting). The label values come from bounded sets (policy names, tenants, fixed
words), so the table stays small. Only for metrics whose children are never removed: the
money metrics are (a reload can change a pool's currency) and keep their own path.
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
