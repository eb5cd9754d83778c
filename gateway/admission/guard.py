"""Latency guard: shrink a pool's in-flight token limit when its P99 crosses the SLO.

AIMD, as TCP does with its window: when the windowed P99 TTFT or TPOT is over its threshold
the limit is cut by `DECREASE` (at most once per `HOLD_S`, so one slow window is not punished
many times); while both are under, it grows back by `INCREASE` of the ceiling per tick. So
admission adapts between calibrations, before engines preempt.
"""

from __future__ import annotations

from dataclasses import dataclass

DECREASE = 0.7
INCREASE = 0.05
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
               ttft_max: float | None, tpot_max: float | None, samples: int) -> None:
        if samples < MIN_SAMPLES:
            return
        over = (ttft_max is not None and ttft_p99 is not None and ttft_p99 > ttft_max) or \
               (tpot_max is not None and tpot_p99 is not None and tpot_p99 > tpot_max)
        if over:
            self.state = "red"
            if now - self.last_cut >= HOLD_S:
                self.limit = max(self.floor, self.limit * DECREASE)
                self.last_cut = now
        else:
            self.state = "green"
            self.limit = min(self.ceiling, self.limit + self.ceiling * INCREASE)

    def rescale(self, ceiling: float, floor: float) -> None:
        """Capacity became known (or changed): keep the same fraction of the new ceiling."""
        fraction = self.limit / self.ceiling if self.ceiling else 1.0
        self.ceiling, self.floor = ceiling, floor
        self.limit = max(floor, min(ceiling, ceiling * fraction))
