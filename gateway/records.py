"""`record`: the request path's immutable records, at the cost of plain ones.

A frozen dataclass sets each field in `__init__` through `object.__setattr__` (a global
lookup and a generic attribute set by name): 8 fields cost 1.0 us here against 0.2 us for a
plain slots dataclass, and a request builds ~18 such records before it goes upstream (its
inbound, caller, prompt, count, route, work, the admission's views and decision, the lease,
the upstream request). Built plain, the gateway's work before upstream fell ~80 us cold, ~0.88x
(docs/benchmarks-proxy.md, tenth round).

To the type checker a `record` is a frozen slots dataclass (PEP 681's `frozen_default`:
assigning a field is a mypy error, and `make typecheck` holds the code to it); at run time it
is a slots dataclass with the same `__eq__` and `__hash__` as the frozen one would have. Kept
for records made per request; configuration and values handed to callers stay frozen
dataclasses, which also refuse assignment at run time.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def record(cls: type[T]) -> type[T]:
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)


__all__ = ["record"]
