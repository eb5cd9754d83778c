"""Reservations in Redis, shared by every gateway replica that points at it.

Each check-and-update is exactly one Lua script, kept as a .lua file and registered once
(EVALSHA). Keys carry a `{pool}` hash tag so all keys of a pool share one Redis Cluster slot
and a script can touch them together. Redis errors become `StateError`; admission decides
what that means (fail open or closed).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

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

DEFAULT_PREFIX = "gw"


def _script(name: str, with_purge: bool = False) -> str:
    lua = resources.files("gateway.state") / "lua"
    text = (lua / name).read_text(encoding="utf-8")
    if with_purge:
        text = (lua / "purge.lua").read_text(encoding="utf-8") + text
    return text


def pool_keys(pool: str, prefix: str = DEFAULT_PREFIX) -> list[str]:
    tag = f"{prefix}:{{{pool}}}"
    return [f"{tag}:expiry", f"{tag}:leases", f"{tag}:blocks", f"{tag}:tokens",
            f"{tag}:tenants"]


class RedisState(StateBackend):
    name = "redis"

    def __init__(self, url: str, timeout_s: float = 0.5, prefix: str = DEFAULT_PREFIX) -> None:
        self.url = url
        self.prefix = prefix
        # Short timeouts and no hidden retries: a Redis that is down must turn into the
        # policy's fail mode within a fraction of a second, never into a hung request.
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry_on_timeout=False, health_check_interval=5, max_connections=256,
            # A pooled connection to a Redis that restarted fails its next command; one
            # reconnect keeps that release (or reserve) from being lost to a dead socket.
            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])
        self._reserve = self.client.register_script(_script("reserve.lua", with_purge=True))
        self._release = self.client.register_script(_script("release.lua"))
        self._refresh = self.client.register_script(_script("refresh.lua"))
        self._usage = self.client.register_script(_script("usage.lua", with_purge=True))
        self._bucket = self.client.register_script(_script("bucket.lua"))

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except (TimeoutError, RedisError, OSError) as exc:
            raise StateError(f"redis: {type(exc).__name__}: {exc}") from exc

    async def reserve(self, lease: Lease, limits: Limits, ttl_s: float) -> ReserveResult:
        max_tokens = -1 if limits.max_tokens is None else limits.max_tokens
        tenant_max = -1 if limits.tenant_max_blocks is None else limits.tenant_max_blocks
        ok, blocks, tokens, reason = await self._call(self._reserve(
            keys=pool_keys(lease.pool, self.prefix),
            args=[lease.lease_id, lease.backend, lease.blocks, lease.tokens,
                  limits.max_blocks, max_tokens, int(ttl_s * 1000), lease.tenant,
                  tenant_max]))
        return ReserveResult(bool(ok), int(blocks), int(tokens), _text(reason))

    async def release(self, lease: Lease) -> None:
        await self._call(self._release(keys=pool_keys(lease.pool, self.prefix),
                                       args=[lease.lease_id]))

    async def refresh(self, leases: list[Lease], ttl_s: float) -> None:
        by_pool: dict[str, list[str]] = {}
        for lease in leases:
            by_pool.setdefault(lease.pool, []).append(lease.lease_id)
        ttl_ms = int(ttl_s * 1000)
        for pool, ids in by_pool.items():
            await self._call(self._refresh(keys=pool_keys(pool, self.prefix)[:1],
                                           args=[ttl_ms, *ids]))

    async def usage(self, pool: str) -> PoolUsage:
        raw = await self._call(self._usage(keys=pool_keys(pool, self.prefix)))
        blocks = {_text(raw[i]): int(raw[i + 1]) for i in range(1, len(raw), 2)}
        return PoolUsage(blocks, int(raw[0]))

    async def take(self, bucket: Bucket, amount: int) -> BucketResult:
        return await self._bucket_call(bucket, amount, "take")

    async def adjust(self, bucket: Bucket, delta: int) -> BucketResult:
        return await self._bucket_call(bucket, delta, "adjust")

    async def _bucket_call(self, bucket: Bucket, amount: int, op: str) -> BucketResult:
        ok, remaining, reset_ms = await self._call(self._bucket(
            keys=[f"{self.prefix}:quota:{{{bucket.key}}}"],
            args=[amount, bucket.capacity, repr(bucket.refill_per_s), op]))
        return BucketResult(bool(ok), int(remaining), int(reset_ms) / 1000)

    async def heartbeat(self, replica_id: str, ttl_s: float) -> int:
        key = f"{self.prefix}:replicas"
        async with self.client.pipeline(transaction=False) as pipe:
            now = await self._call(self.client.time())
            now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
            pipe.zadd(key, {replica_id: now_ms + int(ttl_s * 1000)})
            pipe.zremrangebyscore(key, "-inf", now_ms)
            pipe.zcard(key)
            results = await self._call(pipe.execute())
        return max(1, int(results[-1]))

    async def close(self) -> None:
        await self.client.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
