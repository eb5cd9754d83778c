"""Latency guard: shrink a pool's in-flight token limit when its P99 crosses the SLO.

AIMD, as TCP does with its window. When the P99 TTFT or TPOT (of the window's completed
requests and the streams in flight together) is over its line, the limit is cut to `DECREASE`
of the tokens in flight (at most once per `HOLD_S`); the caller then restarts its latency
windows and judges the new limit only by the requests it admits, so one slow period is
punished once, not for as long as it stays in a window. While both are under, the limit grows
by `INCREASE` of the ceiling per tick (additive: a limit cut deep by a start-up burst is back
in seconds, not in the minute that growing by a share of itself takes), but only while it
binds (the tokens in flight are near it): a limit that grew during a lull would let the next
burst in whole (the rule RFC 7661 gives TCP for windows it is not using). So admission adapts
between calibrations, before engines preempt, and holds a pool where its latency SLOs are
met."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

DECREASE = 0.7
INCREASE = 0.05
BINDING = 0.8  # in flight at least this share of the limit: the limit is what holds load back
HOLD_S = 5.0
MIN_GREEN = 5  # fewer fresh samples than this, and none over its line: no verdict yet
MIN_SAMPLES = 20  # from this many, a sample or two over the line (under 1%) is still green
# Red only when a P99 truly on its line would show this many samples over it less often than
# this: the guard judges every second on overlapping windows, and a line calibrated at the
# knee's own P99 has 1% of samples over it at the knee by definition.
FALSE_ALARM = 0.01

Verdict = Literal["red", "green", "unsure"]


def verdict(over: int, samples: int) -> Verdict:
    """Is the P99 over its line, given `over` of `samples` above it?

    Red when so many are over that a P99 on the line would rarely (`FALSE_ALARM`) show it: 2
    of 8, 3 of 20, 9 of 300. Judged on the share alone ("more than 1%"), a pool held at its
    knee would be red one tick in four. Green needs a few samples and none over, or enough
    samples to call 1% of them noise; anything between is no verdict, and the limit holds.
    """
    if over >= 2 and _tail(over, samples, 0.01) < FALSE_ALARM:
        return "red"
    if over > max(1, samples // 100):
        return "unsure"
    if (over == 0 and samples >= MIN_GREEN) or samples >= MIN_SAMPLES:
        return "green"
    return "unsure"


def _tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), in logs: comb(n, k) overflows a float by n ~ 1,500."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    lp, lq, lgn = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    below = sum(math.exp(lgn - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp
                         + (n - i) * lq) for i in range(k))
    return max(0.0, 1.0 - below)


def combine(*verdicts: Verdict) -> Verdict:
    """Red if any is red; green only if all are."""
    if "red" in verdicts:
        return "red"
    return "green" if all(v == "green" for v in verdicts) else "unsure"


@dataclass
class LatencyGuard:
    ceiling: float  # the static in-flight token limit (or the pool's KV token capacity)
    floor: float  # never below this: one long request must still get through
    limit: float = 0.0
    last_cut: float = -1e9
    state: str = "green"

    def __post_init__(self) -> None:
        self.limit = self.ceiling

    def update(self, now: float, verdict: Verdict, inflight: float | None = None) -> bool:
        """One tick's verdict; True when it cut the limit."""
        if verdict == "unsure":
            return False
        if verdict == "red":
            self.state = "red"
            if now - self.last_cut < HOLD_S:
                return False
            # Cut what is in flight: a limit far above the load (the ceiling, at first) would
            # otherwise be cut again and again before it held anything back.
            base = self.limit if not inflight else min(self.limit, inflight)
            self.limit = max(self.floor, base * DECREASE)
            self.last_cut = now
            return True
        self.state = "green"
        if inflight is None or inflight >= BINDING * self.limit:
            self.limit = min(self.ceiling, self.limit + INCREASE * self.ceiling)
        return False

    def rescale(self, ceiling: float, floor: float) -> None:
        """Capacity became known (or changed): keep the same fraction of the new ceiling."""
        fraction = self.limit / self.ceiling if self.ceiling else 1.0
        self.ceiling, self.floor = ceiling, floor
        self.limit = max(floor, min(ceiling, ceiling * fraction))
