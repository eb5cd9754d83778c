"""Latency of the requests still in flight, read once a tick for the latency guard.

Completed requests report their TTFT and TPOT only when they end, which on an engine in
collapse is never (or a minute late): the guard would be blind exactly when it is needed. So
the guard also reads every stream the pool is serving now, as what its latency would be if it
ended at this instant: a stream without its first token has waited at least `now - started`
for it (a bound its final TTFT cannot beat). A stream with a few tokens is judged by the TPOT
it is heading for: the time it has spent decoding, plus its expected remaining tokens at the
pool's typical pace, over all its tokens. Its TPOT so far alone would not do: the line is a
P99 of whole requests, and a dozen tokens that shared one step with an 8K-token prefill chunk
read far over it while the request as a whole ends well under (a third of young streams on a
70B engine at its knee). A stalled stream still grows its projection every second it stalls.
The proxy keeps `first_byte` and `sse_events` up to date on its `Exchange`; reading them costs
nothing on the per-chunk path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# A TPOT so far over fewer tokens is one inter-token gap, not a rate: a stream that got its
# first token just before an 8K-token prefill chunk would read as a stall of the whole pool.
MIN_TOKENS = 8
# A stream in flight counts as over the TPOT line only at this multiple of it. Its figure is
# neither final nor independent of the others: streams in flight share the same engine steps,
# so one prefill burst moves them all at once, and at the knee two of fifteen young streams
# read over a line the finished requests meet. A collapse (ten times the line) still shows.
TPOT_MARGIN = 2.0


class StreamProgress(Protocol):
    """What the proxy knows of a stream as it goes (`gateway.upstream.Relay`); read-only here,
    so the fleet simulation can hand in its engine's requests (loadtest/fleet.py)."""

    @property
    def first_byte(self) -> float | None: ...

    @property
    def sse_events(self) -> int: ...


@dataclass(eq=False, slots=True)
class Watched:
    progress: StreamProgress
    started: float  # loop time the request was sent to its engine
    admitted_at: float  # admission clock: which limit admitted it
    expected_tokens: int = 0  # output tokens the cost model expects of it


class LiveStreams:
    def __init__(self) -> None:
        self._watched: set[Watched] = set()

    def __len__(self) -> int:
        return len(self._watched)

    def add(self, progress: StreamProgress, started: float, admitted_at: float,
            expected_tokens: int = 0) -> Watched:
        w = Watched(progress, started, admitted_at, expected_tokens)
        self._watched.add(w)
        return w

    def discard(self, w: Watched) -> None:
        self._watched.discard(w)

    def latencies(self, now: float, since: float, pace: float = 0.0,
                  ) -> tuple[list[float], list[float]]:
        """(TTFTs so far, projected TPOTs) of the streams admitted at or after `since`; `pace`
        is the pool's typical time per output token (0 when unknown: a lower bound then)."""
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
                ahead = max(0, w.expected_tokens - tokens)
                tpots.append((now - p.first_byte + ahead * pace) / (tokens - 1 + ahead))
        return ttfts, tpots


def count_over(values: list[float], line: float) -> int:
    return sum(1 for v in values if v > line)
