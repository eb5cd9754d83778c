"""Traffic for the fleet simulation: the conversation traces, at the rate a fleet needs.

Two shapes:
- `poisson`: the trace's lengths in its order, Poisson arrivals at a rate, seeded exactly as
  `loadtest run --arrival poisson --seed S` draws them (loadtest/workload.py's
  `arrival_times`), so the validation replays the real-process benchmark's own requests;
- `superposed`: the trace's own arrival pattern scaled up. One Azure hour is 19,366 requests
  (5.5 a second); a 125-replica fleet takes hundreds a second. So K copies of the trace are
  laid over each other, each rotated by its own random phase (a copy's arrivals shifted by a
  random offset, wrapping at the trace's end, so copies do not burst together), the merged
  hour compressed into the run's duration, and thinned at random to the asked rate
  (K = rate x duration / the trace's requests, rounded up; each request kept with
  probability rate x duration / (K x requests)). Each request keeps its own prompt and output
  lengths; the trace's slow swings (its busier and quieter minutes) stay, compressed.

The long-context share: each request is, with that probability, replaced by one drawn from
the Mooncake conversation trace's requests of 8,192 prompt tokens or more (prompts capped to
fit the pool's context, outputs at 1,500 as benchmarks/admission_goodput.py caps them), so the
share can be set from 0 to 1 whatever the base trace's own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

from gateway.cost.traces import TraceRequest, read_trace
from loadtest.fleet import Job
from loadtest.workload import Arrival, arrival_times

# The repository's traces (traces/README.md): a clone has them; an installed package does not.
TRACES = Path(__file__).resolve().parent.parent / "traces"
AZURE = TRACES / "azure_llm_2023_conv.csv.xz"
MOONCAKE = TRACES / "mooncake_conversation.jsonl.xz"
LONG_PROMPT = 8192
LONG_OUTPUT_MAX = 1500


def load(path: Path | str) -> list[TraceRequest]:
    return read_trace(str(path))


def long_requests(path: Path | str, max_model_len: int) -> list[tuple[int, int]]:
    """(prompt, output) of the trace's requests with prompts of LONG_PROMPT tokens or more."""
    out = []
    for r in load(path):
        if r.prompt_tokens >= LONG_PROMPT:
            output = max(1, min(r.output_tokens, LONG_OUTPUT_MAX))
            out.append((min(r.prompt_tokens, max_model_len - output - 64), output))
    return out


def poisson(trace: Sequence[TraceRequest], rate: float, duration_s: float,
            seed: int = 1) -> list[Job]:
    """`loadtest run --trace T --rate R --arrival poisson --duration D --seed S`'s requests."""
    times = arrival_times(Arrival("poisson"), rate, 10**9, duration_s, random.Random(seed))
    return [Job(t, max(1, trace[i % len(trace)].prompt_tokens),
                max(1, trace[i % len(trace)].output_tokens)) for i, t in enumerate(times)]


def superposed(trace: Sequence[TraceRequest], rate: float, duration_s: float,
               seed: int = 1) -> list[Job]:
    """The trace laid over itself and compressed to `rate` requests/s for `duration_s`."""
    if rate <= 0 or duration_s <= 0 or not trace:
        return []
    rng = random.Random(seed)
    span = max(r.arrival_s for r in trace) or 1.0
    copies = max(1, math.ceil(rate * duration_s / len(trace)))
    compress = span / duration_s  # trace seconds per simulated second: the hour in the run
    keep = rate * duration_s / (copies * len(trace))  # thins the copies to the asked rate
    merged: list[tuple[float, int, int]] = []
    for _ in range(copies):
        phase = rng.uniform(0, span)
        for r in trace:
            if rng.random() < keep:
                t = (r.arrival_s + phase) % span / compress
                merged.append((t, max(1, r.prompt_tokens), max(1, r.output_tokens)))
    merged.sort()
    return [Job(t, p, o) for t, p, o in merged]


def with_long_share(jobs: Sequence[Job], share: float, long: Sequence[tuple[int, int]],
                    seed: int = 2) -> list[Job]:
    """Each job replaced, with probability `share`, by a long request (same arrival)."""
    if share <= 0 or not long:
        return list(jobs)
    rng = random.Random(seed)
    out = []
    for job in jobs:
        if rng.random() < share:
            p, o = long[rng.randrange(len(long))]
            job = Job(job.at, p, o)
        out.append(job)
    return out
