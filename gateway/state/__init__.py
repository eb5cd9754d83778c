"""Where reservations live: `memory` (one process) or `redis` (shared by replicas).

    create_state(None)                          -> MemoryState
    create_state("redis://host:6379")            -> RedisState on one Redis
    create_state("redis+cluster://h:7000,h:7001") -> RedisState on a Redis Cluster
    create_state("redis+sentinel://h:26379/mymaster") -> RedisState on a Sentinel-managed primary

Redis calls are bounded by the policy's `state` section (each call's timeout, then a circuit
breaker; gateway/state/breaker.py), counted in `metrics` when it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.state.base import (
    Bucket,
    BucketResult,
    Lease,
    Limits,
    PoolUsage,
    ReserveResult,
    StateBackend,
    StateError,
)
from gateway.state.memory import MemoryState
from gateway.state.urls import MEMORY, parse_url

if TYPE_CHECKING:
    from gateway.observe.metrics import GatewayMetrics
    from gateway.policy.model import Policy


def create_state(url: str | None, prefix: str = "gw", policy: Policy | None = None,
                 metrics: GatewayMetrics | None = None) -> StateBackend:
    """The backend `url` names (gateway/state/urls.py); Redis calls bounded by `policy.state`
    (read once, here). A URL that names none is a ValueError of one line."""
    if parse_url(url).kind == MEMORY:
        return MemoryState()
    from gateway.state.redis import RedisState

    assert url is not None
    return RedisState(url, prefix=prefix, spec=policy.state if policy else None, metrics=metrics)


__all__ = ["Bucket", "BucketResult", "Lease", "Limits", "MemoryState", "PoolUsage",
           "ReserveResult", "StateBackend",
           "StateError", "create_state"]
