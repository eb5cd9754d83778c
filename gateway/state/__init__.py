"""Where reservations live: `memory` (one process) or `redis` (shared by replicas).

    create_state(None)               -> MemoryState
    create_state("redis://host:6379") -> RedisState

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

if TYPE_CHECKING:
    from gateway.observe.metrics import GatewayMetrics
    from gateway.policy.model import Policy


def create_state(url: str | None, prefix: str = "gw", policy: Policy | None = None,
                 metrics: GatewayMetrics | None = None) -> StateBackend:
    """The backend `url` names; Redis calls bounded by `policy.state` (read once, here)."""
    if not url or url == "memory://":
        return MemoryState()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from gateway.state.redis import RedisState

        return RedisState(url, prefix=prefix, spec=policy.state if policy else None,
                          metrics=metrics)
    raise ValueError(f"--redis-url: expected redis://host:port[/db], got {url!r}")


__all__ = ["Bucket", "BucketResult", "Lease", "Limits", "MemoryState", "PoolUsage",
           "ReserveResult", "StateBackend",
           "StateError", "create_state"]
