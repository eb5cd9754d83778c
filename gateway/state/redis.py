"""Reservations in Redis, shared by every gateway replica that points at it.

Each check-and-update is exactly one Lua script, kept as a .lua file and registered once
(EVALSHA). Keys carry a `{pool}` hash tag so all keys of a pool share one Redis Cluster slot
and a script can touch them together (tests/test_state_slots.py holds every call to one slot).
Redis errors become `StateError`; admission decides what that means (fail open or closed).

The URL chooses the client (gateway/state/urls.py): one Redis (`redis://`), a Redis Cluster
(`redis+cluster://`, redis-py's RedisCluster: each script goes to the primary of its pool's
slot) or a Sentinel-managed primary (`redis+sentinel://`, redis-py's Sentinel.master_for: a
failover is followed by asking the Sentinels again). All three go through the same deadline
and breaker. During a failover the old primary refuses connections (or the cluster answers
CLUSTERDOWN / TRYAGAIN): that opens the breaker, the pools' fail mode applies, and the first
probe after the replica is promoted closes it again; a script the new primary has not seen is
loaded on its first NOSCRIPT.

Every call is bounded by the policy's `state.timeout_s`, connecting included, and goes through
a circuit breaker (gateway/state/breaker.py): a Redis that hangs costs the first call its
timeout, and the calls after it fail at once until a probe gets an answer.

What an outage would otherwise leave behind:
- A reserve that timed out may still run: a stopped Redis reads it from its socket when it
  resumes. A release that failed did not run. Both leases are released once Redis answers
  again (releasing is idempotent), instead of holding their blocks for the lease TTL.
- A quota take that failed may have run too, and a settle that failed did not: both are
  settled once Redis answers again (a take's whole reservation given back: usage while the
  store is out is not charged). A settle counts once however often it is sent (the bucket
  script keeps each request's hold until it settles), so sending it again is safe.
- A failover may lose the last writes the old primary acknowledged (replication is
  asynchronous): a lease released just before it comes back, a settle is undone. Both are
  idempotent, so the releases and settles of the last RECENT_S seconds before an outage are
  sent again with the ones it left (a lease gone already, or a hold settled, is a no-op).
- A restarted Redis has forgotten the quota buckets, and a tenant in debt (its settled usage
  beyond what it reserved, or a full bucket's one oversized request) would get a full one.
  The bucket script re-seeds a missing bucket from the level this replica last saw, refilled
  for the time since; another replica's newer view is lost, and so is usage during the outage
  (quotas are not charged while the store is down).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterDownError,
    MaxConnectionsError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.observe.metrics import GatewayMetrics
from gateway.policy.model import StateSpec
from gateway.state.base import (
    HOLD_TTL_S,
    Bucket,
    BucketResult,
    Lease,
    Limits,
    PoolUsage,
    ReserveResult,
    StateBackend,
    StateError,
)
from gateway.state.breaker import CLOSED, NAMES, Breaker
from gateway.state.urls import CLUSTER, SENTINEL, SINGLE, StateURL, check_prefix, parse_url, safe

DEFAULT_PREFIX = "gw"
UNRELEASED_MAX = 100_000  # leases kept for release after an outage; beyond, the TTL frees them
RECENT_S = 2.0  # releases and settles sent again after an outage: a failover may have lost them
RECENT_MAX = 20_000

log = logging.getLogger("gateway.state")
T = TypeVar("T")
# Answers that say the store cannot take the call now, as a refused connection does: a cluster
# whose slot has no primary yet (CLUSTERDOWN, TRYAGAIN during a failover, a slot not covered).
# They open the breaker, so calls fail at once instead of each paying redis-py's pauses.
UNAVAILABLE = (ClusterDownError, TryAgainError, RedisClusterException)


class NotSent(StateError):
    """Failed before reaching Redis: the breaker is open, or this replica's pool is full."""


def _script(name: str, with_purge: bool = False) -> str:
    lua = resources.files("gateway.state") / "lua"
    text = (lua / name).read_text(encoding="utf-8")
    if with_purge:
        text = (lua / "purge.lua").read_text(encoding="utf-8") + text
    return text


def pool_keys(pool: str, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The keys of a pool's leases (reserve, release, usage and refresh use them), one slot."""
    tag = f"{prefix}:{{{pool}}}"
    return [f"{tag}:expiry", f"{tag}:leases", f"{tag}:blocks", f"{tag}:tokens",
            f"{tag}:tenants"]


def bucket_key(bucket: str, prefix: str = DEFAULT_PREFIX) -> str:
    """A quota bucket's key (`TENANT:minute` or `TENANT:day`)."""
    return f"{prefix}:quota:{{{bucket}}}"


def quota_keys(bucket: str, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The bucket, its holds (hash id -> tokens) and their expiries (zset): one slot, the
    bucket's. Not under `PREFIX:quota:*`, so a scan of the buckets finds only buckets."""
    return [bucket_key(bucket, prefix), f"{prefix}:quota-held:{{{bucket}}}",
            f"{prefix}:quota-holds:{{{bucket}}}"]


def replicas_key(prefix: str = DEFAULT_PREFIX) -> str:
    """The replicas' heartbeats: one key."""
    return f"{prefix}:replicas"


def make_client(target: StateURL, timeout_s: float
                ) -> tuple[aioredis.Redis | RedisCluster, list[aioredis.Redis]]:
    """The client `target` names, and the Sentinel connections to close with it (if any).

    No hidden retry of a timeout (the breaker decides what a timeout means), and the socket
    timeouts only back up the per-call deadline that `_call` sets. A pooled connection to a
    Redis that restarted fails its next command; one reconnect (for a cluster: one new look at
    the slots) keeps that release (or reserve) from being lost to a dead socket."""
    common: dict[str, Any] = {
        "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
        "health_check_interval": 5, "max_connections": 256,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))}
    if target.kind == SINGLE:
        client = aioredis.Redis.from_url(target.url, retry_on_timeout=False,
                                         retry_on_error=[RedisConnectionError], **common)
        return client, []
    if target.kind == CLUSTER:
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        return RedisCluster(startup_nodes=nodes, username=target.username,
                            password=target.password, ssl=target.tls, **common), []
    assert target.kind == SENTINEL
    sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed in newer redis-py
        list(target.nodes), sentinel_kwargs={"socket_timeout": timeout_s,
                                             "socket_connect_timeout": timeout_s,
                                             "ssl": target.tls,
                                             "username": target.sentinel_username,
                                             "password": target.sentinel_password})
    # ssl=True makes redis-py's pool use SentinelManagedSSLConnection to the primary.
    client = sentinel.master_for(target.service, redis_class=aioredis.Redis, db=target.db,
                                 username=target.username, password=target.password,
                                 retry_on_timeout=False, ssl=target.tls, **common)
    return client, list(sentinel.sentinels)


async def _within(call: Awaitable[T], timeout_s: float) -> T:
    """`call` under a deadline that holds whichever task awaits it.

    `asyncio.timeout` cancels the task that entered it, and a release a request's `finally`
    runs eagerly is continued, once it waits, in a task of its own (gateway/pipeline/eager.py
    `finish`): the deadline then cancelled the request's task instead, which had finished
    (a CancelledError out of the server, logged with a traceback, as a cluster primary was
    killed under load), and no longer bounded the call. The call runs as a task of its own
    and is waited on with a timer, which binds to no task; a task against a round trip."""
    work = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait((work,), timeout=timeout_s)
    except BaseException:  # the caller cancelled: the call goes with it
        work.cancel()
        raise
    if not done:
        work.cancel()
        raise TimeoutError
    return work.result()


class RedisState(StateBackend):
    name = "redis"

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, spec: StateSpec | None = None,
                 metrics: GatewayMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.target = parse_url(url)
        self.prefix = check_prefix(prefix)
        self.spec = spec or StateSpec()
        self.metrics = metrics
        self.clock = clock
        self.timeout_s = self.spec.timeout_s
        self.breaker = Breaker(self.spec.probe_interval_s, clock, self._on_breaker)
        self.client, self._sentinels = make_client(self.target, self.timeout_s)
        self._reserve = self.client.register_script(_script("reserve.lua", with_purge=True))
        self._release = self.client.register_script(_script("release.lua"))
        self._refresh = self.client.register_script(_script("refresh.lua"))
        self._usage = self.client.register_script(_script("usage.lua", with_purge=True))
        self._bucket = self.client.register_script(_script("bucket.lua"))
        self._heartbeat = self.client.register_script(_script("heartbeat.lua"))
        self._scripts = (self._reserve, self._release, self._refresh, self._usage,
                         self._bucket, self._heartbeat)
        self._seen: dict[str, tuple[int, float]] = {}  # bucket key -> (level, when: clock)
        # Leases to release at the next answer: their reserve may have run unseen (it timed
        # out), or their release failed.
        self._unreleased: dict[str, Lease] = {}
        # Quota holds to settle at the next answer: (bucket, hold id, refund), by bucket|hold.
        self._unsettled: dict[str, tuple[Bucket, str, int]] = {}
        # Releases and settles Redis acknowledged lately: (when, lease or (bucket, hold,
        # refund)), sent again after an outage in case a failover lost them.
        self._recent: deque[tuple[float, Lease | tuple[Bucket, str, int]]] = \
            deque(maxlen=RECENT_MAX)
        self._flush: asyncio.Task[None] | None = None
        if metrics is not None:
            metrics.state_breaker.set(self.breaker.state)

    # --- every call: a deadline and the breaker -------------------------------------------

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()` under the deadline and the breaker; `op` labels its metrics."""
        probe = self.breaker.admit()
        if probe is None:
            raise NotSent(f"redis: unavailable for {self.breaker.outage_s:.1f} s (circuit open; "
                          "the fail mode applies)")
        try:
            result = await _within(call(), self.timeout_s)
        except (TimeoutError, RedisTimeoutError) as exc:  # TimeoutError first: it is an OSError
            self._timed_out(op)
            self.breaker.failed()
            raise StateError(f"redis: no answer within {self.timeout_s:g} s (state.timeout_s)") \
                from exc
        except MaxConnectionsError as exc:  # our own pool is full: says nothing of Redis
            raise NotSent(f"redis: {exc}") from exc
        except (RedisConnectionError, OSError, *UNAVAILABLE) as exc:
            self.breaker.failed()
            raise StateError(f"redis: {type(exc).__name__}: {exc}") from exc
        except RedisError as exc:  # an error reply: Redis is there
            self.breaker.succeeded()
            raise StateError(f"redis: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            # The client failed in a way of its own: writing to a connection the peer (a
            # primary killed in a failover) or another call has just closed raises the
            # transport's own error, not ConnectionError (redis-py 8.1 with uvloop:
            # RuntimeError or AttributeError; redis/redis-py#4287). The store is out for this
            # call, as for a refused connection: never a 500.
            self.breaker.failed()
            log.warning("state backend: the Redis client failed (%s: %s); taken as the store "
                        "unreachable", type(exc).__name__, exc)
            raise StateError(f"redis: {type(exc).__name__}: {exc}") from exc
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():  # cancelled: the caller left before any answer
                self.breaker.abandoned(probe)
                raise
            # Nobody cancelled this task: the Redis client cancelled what it waited on itself.
            # The store is out for this call, as for a refused connection.
            self.breaker.failed()
            log.warning("state backend: the Redis client cancelled its own call; taken as the "
                        "store unreachable")
            raise StateError("redis: the client cancelled the call") from exc
        except BaseException:
            self.breaker.abandoned(probe)
            raise
        self.breaker.succeeded()
        if (self._unreleased or self._unsettled) and (self._flush is None
                                                       or self._flush.done()):
            self._flush = asyncio.get_running_loop().create_task(self._release_left())
        return result

    def _timed_out(self, op: str) -> None:
        if self.metrics is not None:
            self.metrics.state_timeouts.labels(op).inc()

    def _on_breaker(self, old: int, new: int) -> None:
        if self.metrics is not None:
            self.metrics.state_breaker.set(new)
            if old == CLOSED:
                self.metrics.state_breaker_opens.inc()
        if old == CLOSED:
            self._resend_recent()
        # The outage's start and end; the probes in between (one per interval) only at debug.
        if old == CLOSED:
            log.warning("state backend %s: no answer; circuit open, calls fail at once (the "
                        "fail mode applies), one probes every %g s", safe(self.url),
                        self.spec.probe_interval_s)
        elif new == CLOSED:
            log.warning("state backend %s: answers again after %.1f s; circuit closed",
                        safe(self.url), self.clock() - self.breaker.outage_since)
        else:
            log.debug("state backend: circuit %s -> %s", NAMES[old], NAMES[new])

    def _ended(self, item: Lease | tuple[Bucket, str, int]) -> None:
        now = self.clock()
        while self._recent and self._recent[0][0] < now - RECENT_S:
            self._recent.popleft()
        self._recent.append((now, item))

    def _resend_recent(self) -> None:
        """An outage began: what ended in the seconds before it goes with what it leaves."""
        since = self.clock() - RECENT_S
        for when, item in self._recent:
            if when < since:
                continue
            if isinstance(item, Lease):
                self._keep_for_release(item)
            else:
                self._keep_for_settle(*item)
        self._recent.clear()

    def _keep_for_release(self, lease: Lease) -> None:
        if len(self._unreleased) >= UNRELEASED_MAX:
            self._unreleased.pop(next(iter(self._unreleased)))  # the oldest: its TTL is nearest
        self._unreleased[lease.lease_id] = lease

    def _keep_for_settle(self, bucket: Bucket, hold: str, refund: int) -> None:
        if len(self._unsettled) >= UNRELEASED_MAX:
            self._unsettled.pop(next(iter(self._unsettled)))  # the hold's TTL ends it
        self._unsettled[f"{bucket.key}|{hold}"] = (bucket, hold, refund)

    async def _release_left(self) -> None:
        """Release and settle what an outage left held in Redis, until Redis is out again."""
        settled = 0
        while self._unsettled:
            key, (bucket, hold, refund) = next(iter(self._unsettled.items()))
            try:
                settled += (await self._bucket_call(bucket, refund, "settle", hold)).ok
            except StateError:
                if self.breaker.state != CLOSED:
                    return  # out again: kept for the next answer
            self._unsettled.pop(key, None)
        if settled:
            log.warning("state backend: settled %d quota hold(s) left by an outage", settled)
        released = 0
        while self._unreleased:
            lease_id, lease = next(iter(self._unreleased.items()))
            try:
                released += await self._release_one(lease)
            except StateError:
                if self.breaker.state != CLOSED:
                    break  # out again: kept for the next answer
                # An error reply: trying again would get the same; the TTL frees it.
            self._unreleased.pop(lease_id, None)
        if released:
            log.warning("state backend: released %d lease(s) left by an outage", released)

    # --- the operations ---------------------------------------------------------------------

    async def reserve(self, lease: Lease, limits: Limits, ttl_s: float) -> ReserveResult:
        max_tokens = -1 if limits.max_tokens is None else limits.max_tokens
        tenant_max = -1 if limits.tenant_max_blocks is None else limits.tenant_max_blocks
        try:
            ok, blocks, tokens, reason = await self._call("reserve", lambda: self._reserve(
                keys=pool_keys(lease.pool, self.prefix),
                args=[lease.lease_id, lease.backend, lease.blocks, lease.tokens,
                      limits.max_blocks, max_tokens, int(ttl_s * 1000), lease.tenant,
                      tenant_max]))
        except NotSent:
            raise
        except StateError:
            # It may have been taken all the same: a hung Redis runs it on resuming.
            self._keep_for_release(lease)
            raise
        return ReserveResult(bool(ok), int(blocks), int(tokens), _text(reason))

    async def release(self, lease: Lease) -> None:
        try:
            await self._release_one(lease)
        except StateError:
            self._keep_for_release(lease)
            raise
        self._unreleased.pop(lease.lease_id, None)
        self._ended(lease)

    async def _release_one(self, lease: Lease) -> int:
        """1 if the lease was there to release."""
        return int(await self._call("release", lambda: self._release(
            keys=pool_keys(lease.pool, self.prefix), args=[lease.lease_id])))

    async def refresh(self, leases: list[Lease], ttl_s: float) -> None:
        by_pool: dict[str, list[str]] = {}
        for lease in leases:
            by_pool.setdefault(lease.pool, []).append(lease.lease_id)
        ttl_ms = int(ttl_s * 1000)
        for pool, ids in by_pool.items():
            await self._refresh_pool(pool, ids, ttl_ms)

    async def _refresh_pool(self, pool: str, ids: list[str], ttl_ms: int) -> None:
        await self._call("refresh", lambda: self._refresh(
            keys=pool_keys(pool, self.prefix)[:1], args=[ttl_ms, *ids]))

    async def usage(self, pool: str) -> PoolUsage:
        raw = await self._call("usage", lambda: self._usage(keys=pool_keys(pool, self.prefix)))
        blocks = {_text(raw[i]): int(raw[i + 1]) for i in range(1, len(raw), 2)}
        return PoolUsage(blocks, int(raw[0]))

    async def take(self, bucket: Bucket, amount: int, hold: str = "",
                   ttl_s: float = HOLD_TTL_S) -> BucketResult:
        try:
            return await self._bucket_call(bucket, amount, "take", hold, int(ttl_s * 1000))
        except NotSent:
            raise
        except StateError:
            if hold:  # it may have run: give it back whole once Redis answers
                self._keep_for_settle(bucket, hold, amount)
            raise

    async def settle(self, bucket: Bucket, hold: str, refund: int) -> BucketResult:
        try:
            result = await self._bucket_call(bucket, refund, "settle", hold)
        except StateError:
            self._keep_for_settle(bucket, hold, refund)
            raise
        self._unsettled.pop(f"{bucket.key}|{hold}", None)
        self._ended((bucket, hold, refund))
        return result

    async def adjust(self, bucket: Bucket, delta: int) -> BucketResult:
        return await self._bucket_call(bucket, delta, "adjust")

    async def _bucket_call(self, bucket: Bucket, amount: int, op: str, hold: str = "",
                           ttl_ms: int = 0) -> BucketResult:
        # The level this replica last saw, and how long ago: the script re-seeds the bucket
        # from it if Redis has lost the key (a restart), so a tenant's debt survives.
        seen = self._seen.get(bucket.key)
        seed = ["", 0] if seen is None else [seen[0], int((self.clock() - seen[1]) * 1000)]
        ok, remaining, reset_ms = await self._call("quota", lambda: self._bucket(
            keys=quota_keys(bucket.key, self.prefix),
            args=[amount, bucket.capacity, repr(bucket.refill_per_s), op, *seed, hold,
                  ttl_ms]))
        self._seen[bucket.key] = (int(remaining), self.clock())
        return BucketResult(bool(ok), int(remaining), int(reset_ms) / 1000)

    async def remember(self, key: str, value: str, ttl_s: float) -> None:
        await self._call("remember", lambda: self.client.set(
            f"{self.prefix}:kept:{key}", value, px=max(1, int(ttl_s * 1000))))

    async def recall(self, key: str) -> str | None:
        raw = await self._call("remember", lambda: self.client.get(f"{self.prefix}:kept:{key}"))
        return None if raw is None else _text(raw)

    async def heartbeat(self, replica_id: str, ttl_s: float) -> int:
        alive = await self._call("refresh", lambda: self._heartbeat(
            keys=[replicas_key(self.prefix)], args=[replica_id, int(ttl_s * 1000)]))
        return max(1, int(alive))

    async def warm(self, deadline_s: float) -> bool:
        # A new client's first call otherwise does it all under state.timeout_s: a cluster
        # client asks for the slot map and connects to each primary, a Sentinel client asks
        # for the primary, and each script is sent in full once per node (EVALSHA misses).
        # Under load at start that first reservation can outlast the deadline and take the
        # fail mode for no fault of the store.
        try:
            async with asyncio.timeout(deadline_s):
                if isinstance(self.client, RedisCluster):
                    await self.client.initialize()
                await self.client.ping()
                # Together: one round trip's wait, not one per script (a cluster loads each
                # on every primary).
                await asyncio.gather(*(self.client.script_load(script.script)
                                       for script in self._scripts))
        except TimeoutError:
            log.warning("state backend %s: not warmed within %g s (no answer); the first calls "
                        "connect on their own", safe(self.url), deadline_s)
            return False
        except Exception as exc:  # the store down at start is not fatal: the fail mode holds
            log.warning("state backend %s: not warmed (%s: %s); the first calls connect on "
                        "their own", safe(self.url), type(exc).__name__, exc)
            return False
        return True

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            await asyncio.gather(self._flush, return_exceptions=True)
        await self.client.aclose()
        for sentinel in self._sentinels:
            await sentinel.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
