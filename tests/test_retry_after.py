"""Every Retry-After is a wait a client can use (issue 43, finding 11).

In front of a real vLLM, the first overload after start-up told six callers
`retry-after: 233077826149338`: the pool's drain rate, an EWMA of the tokens released each
second, had decayed toward zero through the quiet seconds after a warm-up request, and the
predicted wait divided by it. A pool now measures its drain only while it is full and predicts
from its planned rate until it has (gateway/admission/ticker.py), every prediction is bounded
(`WAIT_HORIZON_S`), and every Retry-After and retry-after-ms has a ceiling where the headers
are rendered (`RETRY_AFTER_MAX_S`, docs/errors.md).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass

import aiohttp
import pytest

from gateway.admission import ticker
from gateway.admission.controller import Admission, Ask, Overloaded
from gateway.admission.pool import MEASURED_RELEASES, MEASURED_S
from gateway.admission.waiting import WAIT_HORIZON_S
from gateway.api.errors import headers_of
from gateway.errors import GatewayError, QuotaExceeded, RateWindow
from gateway.observe.metrics import GatewayMetrics
from gateway.policy import parse_policy
from gateway.routing.backends import Backends
from gateway.signals.engines import EngineScraper
from gateway.state import MemoryState
from gateway.upstream.engine_errors import engine_error_headers
from gateway.wire.openai import RETRY_AFTER_MAX_S, retry_headers
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import Server, http, quiet

# 100 blocks of 16 tokens, a model the gateway has no architecture for (so no roofline), and
# the policy's latency lines: a request holds its tokens for the TTFT line and 256 expected
# output tokens at the TPOT line, 2 + 256 x 0.06 = 17.36 s, so the full pool (1,600 tokens)
# is planned to drain 1,600 / 17.36 tokens/s.
POLICY = """
models:
  - {name: m}
pools:
  default:
    models: [m]
    max_model_len: 8192
    kv_blocks: 100
    admission: {kv_usage_max: 1.0, queue_size: 4, queue_wait_max_s: 5, ttft_p99_max_s: 2,
                tpot_p99_max_s: 0.06}
    backends:
      - {name: a, url: "http://127.0.0.1:1"}
"""
HOLD_S = 2 + 256 * 0.06
# The same pool of an 8B model on an H100: the planner's roofline says how fast it decodes.
ROOFLINE = POLICY.replace("{name: m}", "{name: m, architecture: llama-3-8b}").replace(
    ", ttft_p99_max_s: 2,\n                tpot_p99_max_s: 0.06}", "}")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(policy_text: str = POLICY) -> Admission:
    policy = parse_policy(policy_text)
    clock = Clock()
    metrics = GatewayMetrics()
    return Admission(policy, Backends(policy, metrics, clock), MemoryState(clock), metrics,
                     EngineScraper(5, clock), clock)


def answer_headers(err: GatewayError) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in headers_of(err)}


async def refusal(adm: Admission, ask: Ask) -> Overloaded:
    with pytest.raises(Overloaded) as err:
        await adm.admit(ask)
    return err.value


# --- the prediction, on a cold pool ---------------------------------------------------------

@pytest.mark.anyio
async def test_a_cold_pool_predicts_from_its_plan_not_a_decayed_drain() -> None:
    """The incident: one warm-up request measured a drain, ~90 quiet seconds decayed it x0.7
    a second to ~1e-12 tokens/s, and the first overload divided by it."""
    adm = make()
    held = await adm.admit(Ask("default", 100, 1600))  # the whole KV budget
    adm.pools["default"].drain_rate = 1e-12
    err = await refusal(adm, Ask("default", 10, 1600))
    h = answer_headers(err)
    # 1,600 tokens at the planned 1,600 / 17.36 tokens/s: one request's hold, 17.36 s.
    assert (h["retry-after"], h["retry-after-ms"], h["x-should-retry"]) == \
        ("18", "18000", "true")
    assert h["x-gateway-reason"] == "predicted_wait"
    assert "the predicted wait (17.4s) exceeds the queue deadline (5s). Retry after 18s." \
        in err.message
    await adm.release(held)


@pytest.mark.anyio
async def test_a_cold_pool_with_no_drain_yet_is_refused_on_its_plan_at_once() -> None:
    """Nothing measured at all: the plan says the wait is past the caller's deadline, so it
    is told so at once, with the plan's figure, rather than left to time out in the queue."""
    adm = make()
    held = await adm.admit(Ask("default", 100, 1600))
    start = time.monotonic()
    err = await refusal(adm, Ask("default", 10, 800, deadline_s=0.5))
    assert time.monotonic() - start < 0.4
    h = answer_headers(err)
    assert (h["x-gateway-reason"], h["retry-after"]) == ("predicted_wait", "9")  # 8.68 s
    await adm.release(held)


@pytest.mark.anyio
async def test_a_cold_pool_of_a_known_model_predicts_from_its_roofline() -> None:
    adm = make(ROOFLINE)
    ps = adm.pools["default"]
    assert ps.pace is not None and ps.pace.roofline is not None
    # One request of 2,048 + 256 tokens at a time on 1,600 tokens: its prefill and 256 decode
    # steps of one sequence, ~2.4 s (an 8B model's 16 GB of weights read a step).
    hold = ps.pace.hold_s(1)
    assert hold is not None and 2 < hold < 3
    assert ps.planned_drain_rate == pytest.approx(1600 / hold)
    held = await adm.admit(Ask("default", 100, 1600))
    ps.drain_rate = 1e-12
    err = await refusal(adm, Ask("default", 10, 1600, deadline_s=1.0))
    h = answer_headers(err)
    assert (h["x-gateway-reason"], h["retry-after"]) == ("predicted_wait", "3")
    assert f"the predicted wait ({hold:.1f}s)" in err.message
    await adm.release(held)


def test_the_plan_follows_the_pools_limit_and_its_replicas() -> None:
    ps = make().pools["default"]
    assert ps.pace is not None and ps.pace.hold_s(1) == pytest.approx(HOLD_S)
    assert ps.planned_drain_rate == pytest.approx(1600 / HOLD_S)
    ps.guard.limit = 800  # the latency guard cut it: half in flight, half the drain
    ticker.plan_drain(ps, replicas=2)  # and two replicas queue for the same engines
    assert ps.planned_drain_rate == pytest.approx(800 / HOLD_S / 2)
    # No lines and no architecture: no plan; the queue's deadline decides until measured.
    bare = make(POLICY.replace(", ttft_p99_max_s: 2,\n                tpot_p99_max_s: 0.06}",
                               "}")).pools["default"]
    assert (bare.pace, bare.planned_drain_rate, bare.wait_rate) == (None, 0.0, None)


def test_only_a_full_pool_measures_its_drain() -> None:
    ps = make().pools["default"]
    planned = ps.planned_drain_rate
    ps.drained_tokens, ps.drained_requests = 50, 1  # a warm-up request, then quiet: neither
    for _ in range(90):  # is the pool's pace
        ticker.update_drain_rate(ps, 1.0)
    assert (ps.drain_rate, ps.drain_busy_s, ps.wait_rate) == (0.0, 0.0, planned)
    for _ in range(int(MEASURED_S) + 3):  # full, and its long requests not ended yet: no
        ps.pressed = True                  # drain seen, which is not a drain of zero
        ticker.update_drain_rate(ps, 1.0)
    assert (ps.drain_measured, ps.wait_rate) == (False, planned)
    for i in range(MEASURED_RELEASES):  # full, and releasing 500 tokens a second
        ps.pressed = True
        ps.drained_tokens, ps.drained_requests = 500, 1
        ticker.update_drain_rate(ps, 1.0)
        assert ps.wait_rate == (planned if i + 1 < MEASURED_RELEASES else 500.0)
    for _ in range(60):  # quiet again: the measured pace is kept, not decayed
        ticker.update_drain_rate(ps, 1.0)
    assert ps.wait_rate == 500.0


# --- the bounds -----------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_measured_drain_near_zero_predicts_the_horizon_and_says_the_ceiling() -> None:
    """A full pool that released nothing for seconds: the wait is 'long', not 1e300 s."""
    adm = make()
    ps = adm.pools["default"]
    held = await adm.admit(Ask("default", 100, 1600))
    for rate in (1e-300, 0.0):
        ps.drain_rate, ps.drain_busy_s, ps.drain_releases = rate, MEASURED_S, MEASURED_RELEASES
        err = await refusal(adm, Ask("default", 10, 1600))
        assert err.retry_after_s == WAIT_HORIZON_S
        h = answer_headers(err)
        assert (h["retry-after"], h["retry-after-ms"], h["x-should-retry"]) == \
            ("60", "60000", "false")
        assert f"the predicted wait (over {WAIT_HORIZON_S:g}s) exceeds the queue deadline " \
               "(5s). Retry after 60s." in err.message
    await adm.release(held)


@pytest.mark.parametrize(("wait_s", "after", "ms", "should"), [
    (0.2, "1", "200", "true"),
    (17.36, "18", "17360", "true"),
    (RETRY_AFTER_MAX_S, "60", "60000", "true"),
    (60.2, "60", "60000", "false"),
    (233077826149337.3, "60", "60000", "false"),  # issue 43's
    (1e300, "60", "60000", "false"),
    (math.inf, "60", "60000", "false"),
    (math.nan, "60", "60000", "true"),
    (-3.0, "1", "1", "true"),
])
def test_every_retry_after_has_a_ceiling(wait_s: float, after: str, ms: str,
                                         should: str) -> None:
    h = {k.decode(): v.decode() for k, v in retry_headers(wait_s)}
    assert (h["retry-after"], h["retry-after-ms"], h["x-should-retry"]) == (after, ms, should)


def test_a_days_quota_says_the_ceiling_and_not_to_retry() -> None:
    """A tenant's daily tokens are spent for three hours: the SDK is told not to retry, a plain
    client to ask again in a minute; the message still says when the bucket holds enough."""
    err = QuotaExceeded("Rate limit reached ... Please try again in 10800.0s.",
                        RateWindow(100_000, 0, 86_400.0, 10_800.0))
    h = answer_headers(err)
    assert (h["retry-after"], h["retry-after-ms"], h["x-should-retry"]) == \
        ("60", "60000", "false")


# --- end to end: a fresh gateway's first overload -------------------------------------------

# The incident's engine: 20 KV blocks of 128 tokens. The gateway holds 18 of them (kv_usage_max
# 0.9), the planner's queue deadline is 0.5 s (a quarter of the TTFT target).
ENGINE = ("--num-gpu-blocks", "20", "--block-size", "128")
POOL = """    block_size: 128
    kv_blocks: 20
    admission: {kv_usage_max: 0.9}
"""
PROMPT = "Plan the capacity of a fleet of engines for a burst of long prompts. " * 30
BURST = 8  # each reserves 6 of the 18 blocks: three run, five are refused


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    message: str


async def burst(url: str, n: int, max_tokens: int = 200) -> list[Answer]:
    """`n` requests at once, each a fresh connection: what each was answered."""
    body = {"model": "test-model", "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": PROMPT}]}

    async def one(session: aiohttp.ClientSession) -> Answer:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            data = await r.json()
            error = data.get("error") or {}
            return Answer(r.status, {k.lower(): v for k, v in r.headers.items()},
                          str(error.get("message", "")))

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=n)) as session:
        return list(await asyncio.gather(*(one(session) for _ in range(n))))


def assert_sane(answers: list[Answer]) -> list[Answer]:
    """The 503s among `answers`, each with a Retry-After a client can use, and the same in its
    message."""
    refused = [a for a in answers if a.status == 503]
    assert all(a.status in (200, 503) for a in answers), answers
    assert refused, "the burst must overload the pool"
    for a in refused:
        after, ms = int(a.headers["retry-after"]), int(a.headers["retry-after-ms"])
        assert 1 <= after <= RETRY_AFTER_MAX_S, a
        assert 1000 <= ms <= RETRY_AFTER_MAX_S * 1000, a
        told = re.search(r"Retry after (\d+)s\.", a.message)
        assert told is not None and int(told.group(1)) == after, a
        predicted = re.search(r"predicted wait \(([0-9.]+)s\)", a.message)
        if predicted is not None:
            assert float(predicted.group(1)) <= WAIT_HORIZON_S, a
    return refused


def test_a_fresh_gateways_first_overload_is_told_a_sane_wait(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """The burst lands on a pool that has measured nothing: the wait is predicted from its
    plan (the roofline: its 2,304 tokens in flight drain in ~2.4 s, so a request of ~660
    waits ~0.7 s, past the 0.5 s deadline), and it is told so at once, not left to time out
    in the queue."""
    with start_sim(*ENGINE) as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=POOL)) as gw:
        refused = assert_sane(asyncio.run(burst(gw.url, BURST)))
        for a in refused:
            assert a.headers["x-gateway-reason"] == "predicted_wait", a
            assert a.headers["x-should-retry"] == "true", a
            assert int(a.headers["retry-after"]) <= 5, a
        quiet(gw.url, timeout=20)


def test_the_first_overload_after_a_quiet_warm_up_is_told_a_sane_wait(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """The incident itself: one small request, a few quiet seconds, then the burst."""
    with start_sim(*ENGINE) as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=POOL)) as gw:
        warm_up(gw)
        time.sleep(6)  # the old EWMA: the warm-up's rate x 0.7^6
        refused = assert_sane(asyncio.run(burst(gw.url, BURST)))
        assert all(int(a.headers["retry-after"]) <= 5 for a in refused), refused
        quiet(gw.url, timeout=20)


def warm_up(gw: Server) -> None:
    r = http("POST", gw.url + "/v1/chat/completions", {
        "model": "test-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30)
    assert r.status == 200, r


@pytest.mark.parametrize("said, after, should", [
    ("inf", "60", "false"), ("1e30", "60", "false"), ("nan", "60", "true"), ("-1", "1", "true"),
    ("5", "5", "true")])
def test_an_engines_retry_after_is_relayed_within_the_ceiling(said: str, after: str,
                                                              should: str) -> None:
    headers = {"retry-after": said}
    engine_error_headers(503, headers)
    assert (headers["retry-after"], headers["x-should-retry"]) == (after, should)
    assert 1 <= int(headers["retry-after-ms"]) <= 60_000


def test_an_engines_retry_after_as_a_date_is_passed_on() -> None:
    headers = {"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}
    engine_error_headers(429, headers)
    assert headers["retry-after"] == "Wed, 21 Oct 2026 07:28:00 GMT"
