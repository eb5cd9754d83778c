"""The gateway as an OpenAI endpoint: the official SDK notices nothing but the gateway's headers.

Real servers on loopback: the simulated engine and the gateway run as processes.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import (
    Server,
    free_port,
    gateway_cmd,
    http,
    metric,
    openai_client,
    poll_metric,
    run_server,
    scrape,
    settled,
)

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Count to ten."}]


def test_chat_stream_through_gateway(sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    c = openai_client(gw.url)
    raw = c.chat.completions.with_raw_response.create(
        model="test-model", messages=MESSAGES, max_tokens=12, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    assert raw.headers["x-gateway-pool"] == "default"
    assert raw.headers["x-gateway-backend"] == "e0"
    assert raw.headers["x-request-id"].startswith("gw-")
    chunks = list(raw.parse())
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens > 10
    assert text


def test_chat_non_stream_and_request_id_propagated(
        sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    raw = openai_client(gw.url).chat.completions.with_raw_response.create(
        model="test-model", messages=MESSAGES, max_tokens=5,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "trace-abc-123"})
    assert raw.headers["x-request-id"] == "trace-abc-123"
    resp = raw.parse()
    assert resp.usage is not None and resp.usage.completion_tokens == 5
    assert resp.choices[0].message.content


def test_completions_stream_and_non_stream(sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    c = openai_client(gw.url)
    resp = c.completions.create(model="test-model", prompt="Once upon a time", max_tokens=7,
                                extra_body={"ignore_eos": True})
    assert resp.usage is not None and resp.usage.completion_tokens == 7
    stream = c.completions.create(model="test-model", prompt=[1, 2, 3, 4], max_tokens=6,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 4
    assert chunks[-1].usage.completion_tokens == 6


def test_models_lists_policy_models(sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    assert [m.id for m in openai_client(gw.url).models.list()] == ["test-model"]


def test_metrics_after_traffic(sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    c = openai_client(gw.url)
    for _ in range(3):
        list(c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                       max_tokens=4, stream=True,
                                       extra_body={"ignore_eos": True}))
    s = settled(gw.url, "gateway_requests_total", 3, pool="default", status="200")
    assert metric(s, "gateway_requests_total", pool="default", status="200") >= 3
    assert metric(s, "gateway_ttft_seconds_count", pool="default") >= 3
    assert metric(s, "gateway_tpot_seconds_count", pool="default") >= 3
    assert metric(s, "gateway_request_duration_seconds_count", pool="default") >= 3
    assert metric(s, "gateway_backend_up", pool="default", backend="e0") == 1
    assert metric(s, "gateway_inflight_requests", pool="default") == 0
    assert metric(s, "gateway_event_loop_lag_seconds_count") >= 0


def _long_stream_started(c: openai.OpenAI) -> openai.Stream[Any]:
    """A 4,000-token stream, its first three chunks read: a caller about to leave."""
    stream = c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                       max_tokens=4000, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    return stream


def test_client_disconnect_cancels_upstream(sim_and_gateway: tuple[Server, Server]) -> None:
    sim, gw = sim_and_gateway
    stream = _long_stream_started(openai_client(gw.url))
    assert metric(scrape(gw.url), "gateway_inflight_requests", pool="default") == 1
    stream.close()  # the caller goes away mid-stream
    # Each settles and then stays (nothing else is sent), so the last scrape sees all three.
    e = poll_metric(sim.url, "vllm:num_requests_running", lambda v: v == 0)  # it stopped
    poll_metric(gw.url, "gateway_inflight_requests", lambda v: v == 0, pool="default")
    g = poll_metric(gw.url, "gateway_requests_total", lambda v: v == 1, status="499")
    # 4000 tokens would take seconds; the engine stopped well before.
    assert metric(e, "vllm:generation_tokens_total") < 4000
    assert metric(g, "gateway_kv_blocks_reserved") == 0


def test_aiohttp_as_the_engine_client(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """`upstream.client: aiohttp` (the client for https engines too): the same answers, and a
    caller who leaves still stops the engine."""
    with start_sim() as sim, start_gateway(policy_yaml(
            [sim.url], extra="upstream:\n  client: aiohttp\n")) as gw:
        c = openai_client(gw.url)
        chunks = list(c.chat.completions.create(
            model="test-model", messages=MESSAGES, max_tokens=6, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        whole = c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                          max_tokens=3, extra_body={"ignore_eos": True})
        assert whole.usage is not None and whole.usage.completion_tokens == 3
        _long_stream_started(c).close()
        e = poll_metric(sim.url, "vllm:num_requests_running", lambda v: v == 0)
        assert metric(e, "vllm:generation_tokens_total") < 4000


def test_dead_backend_skipped_and_retried(start_sim: StartSim,
                                          start_gateway: StartGateway) -> None:
    with start_sim() as doomed, start_sim() as sim:
        policy = policy_yaml([doomed.url, sim.url]).replace("probe_interval_s: 0.5",
                                                           "probe_interval_s: 60")
        with start_gateway(policy) as gw:
            doomed.stop()  # dies after the gateway's probe saw it healthy
            c = openai_client(gw.url)
            for _ in range(4):
                resp = c.chat.completions.with_raw_response.create(
                    model="test-model", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
                assert resp.headers["x-gateway-backend"] == "e1"
            # The last request is counted just after its last byte: wait for it, not a scrape.
            s = poll_metric(gw.url, "gateway_requests_total", lambda v: v == 4, status="200")
            # Connect refused twice (the failure threshold), then ejected: skipped.
            assert metric(s, "gateway_upstream_errors_total", backend="e0", kind="connect") == 2
            assert metric(s, "gateway_backend_up", backend="e0") == 0


def test_backend_down_at_start_is_not_used(start_sim: StartSim,
                                           start_gateway: StartGateway) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with start_sim() as sim, start_gateway(policy_yaml([dead, sim.url])) as gw:
        for _ in range(3):
            resp = openai_client(gw.url).chat.completions.with_raw_response.create(
                model="test-model", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
            assert resp.headers["x-gateway-backend"] == "e1"
        assert metric(scrape(gw.url), "gateway_upstream_errors_total") == 0


def test_all_backends_down_answers_503_and_not_ready(start_gateway: StartGateway) -> None:
    policy = policy_yaml([f"http://127.0.0.1:{free_port()}"])
    with start_gateway(policy) as gw:
        with pytest.raises(openai.InternalServerError) as err:
            openai_client(gw.url).chat.completions.create(model="test-model", messages=MESSAGES)  # type: ignore[arg-type]
        assert err.value.status_code == 503
        assert "No healthy backend" in err.value.message
        ready = http("GET", gw.url + "/readyz")
        assert ready.status == 503
        assert b"no healthy backend in pool(s): default" in ready.body


def test_each_stage_of_a_request_is_timed(sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    c = openai_client(gw.url)
    for stream in (False, True):
        resp = c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type, call-overload]
                                         max_tokens=4, stream=stream)
        if stream:
            list(resp)
    samples = settled(gw.url, "gateway_requests_total", 2)
    for stage in ("read", "parse", "count", "route", "quota", "queue", "admission",
                  "upstream_headers"):
        assert metric(samples, "gateway_request_stage_seconds_count", stage=stage) == 2, stage
    # Timed finer than uvloop's loop clock, which moves in whole milliseconds: a parse of tens
    # of microseconds read 0 or 1 ms with it.
    parsed_s = metric(samples, "gateway_request_stage_seconds_sum", stage="parse")
    assert 0 < parsed_s and abs(parsed_s * 1e3 - round(parsed_s * 1e3)) > 1e-6, parsed_s
    # The estimate is not a forwarded request: its stages are not in the budget.
    assert http("POST", gw.url + "/gateway/estimate",
                {"model": "test-model", "messages": MESSAGES}).status == 200
    assert metric(scrape(gw.url), "gateway_request_stage_seconds_count", stage="count") == 2


# One request holds the pool's in-flight tokens (admitted alone: a lone request is never
# starved by the limit); the next one waits in the queue.
_ONE_AT_A_TIME = "    admission: {inflight_tokens_max: 50, queue_size: 8, queue_wait_max_s: 60}\n"
_UNDER_UVICORN = (
    "import sys, uvicorn\n"
    "from gateway.app import create_app\n"
    "from gateway.policy import load_policy\n"
    "uvicorn.run(create_app(load_policy(sys.argv[1])), host='127.0.0.1',"
    " port=int(sys.argv[2]), http='h11', log_level='warning')\n")


@pytest.mark.parametrize("server", ["gateway", "uvicorn-h11"])
def test_a_caller_gone_while_queued_frees_its_place_at_once(
        start_sim: StartSim, tmp_path: Path, server: str) -> None:
    """The caller hangs up while its request waits for admission: the wait ends at once and
    the request counts as a 499. The gateway's own server reports the lost connection itself
    (no task per request reading for it), also when the body came in one read past uvicorn's
    64 KiB buffer, which leaves reading paused (and a lost connection unseen) unless the
    notice resumes it; under another ASGI server (uvicorn's h11 protocol here) a task
    waits on `receive()` for the disconnect, as ASGI has it."""
    with start_sim() as sim:
        path = tmp_path / "policy.yaml"
        path.write_text(policy_yaml([sim.url], pool_extra=_ONE_AT_A_TIME))
        cmd = gateway_cmd("serve", "--policy", str(path), "--port", "{port}") \
            if server == "gateway" else [sys.executable, "-c", _UNDER_UVICORN, str(path), "{port}"]
        with run_server(cmd, "/healthz", tmp_path, server) as gw:
            holder = openai_client(gw.url).chat.completions.create(
                model="test-model", messages=MESSAGES, max_tokens=4000,  # type: ignore[arg-type]
                stream=True, extra_body={"ignore_eos": True})
            next(iter(holder))
            body = (b'{"model": "test-model", "max_tokens": 400, "messages": '
                    b'[{"role": "user", "content": "Hello there."}]' + b" " * 100_000 + b"}")
            with socket.create_connection(("127.0.0.1", gw.port)) as caller:
                caller.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                               b"content-type: application/json\r\n"
                               b"content-length: %d\r\n\r\n" % len(body))
                time.sleep(0.2)  # the body in one read while the request waits for it
                caller.sendall(body)
                poll_metric(gw.url, "gateway_queue_requests", lambda v: v == 1, pool="default")
            left = time.monotonic()
            poll_metric(gw.url, "gateway_queue_requests", lambda v: v == 0, pool="default")
            assert time.monotonic() - left < 2.0  # not the queue's 60 s wait
            poll_metric(gw.url, "gateway_requests_total", lambda v: v == 1, status="499")
            holder.close()
            poll_metric(gw.url, "gateway_inflight_requests", lambda v: v == 0, pool="default")
