"""The latency guard's view of streams still in flight (gateway/signals/streams.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

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


def test_a_young_stream_is_judged_by_the_tpot_it_is_heading_for() -> None:
    live = LiveStreams()
    # 9 tokens in 2.4 s (one step shared with a prefill chunk): 0.3 s a token so far, over a
    # 0.24 s line; but 200 tokens are expected, and at the pool's pace of 0.1 s the request
    # ends near 0.11 s a token.
    young = Progress(first_byte=100.0, sse_events=1 + 9)
    live.add(young, started=99.0, admitted_at=99.0, expected_tokens=200)
    _, (tpot,) = live.latencies(now=102.4, since=0.0, pace=0.1)
    assert tpot == pytest.approx((2.4 + 191 * 0.1) / (8 + 191))
    assert count_over([tpot], 0.24) == 0
    # Unknown pace: the bound that the remaining tokens cannot undercut.
    _, (bound,) = live.latencies(now=102.4, since=0.0)
    assert bound == pytest.approx(2.4 / 199)
    # A stall keeps raising it: 60 s without a token is over the line however it ends.
    _, (stalled,) = live.latencies(now=162.4, since=0.0, pace=0.1)
    assert stalled > 0.24
    # Past its expected length, a stream is judged by its own pace.
    done = Progress(first_byte=100.0, sse_events=1 + 300)
    live.add(done, started=99.0, admitted_at=99.0, expected_tokens=200)
    _, tpots = live.latencies(now=130.0, since=0.0, pace=0.1)
    assert pytest.approx(30.0 / 299) in tpots
