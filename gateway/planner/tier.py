"""The gateway tier's size: gateway workers and Redis shards for a fleet and a request rate.

Every constant below was measured, once, in one place; this module is the only copy, read by
`gateway plan` and by the fleet simulation (`loadtest fleet`, which also draws each request's
time in the gateway from `TierDelay`). Measured on 2026-12-01 on the project's 2-core
development machine (shared with other work while it ran), Python 3.11, Redis 7.0, loopback:

- benchmarks/state_cost.py (docs/benchmarks.md, "The shared state's cost (issue 22)"):
  requests per gateway CPU-second as shipped, Lua calls per request, Redis CPU per request;
- benchmarks/proxy_overhead.py (docs/benchmarks-proxy.md): SSE chunks one worker relays per
  CPU-second, the TTFT the gateway adds (P50, P99), and the stream count a worker's stall goal
  holds at (100 streams yes, 300 no).

The sizing rule (docs/operations.md, "Sizing the gateway tier"), for R requests/s of which each
streams T output tokens on average, C streams open at once, B backends in the pool:

  workers = max(ceil(R x (1/RPS_PER_CPU + T/CHUNKS_PER_CPU + (B-1) x DECISION_S_PER_BACKEND)
                     / CPU_TARGET),
                ceil(C / STREAMS_PER_WORKER))
  shards  = max(1, ceil((R x REDIS_US_PER_REQUEST + workers x REDIS_US_PER_WORKER_S
                         + C x REDIS_US_PER_LEASE_S) / 1e6 / REDIS_TARGET))

A pool's leases live on one shard (their keys share the pool's hash tag), so one pool's
admission can use at most one shard: `pool_shard_share` says how much of it the pool's
reserve and release take, and past REDIS_TARGET the pool must be split in two.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MEASURED = "2026-12-01, 2-core shared dev machine, Python 3.11, Redis 7.0, loopback"

# Requests per gateway CPU-second as shipped (exact tokenizer and chat template, admission,
# access log; non-streamed 4-token answers): the low end of two runs' ranges.
RPS_PER_CPU = {"memory": 1692.0, "redis": 1263.0, "redis+quota": 694.0}
# SSE chunks relayed per gateway CPU-second: 19,784 chunks/s at 58% of a core (the lower of the
# two figures; 38,418 at 91% is 42,200 per CPU-second).
CHUNKS_PER_CPU = 34_100.0
# Open streams per worker: the stall goal (no stream stalled > 10 ms beyond its token
# interval) held at 100 and not at 300. The HPA targets 60 (deploy/k8s/hpa.yaml), which
# leaves room for a burst above the planned load.
STREAMS_PER_WORKER = 100
CPU_TARGET = 0.6  # of a worker's core: event-loop lag stays low below it
# The admission decision looks at every backend of the pool (its view: KV headroom, the
# engine's report, the prefill backlog): 8.4 us at 1 backend, 44 at 16, 293 at 125, 603 at 250
# (`Admission.view` + `decide` in a loop, tests' fleet policy; the figures above were taken
# at one backend, so only the backends beyond it are added).
DECISION_S_PER_BACKEND = 2.35e-6
# Redis CPU per request, measured from the gateway runs (the upper end of the ranges).
REDIS_US_PER_REQUEST = {"memory": 0.0, "redis": 69.0, "redis+quota": 217.0}
LUA_CALLS_PER_REQUEST = {"memory": 0, "redis": 2, "redis+quota": 6}
# Per worker and second whatever its load: usage, refresh and heartbeat, ~20 us each
# (redis-benchmark, pipelined: ~20 us of Redis per script).
REDIS_US_PER_WORKER_S = 3 * 20.0
# Each live lease is one ZADD XX a second inside its worker's refresh. Not measured alone;
# taken as a tenth of a script's ~20 us (a command inside a script, not a script).
REDIS_US_PER_LEASE_S = 2.0
REDIS_TARGET = 0.7  # of a shard's one thread
# The time a request spends in the gateway before it reaches an engine: TTFT added at 100
# streams, P50 and P99 (docs/benchmarks-proxy.md), and the gateway's CPU per Lua call in
# redis-py (0.14-0.16 ms), each call one sequential round trip on the request's path.
ADDED_P50_S = 0.46e-3
ADDED_P99_S = 1.56e-3
LUA_CALL_S = 0.15e-3
_Z99 = 2.3263478740408408


@dataclass(frozen=True, slots=True)
class TierDelay:
    """A request's time in the gateway tier before admission: lognormal through the measured
    P50 and P99 of the TTFT the gateway adds, plus its Lua calls' round trips."""

    state: str = "redis"
    p50_s: float = ADDED_P50_S
    p99_s: float = ADDED_P99_S

    def draw(self, rng: random.Random) -> float:
        sigma = math.log(self.p99_s / self.p50_s) / _Z99
        return rng.lognormvariate(math.log(self.p50_s), sigma) \
            + LUA_CALLS_PER_REQUEST[self.state] * LUA_CALL_S


@dataclass(frozen=True, slots=True)
class TierSize:
    """What `size_tier` derived, with the figures it derived it from."""

    state: str
    backends: int
    rate: float
    output_tokens: float
    streams: float
    cpu_per_request_s: float
    workers_for_cpu: int
    workers_for_streams: int
    workers: int
    redis_us_per_s: float
    shards: int
    pool_shard_share: float  # of one shard's thread: what one pool's reserve + release take

    def to_dict(self) -> dict[str, float | int | str]:
        return {k: getattr(self, k) for k in self.__slots__}


def size_tier(rate: float, output_tokens: float, streams: float,
              state: str = "redis+quota", backends: int = 1) -> TierSize:
    """Workers and shards for `rate` requests/s streaming `output_tokens` each on average, with
    `streams` open at once (Little's law: rate x mean seconds a request lasts), in front of a
    pool of `backends` engine replicas."""
    if state not in RPS_PER_CPU:
        raise ValueError(f"state: expected one of {', '.join(RPS_PER_CPU)}, got {state!r}")
    if not (rate >= 0 and output_tokens >= 0 and streams >= 0):
        raise ValueError("rate, output_tokens and streams must not be negative")
    cpu = (1.0 / RPS_PER_CPU[state] + output_tokens / CHUNKS_PER_CPU
           + max(0, backends - 1) * DECISION_S_PER_BACKEND)
    for_cpu = math.ceil(rate * cpu / CPU_TARGET - 1e-9)
    for_streams = math.ceil(streams / STREAMS_PER_WORKER - 1e-9)
    workers = max(1, for_cpu, for_streams)
    redis_us = 0.0
    shards = 0
    share = 0.0
    if state != "memory":
        redis_us = (rate * REDIS_US_PER_REQUEST[state] + workers * REDIS_US_PER_WORKER_S
                    + streams * REDIS_US_PER_LEASE_S)
        shards = max(1, math.ceil(redis_us / 1e6 / REDIS_TARGET - 1e-9))
        # reserve + release: the two of a request's scripts on the pool's own shard.
        share = (rate * REDIS_US_PER_REQUEST["redis"] + streams * REDIS_US_PER_LEASE_S) / 1e6
    return TierSize(state, backends, rate, output_tokens, streams, cpu, for_cpu, for_streams,
                    workers, redis_us, shards, share)
