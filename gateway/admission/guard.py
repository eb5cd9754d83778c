"""Latency guard: shrink a pool's in-flight token limit when its P99 crosses the SLO.

AIMD, as TCP does with its window. When the windowed P99 TTFT or TPOT is over its threshold
the limit is cut to `DECREASE` of the tokens in flight (at most once per `HOLD_S`); the caller
then restarts its latency windows and judges the new limit only by the requests it admits, so
one slow period is punished once, not for as long as it stays in a window. While both P99s are
under, the limit grows by `INCREASE` of itself per tick, but only while it binds (the tokens in
flight are near it): a limit that grew during a lull would let the next burst in whole (the
rule RFC 7661 gives TCP for windows it is not using). So admission adapts between calibrations,
before engines preempt, and holds a pool where its latency SLOs are met.
"""

from __future__ import annotations

from dataclasses import dataclass

DECREASE = 0.7
INCREASE = 0.05
BINDING = 0.8  # in flight at least this share of the limit: the limit is what holds load back
HOLD_S = 5.0
MIN_SAMPLES = 20


@dataclass
class LatencyGuard:
    ceiling: float  # the static in-flight token limit (or the pool's KV token capacity)
    floor: float  # never below this: one long request must still get through
    limit: float = 0.0
    last_cut: float = -1e9
    state: str = "green"

    def __post_init__(self) -> None:
        self.limit = self.ceiling

    def update(self, now: float, ttft_p99: float | None, tpot_p99: float | None,
               ttft_max: float | None, tpot_max: float | None, samples: int,
               inflight: float | None = None) -> bool:
        """One tick's verdict; True when it cut the limit."""
        if samples < MIN_SAMPLES:
            return False
        over = (ttft_max is not None and ttft_p99 is not None and ttft_p99 > ttft_max) or \
               (tpot_max is not None and tpot_p99 is not None and tpot_p99 > tpot_max)
        if over:
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
            self.limit = min(self.ceiling, self.limit * (1 + INCREASE))
        return False

    def rescale(self, ceiling: float, floor: float) -> None:
        """Capacity became known (or changed): keep the same fraction of the new ceiling."""
        fraction = self.limit / self.ceiling if self.ceiling else 1.0
        self.ceiling, self.floor = ceiling, floor
        self.limit = max(floor, min(ceiling, ceiling * fraction))
