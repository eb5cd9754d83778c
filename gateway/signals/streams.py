"""Latency of the requests still in flight, read once a tick for the latency guard.

Completed requests report their TTFT and TPOT only when they end, which on an engine in
collapse is never (or a minute late): the guard would be blind exactly when it is needed. So
the guard also reads every stream the pool is serving now, as what its latency would be if it
ended at this instant: a stream without its first token has waited at least `now - started`
for it; a stream with a few tokens has a TPOT so far of `(now - first_byte) / (tokens - 1)`,
which keeps growing while the stream stalls. The proxy keeps `first_byte` and `sse_events` up to
date on its `Exchange`; reading them costs nothing on the per-chunk path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# A TPOT so far over fewer tokens is one inter-token gap, not a rate: a stream that got its
# first token just before an 8K-token prefill chunk would read as a stall of the whole pool.
MIN_TOKENS = 8


class StreamProgress(Protocol):
    """What the proxy knows of a stream as it goes (`gateway.proxy.Exchange`)."""

    first_byte: float | None
    sse_events: int


@dataclass(eq=False, slots=True)
class Watched:
    progress: StreamProgress
    started: float  # loop time the request was sent to its engine
    admitted_at: float  # admission clock: which limit admitted it


class LiveStreams:
    def __init__(self) -> None:
        self._watched: set[Watched] = set()

    def __len__(self) -> int:
        return len(self._watched)

    def add(self, progress: StreamProgress, started: float, admitted_at: float) -> Watched:
        w = Watched(progress, started, admitted_at)
        self._watched.add(w)
        return w

    def discard(self, w: Watched) -> None:
        self._watched.discard(w)

    def latencies(self, now: float, since: float) -> tuple[list[float], list[float]]:
        """(TTFTs, TPOTs) so far of the streams admitted at or after `since`."""
        ttfts: list[float] = []
        tpots: list[float] = []
        for w in self._watched:
            if w.admitted_at < since:
                continue
            p = w.progress
            if p.first_byte is None:
                ttfts.append(now - w.started)
                continue
            ttfts.append(p.first_byte - w.started)
            # sse_events counts the role frame, which arrives with the first token.
            tokens = p.sse_events - 1
            if tokens >= MIN_TOKENS:
                tpots.append((now - p.first_byte) / (tokens - 1))
        return ttfts, tpots


def count_over(values: list[float], line: float) -> int:
    return sum(1 for v in values if v > line)
