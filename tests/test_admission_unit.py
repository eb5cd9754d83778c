"""Admission decisions as plain code: no server, a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.controller import Admission, Ask, Overloaded, Ticket
from gateway.admission.decision import AskView, place
from gateway.admission.guard import LatencyGuard, combine, verdict
from gateway.admission.pool import MEASURED_RELEASES, MEASURED_S
from gateway.admission.queue import PRIORITIES, FairQueue, Waiter
from gateway.api.errors import headers_of
from gateway.errors import GatewayError
from gateway.observe.metrics import GatewayMetrics
from gateway.policy import parse_policy
from gateway.routing.backends import Backends
from gateway.routing.router import Router
from gateway.signals.engines import EngineScraper, parse_engine_metrics
from gateway.signals.quantiles import WindowedQuantiles
from gateway.state import MemoryState

POLICY = """
models:
  - {name: m, architecture: llama-3-8b}
pools:
  default:
    models: [m]
    max_model_len: 8192
    kv_blocks: 100
    prompt_tokens_max: 4096
    admission: {kv_usage_max: 1.0, queue_size: 2, queue_wait_max_s: 5}
    backends:
      - {name: a, url: "http://127.0.0.1:1"}
  long:
    models: [m]
    max_model_len: 65536
    kv_blocks: 1000
    prompt_tokens_min: 4096
    overflow_to: default
    overflow_max_concurrent: 1
    backends:
      - {name: l, url: "http://127.0.0.1:2"}
"""


def answer_headers(err: GatewayError) -> dict[str, str]:
    """The headers the caller gets for a refusal, as the API boundary renders them."""
    return {k.decode(): v.decode() for k, v in headers_of(err)}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(policy_text: str = POLICY) -> tuple[Admission, Clock, Backends]:
    policy = parse_policy(policy_text)
    clock = Clock()
    metrics = GatewayMetrics()
    backends = Backends(policy, metrics, clock)
    admission = Admission(policy, backends, MemoryState(clock), metrics, EngineScraper(5, clock),
                          clock)
    return admission, clock, backends


@pytest.mark.anyio
async def test_admits_until_blocks_run_out_then_rejects_without_queue_room() -> None:
    adm, _, _ = make()
    t1 = await adm.admit(Ask("default", 60, 960))
    t2 = await adm.admit(Ask("default", 40, 640))
    assert (t1.decision, t2.decision) == ("admitted", "admitted")
    assert adm.pools["default"].reserved["a"] == 100
    # Nothing drains yet: two wait (the queue holds 2), the third is refused at once.
    w1 = asyncio.ensure_future(adm.admit(Ask("default", 30, 480)))
    w2 = asyncio.ensure_future(adm.admit(Ask("default", 30, 480)))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as err:
        await adm.admit(Ask("default", 10, 160))
    assert answer_headers(err.value)["x-gateway-reason"] == "queue_full"
    assert int(answer_headers(err.value)["retry-after"]) >= 1
    await adm.release(t1)  # frees 60 blocks: both waiters fit
    r1, r2 = await asyncio.gather(w1, w2)
    assert (r1.decision, r2.decision) == ("queued", "queued")
    for t in (t2, r1, r2):
        await adm.release(t)
    assert adm.pools["default"].reserved["a"] == 0
    assert len(adm.pools["default"].queue) == 0


@pytest.mark.anyio
async def test_predicted_wait_over_deadline_is_rejected_early() -> None:
    adm, _, _ = make()
    held = await adm.admit(Ask("default", 100, 1600))
    ps = adm.pools["default"]
    # Measured while full: 100 tokens/s, so 1,600 tokens take 16 s > 5 s.
    ps.drain_rate, ps.drain_busy_s, ps.drain_releases = 100.0, MEASURED_S, MEASURED_RELEASES
    with pytest.raises(Overloaded) as err:
        await adm.admit(Ask("default", 10, 1600))
    assert answer_headers(err.value)["x-gateway-reason"] == "predicted_wait"
    assert int(answer_headers(err.value)["retry-after"]) == 16
    assert "KV cache is at the admission limit" in err.value.message
    assert "predicted wait (16.0s) exceeds the queue deadline (5s)" in err.value.message
    await adm.release(held)


@pytest.mark.anyio
async def test_client_deadline_shorter_than_policy() -> None:
    adm, _, _ = make()
    held = await adm.admit(Ask("default", 100, 1600))
    ps = adm.pools["default"]
    # Measured: any wait is predicted to fit.
    ps.drain_rate, ps.drain_busy_s, ps.drain_releases = 1e6, MEASURED_S, MEASURED_RELEASES
    with pytest.raises(Overloaded) as err:
        await adm.admit(Ask("default", 10, 160, deadline_s=0.05))
    assert answer_headers(err.value)["x-gateway-reason"] == "queue_timeout"
    assert len(adm.pools["default"].queue) == 0
    await adm.release(held)


@pytest.mark.anyio
async def test_cancelled_waiter_leaves_queue_and_holds_nothing() -> None:
    adm, _, _ = make()
    held = await adm.admit(Ask("default", 100, 1600))
    waiter = asyncio.ensure_future(adm.admit(Ask("default", 10, 160)))
    await asyncio.sleep(0)
    assert len(adm.pools["default"].queue) == 1
    waiter.cancel()  # the caller disconnected while queued
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(adm.pools["default"].queue) == 0
    await adm.release(held)
    assert adm.pools["default"].reserved["a"] == 0


@pytest.mark.anyio
async def test_sheddable_waiter_is_pushed_out_by_critical() -> None:
    adm, _, _ = make()
    held = await adm.admit(Ask("default", 100, 1600))
    shed = asyncio.ensure_future(adm.admit(Ask("default", 10, 160,
                                               priority=PRIORITIES["sheddable"])))
    std = asyncio.ensure_future(adm.admit(Ask("default", 10, 160)))
    await asyncio.sleep(0)
    crit = asyncio.ensure_future(adm.admit(Ask("default", 10, 160,
                                               priority=PRIORITIES["critical"])))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as err:
        await shed
    assert answer_headers(err.value)["x-gateway-reason"] == "shed"
    await adm.release(held)
    first, second = await asyncio.gather(crit, std)
    for t in (first, second):
        await adm.release(t)


def test_fair_queue_orders_by_priority_then_served_tokens() -> None:
    loop = asyncio.new_event_loop()
    q = FairQueue(10)

    def w(priority: str, caller: str) -> Waiter:
        return Waiter(PRIORITIES[priority], caller, 100, 0.0, 10.0, loop.create_future())

    heavy = w("standard", "heavy")
    light = w("standard", "light")
    shed = w("sheddable", "light")
    crit = w("critical", "heavy")
    for x in (heavy, shed, light, crit):
        q.push(x)
    assert q.ordered() == [crit, heavy, light, shed]  # equal counters: first come first
    q.charge("heavy", 5000)  # heavy's earlier requests were served 5,000 tokens
    assert q.ordered() == [crit, light, heavy, shed]
    # A newcomer starts at the lowest counter among those waiting: idling earns no credit.
    q.push(w("standard", "newcomer"))
    assert q.served["newcomer"] == q.served["light"]
    loop.close()


def test_latency_guard_cuts_and_recovers() -> None:
    g = LatencyGuard(ceiling=10_000, floor=500)
    assert g.update(0.0, "red")
    assert g.limit == pytest.approx(7000) and g.state == "red"
    assert not g.update(1.0, "red")  # held: one slow window, one cut
    assert g.limit == pytest.approx(7000)
    assert g.update(6.0, "red")
    assert g.limit == pytest.approx(4900)
    for i in range(100):
        g.update(7.0 + i, "green")
    assert g.limit == 10_000 and g.state == "green"
    g.update(200.0, "unsure")  # no verdict: nothing moves
    assert g.limit == 10_000 and g.state == "green"


def test_latency_guard_cuts_the_load_in_flight_and_grows_only_while_it_binds() -> None:
    g = LatencyGuard(ceiling=1_000_000, floor=500)
    # 40,000 tokens in flight against a ceiling of a million: cutting the ceiling by 30% would
    # hold nothing back; the cut takes 30% off what is in flight.
    assert g.update(0.0, "red", inflight=40_000)
    assert g.limit == pytest.approx(28_000)
    # Green, but the load is far under the limit (a lull): the limit does not creep up.
    g.update(10.0, "green", inflight=5_000)
    assert g.limit == pytest.approx(28_000)
    # Green and binding: it grows by 5% of the ceiling a tick (additive increase: back from
    # a deep cut in seconds).
    g.update(11.0, "green", inflight=27_000)
    assert g.limit == pytest.approx(78_000)


def test_guard_verdict_is_red_only_when_the_p99_is_surely_over() -> None:
    assert verdict(over=1, samples=20) == "green"   # one of 20: P99 is the worst; noise
    assert verdict(over=1, samples=8) == "unsure"   # one of 8 over: not enough to say
    assert verdict(over=2, samples=8) == "red"
    assert verdict(over=0, samples=5) == "green" and verdict(0, 4) == "unsure"
    assert verdict(over=2, samples=300) == "green"  # under 1%
    # 4 of 300 is over 1%, but a P99 right on its line shows 4 or more one time in three:
    # a guard at the knee would cut every few seconds. 9 of 300 happens under 1% of the time.
    assert verdict(over=4, samples=300) == "unsure"
    assert verdict(over=9, samples=300) == "red"
    assert verdict(over=2, samples=20) == "unsure" and verdict(over=3, samples=20) == "red"
    assert verdict(over=400, samples=30_000) == "red"  # many samples: no overflow
    assert combine("green", "red") == "red" and combine("green", "unsure") == "unsure"
    assert combine("green", "green") == "green"


def test_guard_judges_a_cut_only_by_requests_admitted_after_it() -> None:
    adm, clock, _ = make()
    ps = adm.pools["default"]
    ps.guard.last_cut = clock.now - 10  # a cut 10 s ago; the windows were cleared then
    adm.observe_latency("default", 5.0, 0.5, admitted_s_ago=30)  # admitted before it
    assert ps.ttft.count() == 0 and ps.tpot.count() == 0
    adm.observe_latency("default", 0.2, 0.02, admitted_s_ago=4)  # admitted under the new limit
    assert ps.ttft.count() == 1 and ps.tpot.count() == 1


def test_windowed_quantiles_follow_the_window() -> None:
    clock = Clock()
    q = WindowedQuantiles(window_s=10, clock=clock)
    for i in range(1000):
        q.observe(0.010 if i % 100 else 2.0)
    p99 = q.quantile(0.99)
    assert p99 is not None and 0.0095 <= p99 <= 0.0106
    assert q.quantile(0.999) == pytest.approx(2.0, rel=0.05)
    clock.now += 11  # the window moved past every sample
    assert q.quantile(0.99) is None
    q.observe(1.0)
    q.observe(3.0)
    assert q.count_over(2.0) == 1 and q.count_over(0.5) == 2
    q.clear()
    assert q.count() == 0 and q.quantile(0.5) is None


def test_router_long_prompts_and_overflow() -> None:
    adm, _, backends = make()
    router = Router(adm.policy, backends)
    model = router.model("m")
    assert router.route(model, 100, 100).pool == "default"
    assert router.route(model, 5000, 100).pool == "long"
    # 10K prompt + 100 fits only the long pool's context.
    assert router.route(model, 10_000, 100).pool == "long"
    backends.pools["long"][0].probe_ok = False  # the long pool goes down
    route = router.route(model, 5000, 100)
    assert (route.pool, route.overflow) == ("default", True)


@pytest.mark.anyio
async def test_overflow_is_capped() -> None:
    adm, _, _ = make()
    t = await adm.admit(Ask("default", 10, 5000, overflow=True))
    with pytest.raises(Overloaded) as err:
        await adm.admit(Ask("default", 10, 5000, overflow=True))
    assert "overflowed long request" in err.value.message
    await adm.release(t)
    t2: Ticket = await adm.admit(Ask("default", 10, 5000, overflow=True))
    await adm.release(t2)


def test_engine_metrics_parse_vllm_and_sglang() -> None:
    vllm = """# HELP vllm:num_requests_waiting x
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 7.0
vllm:kv_cache_usage_perc{model_name="m"} 0.42
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 5.0
"""
    s = parse_engine_metrics(vllm, "vllm", 1.0)
    assert (s.running, s.waiting, s.kv_usage, s.num_gpu_blocks, s.block_size) == \
        (3.0, 7.0, 0.42, 2048, 16)
    sg = parse_engine_metrics("sglang:num_queue_reqs 2\nsglang:token_usage 0.5\n"
                              "sglang:num_running_reqs 4\n", "sglang", 1.0)
    assert (sg.running, sg.waiting, sg.kv_usage) == (4.0, 2.0, 0.5)


def test_stale_engine_sample_is_unknown() -> None:
    adm, clock, _ = make(POLICY.replace("queue_size: 2", "queue_size: 2, waiting_max: 1"))
    adm.scraper.samples[("default", "a")] = parse_engine_metrics(
        'vllm:num_requests_waiting{model_name="m"} 9\n', "vllm", clock.now)
    assert adm.capacity.engine_full(adm.pools["default"], "a") == "engine_waiting"
    clock.now += 6  # older than metrics_max_age_s (5 s): unknown, not "full" nor "idle"
    assert adm.scraper.fresh("default", "a") is None
    assert adm.capacity.engine_full(adm.pools["default"], "a") is None


@pytest.mark.anyio
async def test_static_rule_sheds_on_engine_signals_only() -> None:
    adm, clock, _ = make(POLICY.replace("admission: {kv_usage_max: 1.0, queue_size: 2, "
                                        "queue_wait_max_s: 5}", "admission: {mode: static}"))
    t = await adm.admit(Ask("default", 10_000, 10**6))  # no reservation: anything goes
    assert t.lease is None and t.reason == "static_rule"
    adm.scraper.samples[("default", "a")] = parse_engine_metrics(
        'vllm:num_requests_waiting{model_name="m"} 6\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n', "vllm", clock.now)
    with pytest.raises(Overloaded) as err:
        await adm.admit(Ask("default", 1, 1))
    assert answer_headers(err.value)["x-gateway-reason"] == "static_rule"
    adm.scraper.samples[("default", "a")] = parse_engine_metrics(
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.85\n', "vllm", clock.now)
    with pytest.raises(Overloaded):
        await adm.admit(Ask("default", 1, 1))


def test_overbooking_is_learned_from_the_engines_usage() -> None:
    adm, clock, _ = make()
    ps = adm.pools["default"]
    ps.reserved["a"] = 90  # reservations: 90 of 100 blocks; the engine holds 45
    for _ in range(40):
        adm.on_engine_sample("default", "a", parse_engine_metrics(
            'vllm:kv_cache_usage_perc{model_name="m"} 0.45\n', "vllm", clock.now))
    assert ps.overbook["a"] == pytest.approx(2.0, rel=0.01)
    assert 198 <= adm.max_blocks(ps, "a") <= 200  # 100 blocks x kv_usage_max 1.0 x ~2.0
    # ...while the engine's own usage stays the hard line.
    adm.scraper.samples[("default", "a")] = parse_engine_metrics(
        'vllm:kv_cache_usage_perc{model_name="m"} 0.95\n', "vllm", clock.now)
    assert adm.capacity.engine_full(ps, "a") is None  # kv_usage_max is 1.0 in this policy
    tight, clock3, _ = make(POLICY.replace("kv_usage_max: 1.0", "kv_usage_max: 0.9"))
    tight.pools["default"].overbook["a"] = 1.5
    tight.scraper.samples[("default", "a")] = parse_engine_metrics(
        'vllm:kv_cache_usage_perc{model_name="m"} 0.95\n', "vllm", clock3.now)
    assert tight.capacity.engine_full(tight.pools["default"], "a") == "engine_kv"
    # An idle engine teaches nothing.
    adm2, clock2, _ = make()
    adm2.on_engine_sample("default", "a", parse_engine_metrics(
        'vllm:kv_cache_usage_perc{model_name="m"} 0.01\n', "vllm", clock2.now))
    assert adm2.pools["default"].overbook.get("a", 1.0) == 1.0


@pytest.mark.anyio
async def test_prefill_backlog_holds_prompts_until_first_tokens_come_back() -> None:
    adm, _, _ = make(POLICY.replace("queue_wait_max_s: 5}",
                                    "queue_wait_max_s: 5, prefill_tokens_max: 1000}"))
    ps = adm.pools["default"]
    first = await adm.admit(Ask("default", 1, 700, prompt_tokens=600))
    assert ps.prefill["a"] == 600
    # 600 more would put 1,200 prompt tokens ahead of the engine's next first token.
    placed = place(adm.view(Ask("default", 1, 700, prompt_tokens=600)),
                   AskView(1, 700))
    assert placed.backend is None and placed.reason == "prefill_tokens"
    assert adm.preview(Ask("default", 1, 700, prompt_tokens=600))["reason"] == \
        "prefill_tokens"
    adm.prefill_done(first)  # its first token came back: its prompt is prefilled
    adm.prefill_done(first)  # once only
    assert ps.prefill["a"] == 0
    second = await adm.admit(Ask("default", 1, 700, prompt_tokens=600))
    await adm.release(second)  # ended before its first byte: the release clears it
    assert ps.prefill["a"] == 0
    # An idle engine takes a prompt longer than the whole limit: it must run somewhere.
    big = await adm.admit(Ask("default", 1, 5000, prompt_tokens=4000))
    await adm.release(big)
    await adm.release(first)
    # Two replicas alive: each holds half the limit, as it sees only its own streams.
    adm.replicas = 2
    third = await adm.admit(Ask("default", 1, 500, prompt_tokens=400))
    assert adm.capacity.prefill_full(ps, "a", 200) and not adm.capacity.prefill_full(ps, "a", 100)
    await adm.release(third)
    assert adm.metrics.prefill_tokens_pending.labels("default", "a")._value.get() == 0


@pytest.mark.anyio
async def test_a_full_prefill_backlog_without_queue_room_says_so() -> None:
    adm, _, _ = make(POLICY.replace("queue_size: 2, queue_wait_max_s: 5}",
                                    "queue_size: 0, prefill_tokens_max: 1000}"))
    first = await adm.admit(Ask("default", 1, 700, prompt_tokens=600))
    with pytest.raises(Overloaded) as err:
        await adm.admit(Ask("default", 1, 700, prompt_tokens=600))
    assert answer_headers(err.value)["x-gateway-reason"] == "prefill_tokens"
    assert "prefill backlog is at the limit" in str(err.value)
    await adm.release(first)
