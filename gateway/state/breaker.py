"""A circuit breaker in front of the shared store: a store that hangs costs one timeout, not
one per call.

A stopped Redis (a paused process, a network black hole) accepts connections and never
answers, so every call would wait out its timeout, request after request. A killed one
refuses at once; the breaker makes the hung one behave the same:

    closed     calls go through, each bounded by the state timeout. One that times out or
               cannot connect opens the breaker.
    open       every call fails at once (StateError), so admission's and quotas' fail modes
               apply without waiting. After `probe_interval_s` ...
    half-open  ... the next call goes through alone, as a probe, with the same timeout: its
               success closes the breaker, its failure opens it for another interval. Other
               calls meanwhile fail at once.

An answer of any kind (an error reply included) shows the store is there, and closes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = 0, 1, 2  # the values of gateway_state_breaker_state
NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half-open"}


def _ignore(old: int, new: int) -> None:
    return None


class Breaker:
    def __init__(self, probe_interval_s: float, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[int, int], None] = _ignore) -> None:
        self.probe_interval_s = probe_interval_s
        self.clock = clock
        self.on_change = on_change  # (old, new) on every transition
        self.state = CLOSED
        self.opened_at = 0.0  # the last failure
        self.outage_since = 0.0  # the failure that opened it from closed

    def admit(self) -> bool | None:
        """May a call go to the store now? None: no, fail at once. True: yes, as the probe
        (its outcome must be reported, or `abandoned` if it never got one). False: yes, as
        an ordinary call."""
        if self.state == CLOSED:
            return False
        if self.state == OPEN and self.clock() - self.opened_at >= self.probe_interval_s:
            self._set(HALF_OPEN)
            return True
        return None

    def succeeded(self) -> None:
        if self.state != CLOSED:
            self._set(CLOSED)

    def failed(self) -> None:
        self.opened_at = self.clock()
        if self.state == CLOSED:
            self.outage_since = self.opened_at
        if self.state != OPEN:
            self._set(OPEN)

    def abandoned(self, probe: bool | None) -> None:
        """The call was cancelled before the store answered (its caller went away): that says
        nothing of the store, so a probe's turn passes at once to the next call."""
        if probe and self.state == HALF_OPEN:
            self.opened_at = self.clock() - self.probe_interval_s
            self._set(OPEN)

    @property
    def outage_s(self) -> float:
        """How long the store has been out (0 while closed)."""
        return self.clock() - self.outage_since if self.state != CLOSED else 0.0

    def _set(self, state: int) -> None:
        old, self.state = self.state, state
        self.on_change(old, state)
