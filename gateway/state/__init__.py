"""Where reservations live: `memory` (one process) or `redis` (shared by replicas).

    create_state(None)               -> MemoryState
    create_state("redis://host:6379") -> RedisState
"""

from __future__ import annotations

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


def create_state(url: str | None, prefix: str = "gw") -> StateBackend:
    if not url or url == "memory://":
        return MemoryState()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from gateway.state.redis import RedisState

        return RedisState(url, prefix=prefix)
    raise ValueError(f"--redis-url: expected redis://host:port[/db], got {url!r}")


__all__ = ["Bucket", "BucketResult", "Lease", "Limits", "MemoryState", "PoolUsage",
           "ReserveResult", "StateBackend",
           "StateError", "create_state"]
