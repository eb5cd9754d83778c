"""A Redis primary killed under load, on a Redis Cluster and on a Sentinel-managed primary.

Two gateway replicas (`gateway serve --redis-url ...`) share one pool of two simulated engines
and a tenant's token quota through the topology; clients send a steady mix of streamed and
plain requests through both. Mid-run the primary holding the pool's keys is SIGKILLed: on the
cluster a replica is promoted (cluster-node-timeout 1 s), with Sentinels the replica is
promoted by a quorum of them (down-after-milliseconds 1 s). What must hold:

- no 5xx from the gateway, and no stream cut: during the switch the pool's fail mode (`open`)
  admits on each replica's share of the budget;
- the pool's in-flight token budget is never exceeded in Redis, sampled every 20 ms through the
  burst (the switch included, where samples can be read);
- afterwards Redis holds nothing: no lease, no reserved block or token, no tenant share, no
  quota hold (every reservation a request took of the tenant's buckets was settled);
- the replicas recover by themselves: the breaker closes on both, reservations go to the new
  primary, and no state error follows, with no gateway restarted.

Each run prints its figures (kill to promotion, kill to both breakers closed, requests sent
during the switch, the peak of tokens reserved in Redis); docs/operations.md quotes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.sentinel import Sentinel

from gateway.pipeline.eager import finish
from gateway.policy.model import StateSpec
from gateway.state import Bucket, Lease, Limits, StateError
from gateway.state.breaker import OPEN
from gateway.state.redis import NotSent, RedisState, pool_keys, quota_keys
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.redis_topologies import SERVICE, Cluster, redis_cluster, redis_sentinels
from tests.servers import http, metric, quiet, scrape

POOL = "default"
INFLIGHT_TOKENS_MAX = 900  # binds: about 10 requests of ~80 tokens fit, 12 clients send
LEASE_TTL_S = 5
TIMEOUT_S, PROBE_S = 0.25, 0.5  # state.timeout_s, state.probe_interval_s
CLIENTS = 12
CALM_S = 4.0  # load before the kill, and after recovery
BREAKER = "gateway_state_breaker_state"
CHAT = "/v1/chat/completions"


def policy(engines: list[str], tenant: str) -> str:
    return policy_yaml(
        engines,
        # queue_wait_max_s: waiting is how admission meets the halved share of the switch,
        # and a 503 for a predicted wait is not what this test is about
        pool_extra=(f"    admission: {{fail_mode: open, inflight_tokens_max: "
                    f"{INFLIGHT_TOKENS_MAX}, lease_ttl_s: {LEASE_TTL_S}, "
                    f"queue_wait_max_s: 10}}\n"),
        extra=(f"state: {{timeout_s: {TIMEOUT_S}, probe_interval_s: {PROBE_S}}}\n"
               f"auth: {{anonymous_tenant: {tenant}}}\n"
               f"tenants:\n  - {{name: {tenant}, tokens_per_minute: 50000000, "
               f"tokens_per_day: 500000000}}\n"))


def body(i: int) -> dict[str, Any]:
    return {"model": "test-model", "max_tokens": 48, "ignore_eos": True, "stream": i % 2 == 0,
            "messages": [{"role": "user", "content": f"Hello there, request {i}"}]}


@dataclass
class Sent:
    start: float
    end: float
    replica: int
    status: int
    problem: str  # "" when the answer was whole: a 200 and, for a stream, [DONE] and no error


@dataclass
class Load:
    """CLIENTS threads sending through the replicas in turn until stopped."""

    urls: list[str]
    sent: list[Sent] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for c in range(CLIENTS):
            t = threading.Thread(target=self._client, args=(c,), daemon=True)
            t.start()
            self.threads.append(t)

    def _client(self, c: int) -> None:
        i = c
        while not self.stop.is_set():
            replica = i % len(self.urls)
            start = time.monotonic()
            try:
                reply = http("POST", self.urls[replica] + CHAT, body(i), timeout=30)
                status, text = reply.status, reply.body.decode(errors="replace")
                problem = ""
                if status != 200:
                    problem = text[:300]
                elif i % 2 == 0 and ("data: [DONE]" not in text or '"error"' in text):
                    problem = "stream cut: " + text[-300:]
            except OSError as exc:
                status, problem = 0, f"{type(exc).__name__}: {exc}"
            self.sent.append(Sent(start, time.monotonic(), replica, status, problem))
            i += CLIENTS

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(40)


@dataclass
class Sampler:
    """Reads the pool's reserved tokens and blocks from Redis every 20 ms until stopped."""

    connect: Callable[[], Any]
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, tokens, blocks)
    failed: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        keys = pool_keys(POOL)
        client = None
        while not self.stop.is_set():
            try:
                client = client or self.connect()
                tokens = int(client.get(keys[3]) or 0)
                blocks = sum(int(v) for v in client.hgetall(keys[2]).values())
                self.samples.append((time.monotonic(), tokens, blocks))
            except (redis.RedisError, OSError):
                self.failed += 1
                with contextlib.suppress(Exception):
                    if client is not None:
                        client.close()
                client = None
            time.sleep(0.02)
        if client is not None:
            client.close()

    def finish(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(10)


def held(client: Any, tenant: str) -> dict[str, Any]:
    """Everything Redis still holds for the pool and the tenant's quota."""
    keys = pool_keys(POOL)
    out: dict[str, Any] = {
        "leases": int(client.hlen(keys[1])), "expiry": int(client.zcard(keys[0])),
        "tokens": int(client.get(keys[3]) or 0),
        "blocks": sum(int(v) for v in client.hgetall(keys[2]).values()),
        "tenant_blocks": sum(int(v) for v in client.hgetall(keys[4]).values())}
    for window in ("minute", "day"):  # the quota reservations not settled yet
        _, held_key, holds_key = quota_keys(f"{tenant}:{window}")
        out[f"quota_holds_{window}"] = int(client.hlen(held_key)) + int(client.zcard(holds_key))
        out[f"quota_held_tokens_{window}"] = sum(int(v) for v in
                                                 client.hgetall(held_key).values())
    return out


@dataclass
class Topology:
    url: str
    connect: Callable[[], Any]  # a plain client on the current primary (or the cluster)
    kill: Callable[[], Callable[[], object]]  # kills the pool's primary; returns "wait promoted"


@contextlib.contextmanager
def cluster_topology(tmp_path: Path, tenant_for: Callable[[Cluster], str]
                     ) -> Iterator[tuple[Topology, str]]:
    with redis_cluster(tmp_path, primaries=3, replicas=1) as cluster:
        tenant = tenant_for(cluster)

        def connect() -> redis.RedisCluster:
            return cluster.client()

        def kill() -> Callable[[], object]:
            ranges = cluster.kill(cluster.primary_for(pool_keys(POOL)[0]))
            return lambda: cluster.wait_promoted(ranges)

        yield Topology(cluster.url, connect, kill), tenant


@contextlib.contextmanager
def sentinel_topology(tmp_path: Path) -> Iterator[tuple[Topology, str]]:
    with redis_sentinels(tmp_path) as group:
        def connect() -> redis.Redis:
            sentinel = Sentinel([("127.0.0.1", s.port) for s in group.sentinels if s.alive],
                                socket_timeout=1, socket_connect_timeout=1)
            return sentinel.master_for(SERVICE, socket_timeout=1, socket_connect_timeout=1,
                                       decode_responses=True)

        def kill() -> Callable[[], object]:
            old = group.kill_primary()
            return lambda: group.wait_failover(old)

        yield Topology(group.url, connect, kill), "tenant-s"


def tenant_on_the_pools_shard(cluster: Cluster) -> str:
    """A tenant whose two quota buckets live on the shard of the pool's keys, so the kill hits
    leases and quota holds at once."""
    shard = cluster.primary_for(pool_keys(POOL)[0]).port
    for i in range(10_000):
        name = f"tenant-{i}"
        if all(cluster.primary_for(f"gw:quota:{{{name}:{w}}}").port == shard
               for w in ("minute", "day")):
            return name
    raise AssertionError("no tenant name lands on the pool's shard")


def run_failover(topology: Topology, tenant: str, start_sim: StartSim,
                 start_gateway: StartGateway) -> dict[str, Any]:
    with start_sim() as e0, start_sim() as e1:
        text = policy([e0.url, e1.url], tenant)
        with start_gateway(text, "--redis-url", topology.url) as a, \
                start_gateway(text, "--redis-url", topology.url) as b:
            urls = [a.url, b.url]
            for url in urls:  # both up on the topology before the load
                assert http("POST", url + CHAT, body(1)).status == 200
            before = {u: metric(scrape(u), "gateway_state_errors_total") for u in urls}
            load, sampler = Load(urls), Sampler(topology.connect)
            sampler.start()
            load.start()
            try:
                time.sleep(CALM_S)
                killed = time.monotonic()
                promoted_wait = topology.kill()
                promoted_wait()
                promoted = time.monotonic()
                closed = wait_breakers_closed(urls, timeout=20)
                recovered = time.monotonic()
                errors_recovered = {u: metric(scrape(u), "gateway_state_errors_total")
                                    for u in urls}
                time.sleep(CALM_S)
            finally:
                load.finish()
                sampler.finish()
            for url in urls:
                quiet(url, timeout=15)
            after = {u: scrape(u) for u in urls}
            tracebacks = [tb for srv in (a, b) for tb in _tracebacks(srv.log())]
            client = topology.connect()
            try:
                left = wait_nothing_held(client, tenant, timeout=LEASE_TTL_S + 5)
            finally:
                client.close()
    switch = [s for s in load.sent if s.end >= killed and s.start <= recovered]
    figures = {
        "kill_to_promoted_s": round(promoted - killed, 2),
        "kill_to_breakers_closed_s": round(recovered - killed, 2),
        "breaker_closed_after_s": {i: round(t - killed, 2) for i, t in enumerate(closed)},
        "requests": len(load.sent), "requests_in_switch": len(switch),
        "load_s": round(max(s.end for s in load.sent) - min(s.start for s in load.sent), 1),
        "statuses": _count(s.status for s in load.sent),
        "state_errors": {i: metric(after[u], "gateway_state_errors_total") - before[u]
                         for i, u in enumerate(urls)},
        "state_errors_after_recovery": {
            i: metric(after[u], "gateway_state_errors_total") - errors_recovered[u]
            for i, u in enumerate(urls)},
        "peak_tokens_in_redis": max((t for _, t, _ in sampler.samples), default=0),
        "samples": len(sampler.samples), "sample_failures": sampler.failed,
        "samples_after_recovery_with_leases": sum(
            1 for t, tokens, _ in sampler.samples if t > recovered and tokens > 0),
        "held_after": left,
        "tracebacks": len(tracebacks),
    }
    print("failover figures:", json.dumps(figures))
    figures["problems"] = [s for s in load.sent if s.problem]
    figures["traceback_text"] = tracebacks[:3]
    return figures


def _tracebacks(log: str) -> list[str]:
    """Each traceback in a gateway's log, with the line before it (what was logged)."""
    lines = log.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j] and
                        not lines[j].startswith((" ", "Traceback", "During", "The above"))),
                       len(lines) - 1)
            out.append("\n".join(lines[max(0, i - 1):end + 1])[-4000:])
    return out


def wait_breakers_closed(urls: list[str], timeout: float) -> list[float]:
    """Poll until each replica's breaker has opened (the kill was seen) and closed again; when
    each closed."""
    deadline = time.monotonic() + timeout
    opened = [False] * len(urls)
    closed: list[float | None] = [None] * len(urls)
    while None in closed:
        assert time.monotonic() < deadline, f"breakers: opened {opened}, closed {closed}"
        for i, url in enumerate(urls):
            if closed[i] is not None:
                continue
            s = scrape(url)
            opened[i] = opened[i] or metric(s, "gateway_state_breaker_opens_total") > 0
            if opened[i] and metric(s, BREAKER) == 0:
                closed[i] = time.monotonic()
        time.sleep(0.05)
    return [c for c in closed if c is not None]


def wait_nothing_held(client: Any, tenant: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        left = held(client, tenant)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def check(figures: dict[str, Any]) -> None:
    assert not figures["traceback_text"], "\n\n".join(figures["traceback_text"])
    assert not figures["problems"], figures["problems"][:5]
    assert set(figures["statuses"]) == {"200"}, figures["statuses"]
    assert figures["requests_in_switch"] > 0, figures
    # the fail mode applied: reservations failed on Redis and the requests were admitted
    assert sum(figures["state_errors"].values()) > 0, figures
    assert figures["peak_tokens_in_redis"] <= INFLIGHT_TOKENS_MAX, figures
    assert figures["samples"] > 100, figures
    # recovered by themselves: reservations in Redis again, and no error since
    assert figures["samples_after_recovery_with_leases"] > 0, figures
    assert not any(figures["state_errors_after_recovery"].values()), figures
    assert not any(figures["held_after"].values()), figures


@pytest.mark.timeout(90)
def test_a_cluster_primary_killed_under_load(tmp_path: Path, start_sim: StartSim,
                                             start_gateway: StartGateway) -> None:
    with cluster_topology(tmp_path, tenant_on_the_pools_shard) as (topology, tenant):
        check(run_failover(topology, tenant, start_sim, start_gateway))


@pytest.mark.timeout(90)
def test_a_sentinel_primary_killed_under_load(tmp_path: Path, start_sim: StartSim,
                                              start_gateway: StartGateway) -> None:
    with sentinel_topology(tmp_path) as (topology, tenant):
        check(run_failover(topology, tenant, start_sim, start_gateway))



@pytest.mark.anyio
async def test_ends_a_failover_lost_are_sent_again(redis_url: str) -> None:
    """Replication is asynchronous: a release or settle the old primary acknowledged may be
    missing on the promoted replica. The replica sends the ends of the seconds before an
    outage again once the store answers; ends that did land are no-ops."""
    prefix = f"lost-{uuid.uuid4().hex[:8]}"
    state = RedisState(redis_url, prefix=prefix, spec=StateSpec(timeout_s=0.5,
                                                                probe_interval_s=0.05))
    other = RedisState(redis_url, prefix=prefix)  # writes what the promoted replica still has
    lease, limits = Lease(POOL, "e0", "lease-1", 8, 100, "t"), Limits(100, None)
    bucket = Bucket("t:day", 1000, 0.001)
    kept = Lease(POOL, "e0", "lease-2", 4, 50, "t")  # released before, and not lost
    try:
        for item in (lease, kept):
            assert (await state.reserve(item, limits, 30)).ok
            await state.release(item)
        assert (await state.take(bucket, 300, "hold-1")).ok
        await state.settle(bucket, "hold-1", 200)  # used 100
        # the failover: the new primary lost lease-1's release and hold-1's settle
        assert (await other.reserve(lease, limits, 30)).ok
        await other.adjust(bucket, -200)
        assert (await other.take(bucket, 0, "hold-1")).ok  # the hold is back, level 700
        state.breaker.failed()  # the outage as the replica saw it
        await asyncio.sleep(0.1)
        await state.usage(POOL)  # the probe: answered, so the ends go again
        for _ in range(50):
            if state._flush is None or state._flush.done():
                break
            await asyncio.sleep(0.02)
        usage = await state.usage(POOL)
        assert usage.blocks == {"e0": 0} and usage.tokens == 0, usage
        again = await state.settle(bucket, "hold-1", 0)
        assert not again.ok and again.remaining == 900, again  # settled once, refunded once
    finally:
        await state.close()
        await other.close()


@pytest.mark.anyio
async def test_a_client_cancelling_its_own_call_is_the_store_out_not_a_traceback() -> None:
    # Seen in the cluster failover above, once in a run of the suite: a CancelledError out of
    # a release's shielded task, which no one had cancelled (redis-py cancels what a call
    # waits on as a primary is killed), logged by the server as an exception.
    state = RedisState("redis+cluster://127.0.0.1:1")

    async def cancelled_inside(*args: Any, **kw: Any) -> Any:
        waited = asyncio.get_running_loop().create_future()
        waited.cancel()
        return await waited

    state.client.execute_command = cancelled_inside  # type: ignore[method-assign]
    with pytest.raises(StateError, match="cancelled the call"):
        await state.take(Bucket("t:day", 1000, 1.0), 10, "h")
    assert state.breaker.state == OPEN
    await state.close()


@pytest.mark.anyio
async def test_a_call_finished_in_another_task_keeps_its_deadline() -> None:
    # A request's `finally` runs its release eagerly and, once it waits, finishes it in a task
    # of its own (gateway/pipeline/eager.py). A deadline bound to the task that started the call
    # cancelled the request's task instead (a traceback out of the server as a cluster primary
    # was killed under load, two full runs of the suite in three) and left the call unbounded.
    state = RedisState("redis+cluster://127.0.0.1:1", spec=StateSpec(timeout_s=0.2))

    async def hangs(*args: Any, **kw: Any) -> Any:
        await asyncio.Event().wait()

    state.client.execute_command = hangs  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(StateError, match="no answer within"):
        await asyncio.wait_for(finish(state.take(Bucket("t:day", 1000, 1.0), 10, "h")), 5)
    assert time.monotonic() - started < 2
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await state.close()


@pytest.mark.anyio
async def test_a_caller_cancelled_mid_call_is_passed_on() -> None:
    state = RedisState("redis+cluster://127.0.0.1:1")
    waiting = asyncio.Event()

    async def hangs(*args: Any, **kw: Any) -> Any:
        waiting.set()
        await asyncio.Event().wait()

    state.client.execute_command = hangs  # type: ignore[method-assign]
    call = asyncio.ensure_future(state.take(Bucket("t:day", 1000, 1.0), 10, "h"))
    await waiting.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert state.breaker.state != OPEN  # a caller leaving says nothing of Redis
    await state.close()


@pytest.mark.anyio
async def test_a_client_failing_its_own_way_is_the_store_out_not_a_500() -> None:
    # Seen in the cluster failover above, once in a few runs: uvloop raises RuntimeError when
    # redis-py writes to a node connection another call has just closed.
    state = RedisState("redis+cluster://127.0.0.1:1")

    async def closed(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

    state.client.execute_command = closed  # type: ignore[method-assign]
    with pytest.raises(StateError):
        await state.take(Bucket("t:day", 1000, 1.0), 10, "h")
    assert state.breaker.state == OPEN
    with pytest.raises(NotSent):  # fails at once now, as for a refused connection
        await state.usage(POOL)
    await state.close()
