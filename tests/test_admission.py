"""Admission invariants against real servers: engines, gateways and Redis on loopback."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import redis as redis_sync

from gateway.state.redis import pool_keys
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import Server, http, metric, openai_client, quiet, redis_server, scrape

# 64 blocks of 16 tokens: a few requests fill the engine, so admission must act.
SMALL_ENGINE = ("--num-gpu-blocks", "64", "--block-size", "16")
ADMISSION = """    admission: {kv_usage_max: 0.9, queue_size: 8, queue_wait_max_s: 4}
"""
MESSAGES = [{"role": "user", "content": "Tell me a long story about capacity planning."}]


def stream_all(gw: Server, max_tokens: int = 150) -> str:
    raw = openai_client(gw.url).chat.completions.with_raw_response.create(
        model="test-model", messages=MESSAGES, max_tokens=max_tokens,  # type: ignore[arg-type]
        stream=True, extra_body={"ignore_eos": True})
    for _ in raw.parse():
        pass
    return raw.headers["x-gateway-decision"]


@pytest.fixture(params=["memory", "redis"])
def state_args(request: pytest.FixtureRequest, redis_url: str) -> Iterator[list[str]]:
    if request.param == "memory":
        yield []
        return
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    yield ["--redis-url", redis_url, "--state-prefix", prefix]
    r = redis_sync.Redis.from_url(redis_url)
    blocks = r.hgetall(pool_keys("default", prefix)[2])
    tokens = int(r.get(pool_keys("default", prefix)[3]) or 0)
    assert all(int(v) == 0 for v in blocks.values()) and tokens == 0, (blocks, tokens)
    r.close()


def test_queue_then_admit_and_release_everything(start_sim: StartSim,
                                                 start_gateway: StartGateway,
                                                 state_args: list[str]) -> None:
    with start_sim(*SMALL_ENGINE) as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=ADMISSION), *state_args) as gw:
        s = scrape(gw.url)
        assert metric(s, "gateway_kv_blocks_capacity", backend="e0") == 64  # from the engine
        with cf.ThreadPoolExecutor(8) as pool:
            decisions = list(pool.map(lambda _: stream_all(gw), range(8)))
        assert "queued" in decisions and "admitted" in decisions
        s = scrape(gw.url)
        assert metric(s, "gateway_admission_decisions_total", decision="queued") >= 1
        assert metric(s, "gateway_queue_wait_seconds_count") >= 1
        # The engine never had to preempt: admission kept it within its KV cache.
        assert metric(scrape(sim.url), "vllm:num_preemptions_total") == 0
        quiet(gw.url, timeout=10)


def test_every_exit_releases_its_reservation(start_sim: StartSim, start_gateway: StartGateway,
                                             state_args: list[str]) -> None:
    """Completions, disconnects (before the first byte, mid-stream, while queued), engine
    errors and broken streams: afterwards not one block is still reserved."""
    with start_sim(*SMALL_ENGINE, "--seed", "7") as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=ADMISSION), *state_args) as gw:

        def complete(_: int) -> str:
            return stream_all(gw, 60)

        def leave_mid_stream(_: int) -> str:
            stream = openai_client(gw.url).chat.completions.create(
                model="test-model", messages=MESSAGES, max_tokens=400,  # type: ignore[arg-type]
                stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))
            stream.close()
            return "left"

        def leave_early(_: int) -> str:  # gives up while queued or before the first byte
            try:
                openai_client(gw.url, timeout=0.3).chat.completions.create(
                    model="test-model", messages=MESSAGES, max_tokens=400,  # type: ignore[arg-type]
                    extra_body={"ignore_eos": True})
            except (openai.APITimeoutError, openai.APIStatusError):
                return "gave up"
            return "done"

        def run(job: Callable[[int], str]) -> str:
            try:
                return job(0)
            except openai.APIStatusError as exc:
                # Twelve arrive at once against a queue of 8: refused at a full queue is one
                # more exit, and must release as surely as the others.
                assert exc.status_code == 503, exc
                return "rejected"

        jobs = [complete, leave_mid_stream, leave_early] * 4
        with cf.ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(run, jobs))
        assert {"admitted", "queued"} & set(outcomes), outcomes  # some completed
        # Now the engine misbehaves: 500s and streams cut after a few tokens.
        set_faults(sim, {"fail_rate": 0.5, "drop_rate": 0.5, "drop_after_tokens": 3})

        def flaky(_: int) -> str:
            try:
                return stream_all(gw, 30)
            except openai.APIError:
                return "failed"

        with cf.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(flaky, range(12)))
        assert "failed" in results
        quiet(gw.url, timeout=10)
        s = scrape(gw.url)
        assert metric(s, "gateway_requests_total", status="499") >= 1
        assert metric(s, "gateway_upstream_errors_total") >= 1


def test_prefill_backlog_queues_until_first_tokens(start_sim: StartSim,
                                                   start_gateway: StartGateway) -> None:
    """A limit of one prompt token awaiting its first token: each engine prefills one request
    at a time; the rest wait in the queue for a first byte, then all complete."""
    admission = ("    admission: {queue_size: 16, queue_wait_max_s: 20, "
                 "prefill_tokens_max: 1}\n")
    with start_sim("--time-scale", "20") as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=admission)) as gw:
        with cf.ThreadPoolExecutor(6) as pool:
            decisions = list(pool.map(lambda _: stream_all(gw, 20), range(6)))
        assert "queued" in decisions and "admitted" in decisions
        s = scrape(gw.url)
        assert metric(s, "gateway_admission_decisions_total", decision="queued",
                      reason="prefill_tokens") >= 1
        quiet(gw.url, timeout=10)


def set_faults(sim: Server, body: dict[str, object]) -> None:
    assert http("POST", sim.url + "/admin/faults", body).status == 200


def test_early_rejection_503_with_retry_after(start_sim: StartSim,
                                              start_gateway: StartGateway) -> None:
    no_queue = "    admission: {kv_usage_max: 0.9, queue_size: 0}\n"
    with start_sim(*SMALL_ENGINE) as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=no_queue)) as gw:
        with cf.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream_all, gw, 300) for _ in range(6)]
            errors = []
            for f in futures:
                try:
                    f.result()
                except openai.APIStatusError as exc:
                    errors.append(exc)
        assert errors, "6 long requests on 64 blocks: some must be refused"
        err = errors[0]
        assert err.status_code == 503
        assert int(err.response.headers["retry-after"]) >= 1
        assert err.response.headers["x-gateway-reason"] == "kv_blocks"
        assert "KV cache is at the admission limit" in err.message
        quiet(gw.url, timeout=10)


def test_long_prompts_go_to_the_long_pool(start_sim: StartSim,
                                          start_gateway: StartGateway) -> None:
    with start_sim() as short_engine, start_sim("--max-model-len", "32768") as long_engine:
        policy = policy_yaml([short_engine.url], long_backends=[long_engine.url], long_from=2048)
        with start_gateway(policy) as gw:
            c = openai_client(gw.url)
            long_text = "capacity " * 3000
            for content, pool in ((long_text, "long"), ("hi", "default"),
                                  ("capacity " * 2100, "long"), ("capacity " * 1900, "default")):
                raw = c.chat.completions.with_raw_response.create(
                    model="test-model", max_tokens=4,
                    messages=[{"role": "user", "content": content}])
                assert raw.headers["x-gateway-pool"] == pool
                prompt_tokens = int(raw.headers["x-gateway-prompt-tokens"])
                assert (prompt_tokens >= 2048) == (pool == "long")
                assert raw.parse().usage.prompt_tokens == prompt_tokens  # type: ignore[union-attr]
            assert metric(scrape(short_engine.url), "vllm:prompt_tokens_total") < 2048


def test_two_gateways_never_exceed_the_budget(start_sim: StartSim, start_gateway: StartGateway,
                                              redis_url: str) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    args = ("--redis-url", redis_url, "--state-prefix", prefix)
    r = redis_sync.Redis.from_url(redis_url)
    blocks_key = pool_keys("default", prefix)[2]
    # Overbooking off: the budget is then exactly 90% of the engine's 64 blocks, and what is
    # tested is the atomic check-and-reserve across replicas.
    exact = ADMISSION.replace("queue_size: 8", "queue_size: 8, overbook_max: 1.0")
    with start_sim(*SMALL_ENGINE) as sim:
        policy = policy_yaml([sim.url], pool_extra=exact)
        with start_gateway(policy, *args) as g1, start_gateway(policy, *args) as g2:
            peak = 0
            done = threading.Event()

            def watch() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, int(r.hget(blocks_key, "e0") or 0))
                    time.sleep(0.005)

            watcher = threading.Thread(target=watch)
            watcher.start()
            with cf.ThreadPoolExecutor(12) as pool:
                list(pool.map(lambda i: stream_all(g1 if i % 2 else g2, 120), range(12)))
            done.set()
            watcher.join()
            assert 0 < peak <= int(64 * 0.9), peak
            assert metric(scrape(sim.url), "vllm:num_preemptions_total") == 0
            quiet(g1.url, timeout=10)
            quiet(g2.url, timeout=10)
    assert int(r.hget(blocks_key, "e0") or 0) == 0
    r.close()


def test_redis_killed_and_restarted_under_load(start_sim: StartSim,
                                               start_gateway: StartGateway,
                                               tmp_path: Path) -> None:
    with redis_server(tmp_path) as redis:
        with start_sim(*SMALL_ENGINE) as sim, \
                start_gateway(policy_yaml([sim.url], pool_extra=ADMISSION),
                              "--redis-url", redis.url) as gw:
            statuses: list[int] = []
            stop = time.monotonic() + 6

            def load(_: int) -> None:
                while time.monotonic() < stop:
                    try:
                        stream_all(gw, 40)
                        statuses.append(200)
                    except openai.APIStatusError as exc:
                        statuses.append(exc.status_code)

            with cf.ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(load, i) for i in range(4)]
                time.sleep(1.5)
                redis.kill()
                time.sleep(2)
                redis.start()  # back, empty
                for f in futures:
                    f.result()
            assert statuses and 500 not in statuses
            assert statuses.count(200) > len(statuses) // 2  # fail-open kept serving
            s = scrape(gw.url)
            assert metric(s, "gateway_state_errors_total") >= 1
            quiet(gw.url, timeout=10)
        r = redis_sync.Redis(port=redis.port)
        blocks = r.hgetall(pool_keys("default")[2])
        assert all(int(v) == 0 for v in blocks.values()), blocks
        r.close()


def test_no_redis_env_fails_loudly() -> None:
    assert os.environ.get("REDIS_URL"), "Redis tests never skip silently"
