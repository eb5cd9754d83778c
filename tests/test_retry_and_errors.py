"""Retry headers the official SDK acts on, and one error shape whoever refused.

The SDK (openai-python, max_retries > 0) reads retry-after-ms before Retry-After, obeys
x-should-retry over its own rules, sleeps what the server says up to its cap and otherwise
backs off on its own. Each case here runs the SDK through the gateway and counts the retries
it took by the gateway's own counter (gateway_requests_total by status) and what it slept by
the SDK's own log line ("Retrying request in N seconds"), not by the wall clock.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import re
import socket
import struct
import time
from collections.abc import Iterator

import openai
import pytest
from aiohttp import web

from gateway.api.errors import headers_of, http_error
from gateway.errors import (
    BodyTooLarge,
    Forbidden,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    NoBackendAvailable,
    Overloaded,
    QuotaExceeded,
    RateWindow,
    RequestTimeout,
    StateUnavailable,
    Unauthorized,
    UnsupportedMediaType,
    UpstreamError,
)
from gateway.tenancy.auth import hash_key
from gateway.wire.openai import SDK_RETRY_AFTER_CAP_S
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import (
    Server,
    http,
    metric,
    openai_client,
    poll_metric,
    quiet,
    scrape,
    settled,
)
from tests.stand_ins import StandIn, running

OPENAI_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
                "not_found_error", "rate_limit_error", "server_error"}
SMALL_ENGINE = ("--num-gpu-blocks", "64", "--block-size", "16")
# About 500 prompt tokens: 32 of the small engine's 64 blocks. Two such requests do not fit
# under its admission limit (90% of 64 blocks); one does.
HALF_POOL = [{"role": "user", "content": "capacity " * 480}]
# What holds the pool: as large, but no prefix in common with HALF_POOL, whose blocks it would
# otherwise share (held blocks are not reserved twice: prefix routing, issue 19).
HOLDER = [{"role": "user", "content": "held " + "capacity " * 480}]
SHORT = [{"role": "user", "content": "hi"}]
_RETRYING = re.compile(r"Retrying request in ([0-9.]+) seconds")


def sleeps(caplog: pytest.LogCaptureFixture) -> list[float]:
    """What the SDK slept before each retry, as it logs it (openai._base_client, INFO)."""
    return [float(m.group(1)) for r in caplog.records
            if r.name == "openai._base_client" and (m := _RETRYING.search(r.getMessage()))]


def retry_view(headers: object) -> tuple[int, int, str]:
    """(retry-after, retry-after-ms, x-should-retry) as sent."""
    h = {k.lower(): v for k, v in dict(headers).items()}  # type: ignore[call-overload]
    return int(h["retry-after"]), int(h["retry-after-ms"]), h["x-should-retry"]


def assert_openai_shape(error: object, type_: str | None = None) -> dict[str, object]:
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] in OPENAI_TYPES, error
    if type_ is not None:
        assert error["type"] == type_, error
    assert error["code"] is None or isinstance(error["code"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert isinstance(error["message"], str) and error["message"]
    return error


# --- the headers and types, as the boundary renders them -----------------------------------

def _headers(err: Exception) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in headers_of(err)}  # type: ignore[arg-type]


@pytest.mark.parametrize(("retry_s", "after", "ms", "should"), [
    (0.25, "1", "250", "true"),      # Retry-After is whole seconds; the SDK reads the ms
    (1.0, "1", "1000", "true"),
    (59.5, "60", "59500", "true"),
    (SDK_RETRY_AFTER_CAP_S, "60", "60000", "true"),
    # Past what openai-node sleeps (its backoff would retry): not to retry, and the ceiling.
    (60.2, "60", "60000", "false"),
    (93.4, "60", "60000", "false"),
    (7200.0, "60", "60000", "false"),
])
def test_retry_headers_follow_the_wait(retry_s: float, after: str, ms: str,
                                       should: str) -> None:
    errors: list[Exception] = [Overloaded("full", retry_after_s=retry_s, reason="kv_blocks")]
    if retry_s >= 1:  # a quota's wait is at least a second (QuotaExceeded)
        errors.append(QuotaExceeded("spent", RateWindow(600, 0, 60.0, retry_s)))
    for err in errors:
        h = _headers(err)
        assert (h["retry-after"], h["retry-after-ms"], h["x-should-retry"]) == (after, ms, should)


def test_no_retry_headers_where_no_wait_is_known() -> None:
    for err in (InvalidRequest("bad"), UpstreamError("broke", backend="e0"), InternalError("x")):
        assert not {"retry-after", "retry-after-ms", "x-should-retry"} & set(_headers(err))


@pytest.mark.parametrize(("err", "status", "type_", "code"), [
    (InvalidRequest("x", code="invalid_json"), 400, "invalid_request_error", "invalid_json"),
    (Unauthorized("x"), 401, "authentication_error", "invalid_api_key"),
    (Forbidden("x"), 403, "permission_error", "model_not_allowed"),
    (ModelNotFound("x"), 404, "not_found_error", "model_not_found"),
    (RequestTimeout("x"), 408, "invalid_request_error", "request_timeout"),
    (BodyTooLarge("x"), 413, "invalid_request_error", "request_too_large"),
    (UnsupportedMediaType("x"), 415, "invalid_request_error", "unsupported_content_encoding"),
    (QuotaExceeded("x", RateWindow(1, 0, 1.0, 1.0)), 429, "rate_limit_error",
     "rate_limit_exceeded"),
    (Overloaded("x", retry_after_s=1), 503, "server_error", "overloaded"),
    (NoBackendAvailable("x", retry_after_s=1), 503, "server_error", "no_healthy_backend"),
    (StateUnavailable("x", retry_after_s=1), 503, "server_error", "state_unavailable"),
    (UpstreamError("x"), 502, "server_error", "upstream_error"),
    (InternalError("x"), 500, "server_error", None),
])
def test_every_class_renders_openai_vocabulary(err: Exception, status: int, type_: str,
                                               code: str | None) -> None:
    answer = http_error(err)  # type: ignore[arg-type]
    assert answer.status == status
    body = json.loads(answer.body)["error"]
    assert_openai_shape(body, type_)
    assert body["code"] == code


# --- A: the SDK's retries through the gateway ------------------------------------------------

def test_503_that_clears_soon_is_retried_once_after_the_ms_it_says(
        start_sim: StartSim, start_gateway: StartGateway,
        caplog: pytest.LogCaptureFixture) -> None:
    """A pool full for a moment (no queue): 503 with retry-after-ms 1000 and x-should-retry
    true. The SDK sleeps exactly that, and its one retry is admitted once the holder left."""
    no_queue = ("    admission: {kv_usage_max: 0.9, queue_size: 0, queue_wait_max_s: 1, "
                "overbook_max: 1.0}\n")
    caplog.set_level(logging.INFO, logger="openai._base_client")
    with start_sim(*SMALL_ENGINE, "--time-scale", "20") as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=no_queue)) as gw:
        poll_metric(gw.url, "gateway_kv_blocks_capacity", lambda v: v == 64, backend="e0")
        holder = openai_client(gw.url).chat.completions.create(
            model="test-model", messages=HOLDER, max_tokens=100, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True})
        try:
            refused = http("POST", gw.url + "/v1/chat/completions",
                           {"model": "test-model", "messages": HALF_POOL, "max_tokens": 2})
            assert refused.status == 503, refused
            assert retry_view(refused.headers) == (1, 1000, "true")
            assert_openai_shape(refused.json()["error"], "server_error")
            sdk = openai_client(gw.url, max_retries=2)
            with cf.ThreadPoolExecutor(1) as pool:
                call = pool.submit(sdk.chat.completions.with_raw_response.create,
                                   model="test-model", messages=HALF_POOL, max_tokens=2)
                # Its first try is refused: then the holder leaves, within the second the
                # SDK sleeps.
                settled(gw.url, "gateway_requests_total", 2, status="503")
                holder.close()
                raw = call.result(timeout=30)
        finally:
            holder.close()
        assert raw.http_response.status_code == 200
        assert raw.retries_taken == 1
        assert sleeps(caplog) == [1.0]  # retry-after-ms, not a jittered backoff
        s = quiet(gw.url, timeout=10)
        assert metric(s, "gateway_requests_total", status="503") == 2  # ours, the SDK's one
        assert metric(s, "gateway_requests_total", status="200") == 1  # its retry


def test_429_refilling_past_the_cap_is_not_retried(
        start_sim: StartSim, start_gateway: StartGateway,
        caplog: pytest.LogCaptureFixture) -> None:
    """A tenant 600 tokens a minute, in debt after a request larger than its bucket: its next
    request waits ~90 s for the refill. The SDK would sleep up to 120 s on retry-after-ms
    alone; x-should-retry: false makes it give the caller the 429 at once."""
    key = "sk-quota"
    extra = f"""
auth:
  require_keys: true
tenants:
  - name: metered
    api_keys: ["{hash_key(key)}"]
    tokens_per_minute: 600
"""
    caplog.set_level(logging.INFO, logger="openai._base_client")
    with start_sim("--time-scale", "0.05") as sim, \
            start_gateway(policy_yaml([sim.url], extra=extra)) as gw:
        # A full bucket gives once, whatever is asked: 1,200 tokens generated leave the tenant
        # ~600 tokens in debt.
        done = openai_client(gw.url, api_key=key).chat.completions.create(
            model="test-model", messages=SHORT, max_tokens=1200,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True})
        assert done.usage is not None and done.usage.completion_tokens == 1200
        sdk = openai_client(gw.url, api_key=key, max_retries=2)
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.chat.completions.create(model="test-model", messages=SHORT,  # type: ignore[arg-type]
                                        max_tokens=300)
        # ~90 s to wait, which the SDK would sleep on retry-after-ms alone: x-should-retry says
        # no, and the delays say the ceiling (RETRY_AFTER_MAX_S), not the refill.
        assert retry_view(refused.value.response.headers) == (60, 60_000, "false")
        assert re.search(r"Please try again in (9\d|1[01]\d)\.\ds\.", refused.value.message), \
            refused.value.message
        assert_openai_shape(refused.value.body, "rate_limit_error")
        assert refused.value.code == "rate_limit_exceeded"
        assert sleeps(caplog) == []
        s = scrape(gw.url)
        assert metric(s, "gateway_requests_total", status="429") == 1  # no retry reached us
        assert metric(s, "gateway_quota_rejections_total", tenant="metered") == 1


def test_503_with_a_long_predicted_wait_is_not_retried(
        start_sim: StartSim, start_gateway: StartGateway,
        caplog: pytest.LogCaptureFixture) -> None:
    """A full pool whose plan says the wait is minutes: a model without an architecture (no
    roofline) and a TPOT line of 0.64 s, at which a request holds its tokens 256 x 0.64 s, so
    the pool's KV budget drains in ~164 s and a probe of over half of it waits ~90 s. Its 503
    says x-should-retry: false (the delays say the ceiling, 60 s) and the SDK does not
    retry."""
    admission = ("    admission: {kv_usage_max: 0.9, queue_size: 8, queue_wait_max_s: 4, "
                 "overbook_max: 1.0, tpot_p99_max_s: 0.64}\n")
    probe = {"model": "test-model", "messages": HALF_POOL, "max_tokens": 2}
    caplog.set_level(logging.INFO, logger="openai._base_client")
    with start_sim(*SMALL_ENGINE, "--time-scale", "20") as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=admission).replace(
                "    architecture: llama-3-8b\n", "")) as gw:
        poll_metric(gw.url, "gateway_kv_blocks_capacity", lambda v: v == 64, backend="e0")
        holder = openai_client(gw.url).chat.completions.create(
            model="test-model", messages=HOLDER, max_tokens=400, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True})
        try:
            # The plan follows the engine's capacity at the ticker's next second.
            deadline = time.monotonic() + 20
            while True:
                est = http("POST", gw.url + "/gateway/estimate", probe).json()["decision"]
                if est["decision"] == "reject" \
                        and est["predicted_wait_s"] > SDK_RETRY_AFTER_CAP_S + 1:
                    break
                assert time.monotonic() < deadline, est
                time.sleep(0.05)
            sdk = openai_client(gw.url, max_retries=2)
            with pytest.raises(openai.InternalServerError) as refused:
                sdk.chat.completions.create(**probe)  # type: ignore[call-overload]
        finally:
            holder.close()
        response = refused.value.response
        assert response.status_code == 503
        assert response.headers["x-gateway-reason"] == "predicted_wait"
        assert retry_view(response.headers) == (60, 60_000, "false")
        predicted = re.search(r"predicted wait \(([0-9.]+)s\)", refused.value.message)
        assert predicted and SDK_RETRY_AFTER_CAP_S < float(predicted.group(1)) < 600, \
            refused.value.message
        assert "Retry after 60s." in refused.value.message
        assert_openai_shape(refused.value.body, "server_error")
        assert sleeps(caplog) == []
        s = quiet(gw.url, timeout=10)
        assert metric(s, "gateway_requests_total", status="503") == 1  # no retry reached us


# --- B: the engine's errors in OpenAI's shape ------------------------------------------------

class VllmLike(StandIn):
    """An engine stand-in (we do not own vLLM) that answers as vLLM does when it refuses:
    `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`, mid-stream as
    an SSE event too. What it does is chosen by the prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = 0

    @staticmethod
    def vllm_error(message: str, type_: str, code: int, param: str | None = None) -> bytes:
        return json.dumps({"error": {"message": message, "type": type_, "param": param,
                                     "code": code}}).encode()

    async def chat(self, req: web.Request) -> web.StreamResponse:
        self.hits += 1
        body = await req.json()
        what = body["messages"][-1]["content"]
        if what == "rate":
            return web.Response(status=429, headers={"retry-after": "0.2"},
                                content_type="application/json",
                                body=self.vllm_error("Too many requests.", "RateLimitError", 429))
        if what == "old":  # older vLLM: the fields at the top level
            return web.json_response({"object": "error", "message": "Old shape.",
                                      "type": "BadRequestError", "param": "n", "code": 400},
                                     status=400)
        if what == "detail":  # a FastAPI route's own answer
            return web.json_response({"detail": "Not Found"}, status=404)
        if what == "text":
            return web.Response(status=400, text="plain words")
        if what == "reset":  # the engine dies on the request, before any answer: an RST
            assert req.transport is not None
            sock = req.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            req.transport.abort()
            return web.Response()
        if what == "busy":
            return web.Response(status=503, content_type="application/json",
                                body=self.vllm_error("Engine busy.", "ServiceUnavailableError",
                                                     503))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b'data: {"id":"c","object":"chat.completion.chunk","choices":[{'
                         b'"index":0,"delta":{"content":"{\\"error\\": 1}"}}]}\n\n')
        if what == "cut":
            assert req.transport is not None
            req.transport.close()
            return resp
        await resp.write(b"data: " + self.vllm_error("Prompt rejected mid-way.",
                                                     "BadRequestError", 400, "messages")
                         + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def engine() -> Iterator[VllmLike]:
    with running(VllmLike()) as stand_in:
        yield stand_in



@pytest.fixture
def via(engine: VllmLike, start_gateway: StartGateway) -> Iterator[Server]:
    with start_gateway(policy_yaml([engine.url])) as gw:
        yield gw


def chat(gw: Server, content: str, stream: bool = False) -> tuple[int, dict[str, str], bytes]:
    reply = http("POST", gw.url + "/v1/chat/completions",
                 {"model": "test-model", "messages": [{"role": "user", "content": content}],
                  "stream": stream})
    return reply.status, reply.headers, reply.body


@pytest.mark.parametrize(("content", "status", "type_", "message", "param"), [
    ("old", 400, "invalid_request_error", "Old shape.", "n"),
    ("detail", 404, "not_found_error", "Not Found", None),
    ("text", 400, "invalid_request_error", "plain words", None),
    ("busy", 503, "server_error", "Engine busy.", None),
])
def test_engine_refusals_keep_status_and_message_in_openai_shape(
        via: Server, content: str, status: int, type_: str, message: str,
        param: str | None) -> None:
    got, headers, body = chat(via, content)
    assert got == status
    assert headers["content-type"] == "application/json"
    assert headers["x-gateway-backend"] == "e0"
    error = assert_openai_shape(json.loads(body)["error"], type_)
    assert (error["message"], error["param"], error["code"]) == (message, param, None)


def test_engine_429_gets_ms_and_should_retry_and_the_sdk_sleeps_them(
        engine: VllmLike, via: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai._base_client")
    with pytest.raises(openai.RateLimitError) as refused:
        openai_client(via.url, max_retries=1).chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "rate"}])
    assert retry_view(refused.value.response.headers) == (1, 200, "true")
    assert_openai_shape(refused.value.body, "rate_limit_error")
    assert refused.value.message.endswith("Too many requests.")
    assert sleeps(caplog) == [0.2]  # the engine's fractional Retry-After, as ms
    assert engine.hits == 2
    assert metric(settled(via.url, "gateway_requests_total", 2, status="429"),
                  "gateway_requests_total", status="429") == 2


def test_engine_error_event_mid_stream_in_openai_shape(via: Server) -> None:
    got, _, body = chat(via, "error", stream=True)
    assert got == 200
    events = [e for e in body.split(b"\n\n") if e]
    assert events[0].startswith(b'data: {"id":"c"')  # tokens pass untouched, "error" in them
    error = assert_openai_shape(json.loads(events[1][len(b"data: "):])["error"],
                                "invalid_request_error")
    assert (error["message"], error["param"], error["code"]) == ("Prompt rejected mid-way.",
                                                                 "messages", None)
    assert events[2] == b"data: [DONE]"
    # The SDK raises it, with the engine's words.
    stream = openai_client(via.url).chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "error"}], stream=True)
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            pass
    assert raised.value.message == "Prompt rejected mid-way."


def test_stream_cut_by_the_engine_ends_with_our_error_event(via: Server) -> None:
    got, _, body = chat(via, "cut", stream=True)
    assert got == 200
    frame = next(e for e in body.split(b"\n\n") if e.startswith(b'data: {"error"'))
    error = assert_openai_shape(json.loads(frame[len(b"data: "):])["error"], "server_error")
    assert error["code"] == "upstream_error"


def test_connection_reset_before_the_answer_is_a_502_not_a_500(
        engine: VllmLike, via: Server) -> None:
    """An engine killed on a request (seen with llama.cpp under SIGKILL): the connection reset
    before any answer. It may have started on it, so no other backend gets it: a 502 naming
    the engine, in OpenAI's shape."""
    got, headers, body = chat(via, "reset")
    assert got == 502, body
    assert headers["x-gateway-backend"] == "e0"
    error = assert_openai_shape(json.loads(body)["error"], "server_error")
    assert "e0" in error["message"] and "reset" in error["message"], error
    assert engine.hits == 1
    quiet(via.url)


def test_our_own_refusals_all_in_openai_shape(engine: VllmLike,
                                              start_gateway: StartGateway) -> None:
    """The gateway's own answers: every status in OpenAI's vocabulary, with a string code."""
    key = "sk-tenant"
    extra = f"""
auth:
  require_keys: true
tenants:
  - name: t
    api_keys: ["{hash_key(key)}"]
    models: [other]
server:
  max_body_bytes: 4096
"""
    text = policy_yaml([engine.url], extra=extra).replace(
        "models:\n  - name: test-model",
        "models:\n  - {name: other, architecture: llama-3-8b}\n  - name: test-model")
    auth = {"authorization": f"Bearer {key}"}
    good = {"model": "test-model", "messages": SHORT}
    with start_gateway(text) as gw:
        cases: list[tuple[str, str, object, dict[str, str], int, str]] = [
            ("POST", "/v1/chat/completions", b"{", auth, 400, "invalid_request_error"),
            ("POST", "/v1/chat/completions", good, {}, 401, "authentication_error"),
            ("POST", "/v1/chat/completions", good, auth, 403, "permission_error"),
            ("POST", "/v1/chat/completions", {**good, "model": "nope"}, auth, 404,
             "not_found_error"),
            ("POST", "/v1/nowhere", b"{}", auth, 404, "not_found_error"),
            ("GET", "/v1/chat/completions", None, auth, 405, "invalid_request_error"),
            ("POST", "/v1/chat/completions", {**good, "x": "y" * 5000}, auth, 413,
             "invalid_request_error"),
            ("GET", "/admin/state", None, auth, 403, "permission_error"),
        ]
        for method, path, body, headers, status, type_ in cases:
            reply = http(method, gw.url + path, body, headers=headers)
            assert reply.status == status, (path, reply)
            assert_openai_shape(reply.json()["error"], type_)
