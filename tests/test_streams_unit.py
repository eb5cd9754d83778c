"""The latency guard's view of streams still in flight (gateway/signals/streams.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.signals.streams import MIN_TOKENS, LiveStreams, count_over


@dataclass
class Progress:
    first_byte: float | None = None
    sse_events: int = 0


def test_streams_in_flight_report_latency_so_far() -> None:
    live = LiveStreams()
    waiting = Progress()                                  # no first token after 9 s
    going = Progress(first_byte=101.0, sse_events=1 + 21)  # role frame + 21 tokens in 8 s
    young = Progress(first_byte=108.5, sse_events=1 + 2)   # too few tokens for a rate
    old = Progress()                                      # admitted before the last cut
    live.add(waiting, started=100.0, admitted_at=50.0)
    live.add(going, started=100.0, admitted_at=50.0)
    live.add(young, started=108.0, admitted_at=58.0)
    gone = live.add(old, started=90.0, admitted_at=40.0)
    ttfts, tpots = live.latencies(now=109.0, since=45.0)
    assert sorted(ttfts) == [0.5, 1.0, 9.0]
    assert tpots == [8.0 / 20]
    assert 2 < MIN_TOKENS
    live.discard(gone)
    assert len(live) == 3
    assert count_over([3.0, 1.0, 2.0], 1.5) == 2 and count_over([], 1.0) == 0
