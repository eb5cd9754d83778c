"""A Redis that hangs or restarts, against a real gateway, a real redis-server of the test's own
and the simulated engine.

A stopped Redis (SIGSTOP: connections are accepted by the kernel, nothing ever answers) must
cost the first request at most about `state.timeout_s`; the requests after it answer at once
under the pool's fail mode, because the circuit breaker fails every call fast until a probe
gets an answer. SIGCONT closes the breaker again and reservations go back to Redis, with
nothing left reserved. A Redis restart must not forgive a tenant's quota debt.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path

import pytest
import redis

from gateway.state.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import Redis, http, metric, poll_metric, quiet, redis_server, scrape

TIMEOUT_S = 0.25  # state.timeout_s in these policies
PROBE_S = 1.0  # state.probe_interval_s
BREAKER = "gateway_state_breaker_state"
CHAT = "/v1/chat/completions"


def body(max_tokens: int = 4, stream: bool = False) -> dict[str, object]:
    return {"model": "test-model", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "messages": [{"role": "user", "content": "Hello there"}]}


def policy(sim_url: str, fail_mode: str, extra: str = "") -> str:
    return policy_yaml([sim_url], pool_extra=f"    admission: {{fail_mode: {fail_mode}}}\n",
                       extra=f"state: {{timeout_s: {TIMEOUT_S}, probe_interval_s: {PROBE_S}}}\n"
                       + extra)


@contextlib.contextmanager
def stopped(r: Redis) -> Iterator[None]:
    """Redis paused as a black hole would be, resumed however the block ends."""
    assert r.process is not None
    os.kill(r.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(r.process.pid, signal.SIGCONT)


def held(client: redis.Redis, pool: str = "default") -> tuple[int, int, int]:
    """(leases, blocks, tokens) Redis holds for the pool."""
    tag = f"gw:{{{pool}}}"
    blocks = sum(int(v) for v in client.hgetall(f"{tag}:blocks").values())
    return int(client.hlen(f"{tag}:leases")), blocks, int(client.get(f"{tag}:tokens") or 0)


def wait_released(client: redis.Redis, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := held(client)) != (0, 0, 0):
        assert time.monotonic() < deadline, f"Redis still holds (leases, blocks, tokens) {now}"
        time.sleep(0.05)


@pytest.mark.parametrize(("fail_mode", "quota"), [("open", True), ("closed", False)])
def test_a_hung_redis_costs_one_timeout_then_fails_fast_until_it_answers(
        tmp_path: Path, start_sim: StartSim, start_gateway: StartGateway,
        fail_mode: str, quota: bool) -> None:
    # With a quota the first call to hang is the tenant's bucket; without, the reservation,
    # which a stopped Redis runs when it resumes: the gateway must release it then.
    tenants = "tenants:\n  - {name: anonymous, tokens_per_minute: 10000000}\n" if quota else ""
    with redis_server(tmp_path) as r, start_sim() as sim, \
            start_gateway(policy(sim.url, fail_mode, tenants), "--redis-url", r.url) as gw:
        client = redis.Redis.from_url(r.url, socket_timeout=5)
        for _ in range(2):
            assert http("POST", gw.url + CHAT, body()).status == 200
        wait_released(client)
        samples = scrape(gw.url)
        assert metric(samples, BREAKER) == 0
        opens = metric(samples, "gateway_state_breaker_opens_total")

        times: list[float] = []
        with stopped(r):
            for _ in range(6):
                start = time.monotonic()
                reply = http("POST", gw.url + CHAT, body(), timeout=30)
                times.append(time.monotonic() - start)
                if fail_mode == "open":  # this replica's share of the budget, in memory
                    assert reply.status == 200, reply
                else:
                    assert reply.status == 503, reply
                    assert reply.json()["error"]["code"] == "state_unavailable"
            samples = scrape(gw.url)
            assert metric(samples, BREAKER) in (1, 2)  # open, or a probe out
            assert metric(samples, "gateway_state_timeouts_total") >= 1
            assert metric(samples, "gateway_state_breaker_opens_total") == opens + 1
            time.sleep(2 * PROBE_S)  # probes keep failing: still out, nothing slower
            assert metric(scrape(gw.url), BREAKER) in (1, 2)
            start = time.monotonic()
            assert http("POST", gw.url + CHAT, body(), timeout=30).status \
                == (200 if fail_mode == "open" else 503)
            times.append(time.monotonic() - start)

        # Before the breaker, each of these waited out its calls' timeouts: 1-4 s a request.
        print(f"fail_mode {fail_mode}: request times with Redis stopped (s):",
              " ".join(f"{t:.3f}" for t in times))
        assert all(t < TIMEOUT_S + 1.0 for t in times), times
        assert sum(times) < 2 * TIMEOUT_S + 0.15 * len(times) + 1.0, times
        assert max(times[1:]) < TIMEOUT_S + 0.5, times  # at most a probe's timeout

        # Resumed: the next probe (the admission ticker's, at the latest) closes the breaker.
        poll_metric(gw.url, BREAKER, lambda v: v == 0, timeout=PROBE_S + 3 * TIMEOUT_S + 3)
        assert metric(scrape(gw.url), "gateway_state_breaker_opens_total") == opens + 1
        # A reservation that hung ran when Redis resumed; it is released, not left to expire.
        wait_released(client)
        for _ in range(3):
            start = time.monotonic()
            assert http("POST", gw.url + CHAT, body()).status == 200
            assert time.monotonic() - start < 1.0
        # Reservations are in Redis again: one held there while its stream runs.
        conn = HTTPConnection("127.0.0.1", gw.port, timeout=30)
        try:
            conn.request("POST", CHAT, body=json.dumps(body(400, stream=True)),
                         headers={"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.read(1)
            assert held(client)[0] == 1
            resp.read()
        finally:
            conn.close()
        wait_released(client)
        quiet(gw.url)
        client.close()


def test_a_redis_restart_keeps_a_tenants_quota_debt(
        tmp_path: Path, start_sim: StartSim, start_gateway: StartGateway) -> None:
    """The tenant's one request uses 300 output tokens (ignore_eos) against a day bucket of
    200: settled, the bucket is about 115 in debt, whether the request reserved its expected
    output (16 tokens, overdrawn at settlement) or its max_tokens (a full bucket gives once,
    going negative). A restarted Redis has no bucket; a full one would admit the tenant."""
    tenants = ("defaults: {expected_output_tokens: 16}\n"
               "tenants:\n  - {name: anonymous, tokens_per_day: 200}\n")
    key = "gw:quota:{anonymous:day}"
    with redis_server(tmp_path) as r, start_sim() as sim, \
            start_gateway(policy(sim.url, "open", tenants), "--redis-url", r.url) as gw:
        client = redis.Redis.from_url(r.url, socket_timeout=5)
        first = http("POST", gw.url + CHAT, body(300))
        assert first.status == 200, first
        assert first.json()["usage"]["completion_tokens"] == 300
        deadline = time.monotonic() + 5  # settled just after the last byte
        while (level := float(client.hget(key, "level") or 0)) > -50:
            assert time.monotonic() < deadline, f"not settled: level {level}"
            time.sleep(0.05)
        refused = http("POST", gw.url + CHAT, body())
        assert refused.status == 429, refused

        r.kill()
        r.start()  # empty, on the same port
        assert client.exists(key) == 0
        # Until a call reaches the new Redis, fail_mode open would not enforce the quota: wait
        # for the breaker to be closed (it opened if a call came while Redis was gone).
        poll_metric(gw.url, BREAKER, lambda v: v == 0, timeout=PROBE_S + 3 * TIMEOUT_S + 3)
        after = http("POST", gw.url + CHAT, body())
        assert after.status == 429, after  # still in debt, not a full bucket
        assert after.headers["x-ratelimit-remaining-tokens"] == "0"
        seeded = float(client.hget(key, "level") or 0)
        assert seeded < -50 and abs(seeded - level) < 5, (level, seeded)
        client.close()


def test_the_breaker_lets_one_probe_through_per_interval() -> None:
    now = [0.0]
    changes: list[tuple[int, int]] = []
    b = Breaker(1.0, clock=lambda: now[0], on_change=lambda old, new: changes.append((old, new)))
    assert b.admit() is False  # closed: an ordinary call
    b.failed()
    assert b.state == OPEN and b.admit() is None  # fails at once
    now[0] = 1.0
    assert b.admit() is True and b.state == HALF_OPEN  # the probe ...
    assert b.admit() is None  # ... alone
    b.failed()
    assert b.state == OPEN and b.admit() is None
    now[0] = 2.0
    probe = b.admit()
    b.abandoned(probe)  # its caller left: the next call probes at once
    assert b.state == OPEN and b.admit() is True
    b.succeeded()
    assert b.state == CLOSED and b.admit() is False
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (OPEN, HALF_OPEN),
                       (HALF_OPEN, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]


def test_a_redis_hung_at_start_delays_serving_by_the_warm_deadline_only(
        tmp_path: Path, start_sim: StartSim, start_gateway: StartGateway) -> None:
    # The state client is warmed before the gateway serves (slot map, primary, scripts); a
    # store that never answers gives up the warming after its deadline, with a warning, and
    # the requests then take the fail mode until the store answers.
    with redis_server(tmp_path) as r, start_sim() as sim:
        assert r.process is not None
        os.kill(r.process.pid, signal.SIGSTOP)
        try:
            with start_gateway(policy(sim.url, "open"), "--redis-url", r.url) as gw:
                assert "not warmed" in gw.log_path.read_text()  # redis-py's timeout, or 3 s
                assert http("POST", gw.url + CHAT, body(), timeout=30).status == 200
                os.kill(r.process.pid, signal.SIGCONT)
                poll_metric(gw.url, BREAKER, lambda v: v == 0,
                            timeout=PROBE_S + 3 * TIMEOUT_S + 3)
                assert http("POST", gw.url + CHAT, body()).status == 200
                quiet(gw.url)
        finally:
            os.kill(r.process.pid, signal.SIGCONT)
