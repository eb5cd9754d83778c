"""Every error a caller can cause: OpenAI's error shape, the right status, never a hang."""

from __future__ import annotations

import json
import socket
import time
from http.client import HTTPConnection

import openai
import pytest

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import Server, http, metric, openai_client, quiet, scrape, settled

MESSAGES = [{"role": "user", "content": "hi"}]


def assert_openai_error(data: dict[str, object], type_: str, code: str | None = None,
                        param: str | None = None) -> dict[str, object]:
    err = data["error"]
    assert isinstance(err, dict)
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    assert "Traceback" not in str(err["message"])
    return err


@pytest.fixture
def gw(sim_and_gateway: tuple[Server, Server]) -> Server:
    return sim_and_gateway[1]


def test_invalid_json_400(gw: Server) -> None:
    status, headers, data = http("POST", gw.url + "/v1/chat/completions",
                                 b'{"model": "test-model", ')
    assert status == 400
    assert headers["x-request-id"]
    err = assert_openai_error(json.loads(data), "invalid_request_error", "invalid_json")
    assert "not valid JSON" in str(err["message"])


def test_body_not_an_object_400(gw: Server) -> None:
    reply = http("POST", gw.url + "/v1/completions", b"[1, 2]")
    assert reply.status == 400
    assert_openai_error(reply.json(), "invalid_request_error", "invalid_json")


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"model": "test-model"}, "messages", "'messages' is a required property"),
    ({"messages": MESSAGES}, "model", "'model' is a required property"),
    ({"model": "test-model", "messages": []}, "messages", "at least 1 item"),
    ({"model": "test-model", "messages": [{"content": "x"}]}, "messages[0].role", "required"),
    ({"model": "test-model", "messages": MESSAGES, "max_tokens": -1}, "max_tokens",
     "greater than or equal to 0"),
    ({"model": "test-model", "messages": MESSAGES, "max_tokens": 2.5}, "max_tokens",
     "valid integer"),
    ({"model": "test-model", "messages": MESSAGES, "stream": "yes"}, "stream", "valid boolean"),
])
def test_schema_errors_name_the_field(gw: Server, body: dict[str, object], param: str,
                                      words: str) -> None:
    reply = http("POST", gw.url + "/v1/chat/completions", body)
    assert reply.status == 400
    err = assert_openai_error(reply.json(), "invalid_request_error", param=param)
    assert words in str(err["message"])


def test_schema_error_through_sdk(gw: Server) -> None:
    c = openai_client(gw.url)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="test-model", prompt={"not": "a prompt"})  # type: ignore[arg-type]
    assert err.value.status_code == 400
    assert "prompt" in err.value.message


def test_unknown_model_404(gw: Server) -> None:
    c = openai_client(gw.url)
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="gpt-5", messages=MESSAGES)  # type: ignore[arg-type]
    assert err.value.code == "model_not_found"
    assert "`gpt-5` does not exist" in err.value.message
    assert "test-model" in err.value.message


def test_unknown_path_and_method(gw: Server) -> None:
    reply = http("POST", gw.url + "/v1/audio/speech", b"{}")  # a path the gateway has not
    assert reply.status == 404
    assert_openai_error(reply.json(), "not_found_error", "not_found")
    reply = http("GET", gw.url + "/v1/chat/completions")
    assert reply.status == 405
    assert_openai_error(reply.json(), "invalid_request_error", "method_not_allowed")


def test_body_over_limit_413(start_sim: StartSim, start_gateway: StartGateway) -> None:
    with start_sim() as sim, start_gateway(policy_yaml(
            [sim.url], extra="server:\n  max_body_bytes: 2048\n")) as gw:
        big = json.dumps({"model": "test-model",
                          "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        reply = http("POST", gw.url + "/v1/chat/completions", big)
        assert reply.status == 413
        err = assert_openai_error(reply.json(), "invalid_request_error", "request_too_large")
        assert "2048 bytes" in str(err["message"])
        # Chunked upload without content-length: caught while reading (the one request here
        # the harness's `http` cannot send).
        conn = HTTPConnection("127.0.0.1", gw.port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=iter([big[:1500], big[1500:]]),
                     headers={"content-type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 413
        assert_openai_error(json.loads(resp.read()), "invalid_request_error",
                            "request_too_large")


def test_trickled_body_times_out_408(start_sim: StartSim, start_gateway: StartGateway) -> None:
    with start_sim() as sim, start_gateway(policy_yaml(
            [sim.url], extra="server:\n  body_timeout_s: 0.5\n")) as gw:
        # Bounded by the socket's timeout: a gateway that waited for the rest of the body for
        # ever fails the test in recv().
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                      b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"mo")
            reply = b""
            while b"request_timeout" not in reply:
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408")
        assert b'"code":"request_timeout"' in reply


def test_context_length_exceeded_before_any_backend(
        sim_and_gateway: tuple[Server, Server]) -> None:
    sim, gw = sim_and_gateway
    c = openai_client(gw.url)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                  max_tokens=10_000)
    assert err.value.code == "context_length_exceeded"
    assert "maximum context length is 8192 tokens" in err.value.message
    assert metric(scrape(sim.url), "vllm:num_requests_running") == 0
    assert metric(scrape(sim.url), "vllm:prompt_tokens_total") == 0  # never reached it


def test_upstream_4xx_keeps_status_and_message_in_openai_shape(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    # The policy says 8192 but the engine was started with 4096: the engine's own 400, in
    # vLLM's shape (type "BadRequestError", an integer code) from the engine, in OpenAI's
    # from the gateway: its status, message and param kept.
    with start_sim("--max-model-len", "4096") as sim, \
            start_gateway(policy_yaml([sim.url])) as gw:
        body = json.dumps({"model": "test-model", "messages": MESSAGES,
                           "max_tokens": 6000}).encode()
        direct = http("POST", sim.url + "/v1/chat/completions", body)
        via = http("POST", gw.url + "/v1/chat/completions", body)
        assert direct.status == via.status == 400
        engine = direct.json()["error"]
        assert (engine["type"], engine["code"]) == ("BadRequestError", 400)
        err = assert_openai_error(via.json(), "invalid_request_error")
        assert (err["message"], err["param"], err["code"]) == (engine["message"],
                                                              engine["param"], None)
        assert via.headers["x-gateway-backend"] == "e0"
        assert metric(quiet(gw.url), "gateway_kv_blocks_reserved") == 0


def test_rejections_leave_nothing_in_flight(gw: Server) -> None:
    for body in (b"{", b'{"model": "nope", "messages": [{"role": "user"}]}'):
        http("POST", gw.url + "/v1/chat/completions", body)
    settled(gw.url, "gateway_requests_total", 1, status="404")
    s = quiet(gw.url)
    assert metric(s, "gateway_inflight_requests") == 0
    assert metric(s, "gateway_requests_total", status="400") >= 1
    assert metric(s, "gateway_requests_total", status="404") >= 1


def test_upstream_5xx_becomes_502_naming_the_backend(start_sim: StartSim,
                                                     start_gateway: StartGateway) -> None:
    with start_sim("--fail-rate", "1.0") as sim, start_gateway(policy_yaml([sim.url])) as gw:
        c = openai_client(gw.url)
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model="test-model", messages=MESSAGES)  # type: ignore[arg-type]
        assert err.value.status_code == 502
        assert err.value.response.headers["x-gateway-backend"] == "e0"
        assert "The engine `e0` failed with HTTP 500" in err.value.message
        s = quiet(gw.url)
        assert metric(s, "gateway_upstream_errors_total", kind="status_5xx") == 1
        assert metric(s, "gateway_kv_blocks_reserved") == 0


def stream_until_error(gw: Server, max_tokens: int) -> tuple[int, str]:
    """A chat stream read through the SDK until it raises: the chunks that came first and the
    error's message (a test fails here if the stream ends cleanly)."""
    stream = openai_client(gw.url).chat.completions.create(
        model="test-model", messages=MESSAGES, max_tokens=max_tokens, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True})
    got = 0
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            got += 1
    return got, err.value.message


def test_stream_broken_mid_way_ends_with_sse_error(start_sim: StartSim,
                                                   start_gateway: StartGateway) -> None:
    with start_sim("--drop-rate", "1.0", "--drop-after-tokens", "3") as sim, \
            start_gateway(policy_yaml([sim.url])) as gw:
        got, message = stream_until_error(gw, max_tokens=50)
        assert got >= 1
        assert "broke off the stream" in message
        s = settled(gw.url, "gateway_requests_total", 1, status="502")
        assert metric(s, "gateway_upstream_errors_total", kind="disconnect") == 1
        assert metric(s, "gateway_requests_total", status="502") == 1
        assert metric(s, "gateway_inflight_requests") == 0
        assert metric(s, "gateway_kv_blocks_reserved") == 0


def test_engine_silent_mid_stream_past_read_timeout_ends_it(start_sim: StartSim,
                                                            start_gateway: StartGateway) -> None:
    # The stream's body is watched by one timer of its own, not aiohttp's per-read one
    # (gateway/upstream/silence.py): it must still end a stream whose engine went quiet.
    with start_sim("--stall-rate", "1.0", "--stall-after-tokens", "2", "--stall-s", "30") as sim, \
            start_gateway(policy_yaml([sim.url],
                                      extra="upstream:\n  read_timeout_s: 0.5\n")) as gw:
        started = time.monotonic()
        got, message = stream_until_error(gw, max_tokens=20)
        waited = time.monotonic() - started
        assert got >= 1
        assert "broke off the stream (timed out)" in message
        assert waited < 10, waited  # the engine's 30 s silence was not waited out
        s = settled(gw.url, "gateway_requests_total", 1, status="502")
        assert metric(s, "gateway_upstream_errors_total", kind="timeout") == 1
        assert metric(s, "gateway_inflight_requests") == 0
        assert metric(s, "gateway_kv_blocks_reserved") == 0


def test_engine_pause_shorter_than_read_timeout_is_waited_for(start_sim: StartSim,
                                                              start_gateway: StartGateway) -> None:
    with start_sim("--stall-rate", "1.0", "--stall-after-tokens", "2", "--stall-s", "0.6") as sim, \
            start_gateway(policy_yaml([sim.url],
                                      extra="upstream:\n  read_timeout_s: 1.5\n")) as gw:
        c = openai_client(gw.url)
        # Two streams back to back on the gateway's pooled connection: the first one's watch
        # must not outlive it, and aiohttp's timer must be back for the second one's headers.
        for _ in range(2):
            stream = c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                               max_tokens=6, stream=True,
                                               extra_body={"ignore_eos": True})
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices)
            assert text
        s = quiet(gw.url)
        assert metric(s, "gateway_requests_total", status="200") == 2
        assert metric(s, "gateway_upstream_errors_total", kind="timeout") == 0
