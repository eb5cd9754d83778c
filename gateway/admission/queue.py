"""The waiting room of one pool: priority classes first, then fairness between callers.

Within a class, the next request is the one whose caller has been served the fewest tokens
(a virtual token counter, as in "Fairness in Serving Large Language Models", OSDI '24), not
the one that came first: a caller sending a flood of long prompts cannot starve the others.
A newcomer starts at the smallest counter among those waiting, so idling earns no credit.

When the room is full, a newcomer may push out the last waiter of a lower class: sheddable
traffic goes first.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

PRIORITIES: dict[str, int] = {"critical": 0, "standard": 1, "sheddable": 2}
PRIORITY_NAMES: dict[int, str] = {v: k for k, v in PRIORITIES.items()}


@dataclass(eq=False)
class Waiter:
    priority: int
    caller: str
    tokens: int  # the work it brings, for fairness and the wait prediction
    enqueued: float
    deadline: float
    future: asyncio.Future[str]
    seq: int = 0
    ask: Any = None  # what the dispatcher needs to admit it
    ticket: Any = None  # set by the dispatcher with the future's result


class FairQueue:
    def __init__(self, size: int) -> None:
        self.size = size
        self.waiters: list[Waiter] = []
        self.served: dict[str, float] = {}  # virtual token counter per caller
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.waiters)

    def _key(self, w: Waiter) -> tuple[int, float, int]:
        return (w.priority, self.served.get(w.caller, 0.0), w.seq)

    def ordered(self) -> list[Waiter]:
        return sorted(self.waiters, key=self._key)

    def depth_by_priority(self) -> dict[str, int]:
        counts = dict.fromkeys(PRIORITIES, 0)
        for w in self.waiters:
            counts[PRIORITY_NAMES[w.priority]] += 1
        return counts

    def work_ahead(self, priority: int, caller: str) -> int:
        """Tokens of the waiters that would be served before a newcomer like this one."""
        mine = (priority, self._lift(caller))
        return sum(w.tokens for w in self.waiters
                   if (w.priority, self.served.get(w.caller, 0.0)) <= mine)

    def _lift(self, caller: str) -> float:
        floor = min((self.served.get(w.caller, 0.0) for w in self.waiters), default=0.0)
        return max(self.served.get(caller, 0.0), floor)

    def admits(self, priority: int) -> bool:
        """Would `push` take a newcomer of `priority`: room, or a less important waiter to
        push out?"""
        return len(self.waiters) < self.size or any(w.priority > priority
                                                    for w in self.waiters)

    def push(self, w: Waiter) -> Waiter | None:
        """Add a waiter; return the one pushed out to make room, if any (or `w` itself)."""
        self.served[w.caller] = self._lift(w.caller)
        w.seq = next(self._seq)
        evicted = None
        if len(self.waiters) >= self.size:
            worst = max(self.waiters, key=self._key, default=None)
            if worst is None or worst.priority <= w.priority:
                return w  # nobody less important to push out: the newcomer is refused
            self.waiters.remove(worst)
            evicted = worst
        self.waiters.append(w)
        return evicted

    def remove(self, w: Waiter) -> None:
        if w in self.waiters:
            self.waiters.remove(w)

    def head(self) -> Waiter | None:
        return min(self.waiters, key=self._key, default=None)

    def charge(self, caller: str, tokens: int) -> None:
        self.served[caller] = self.served.get(caller, 0.0) + tokens
        if len(self.served) > 10_000:  # bounded: forget callers with nothing waiting
            waiting = {w.caller for w in self.waiters}
            self.served = {c: v for c, v in self.served.items() if c in waiting}
