"""Fault injection on a real simulated engine: each fault behaves as docs/simulator.md says.

Faults are set through `POST /admin/faults` and cleared with `DELETE /admin/faults` after each
test; the "down" test closes the listening socket, so it runs on its own engine.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

try:  # the openai SDK's HTTP client: httpx2 from openai 3, httpx before
    from httpx2 import HTTPError
except ImportError:
    from httpx import HTTPError

from tests.servers import Server, loadtest_cmd, run_server

MODEL = "llama-3-70b"
ARGS = ("sim", "--model", MODEL, "--num-gpu-blocks", "512", "--max-model-len", "4096",
        "--time-scale", "0.5", "--port", "{port}")


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with run_server(loadtest_cmd(*ARGS), "/health", tmp_path_factory.mktemp("faults"),
                    "sim") as server:
        yield server


@pytest.fixture
def faults(sim: Server) -> Iterator[Server]:
    yield sim
    admin(sim, "DELETE")


def admin(server: Server, method: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + "/admin/faults", data=data, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sim", max_retries=0, timeout=10)


def stream(server: Server, tokens: int) -> Any:
    return client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=tokens,
        stream=True, extra_body={"ignore_eos": True})


def test_fail_rate_answers_500_in_vllms_error_shape(faults: Server) -> None:
    status, settings = admin(faults, "POST", {"fail_rate": 1.0})
    assert status == 200 and settings["fail_rate"] == 1.0
    with pytest.raises(openai.InternalServerError) as info:
        client(faults).completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert info.value.status_code == 500
    assert info.value.body == {"message": "Simulated engine failure (fault injection: fail_rate).",
                               "type": "InternalServerError", "param": None, "code": 500}
    admin(faults, "DELETE")
    ok = client(faults).completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1


def test_drop_closes_a_stream_after_n_tokens_without_done(faults: Server) -> None:
    admin(faults, "POST", {"drop_rate": 1.0, "drop_after_tokens": 3})
    received = 0
    with pytest.raises((HTTPError, openai.APIError)):
        for chunk in stream(faults, 20):
            if chunk.choices and chunk.choices[0].delta.content:
                received += 1
    assert received == 3
    # A non-streamed response is cut mid-body.
    with pytest.raises((HTTPError, openai.APIError)):
        client(faults).completions.create(model=MODEL, prompt="x", max_tokens=5)


def test_stall_pauses_a_stream_then_it_completes(faults: Server) -> None:
    admin(faults, "POST", {"stall_rate": 1.0, "stall_after_tokens": 2, "stall_s": 0.6})
    times = []
    for chunk in stream(faults, 8):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.monotonic())
    assert len(times) == 8
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[1] >= 0.55  # between token 2 and token 3
    assert max(gaps[2:]) < 0.3  # the tokens made meanwhile arrive in a burst


def test_bad_fault_settings_name_the_field(faults: Server) -> None:
    status, body = admin(faults, "POST", {"fail_rate": 2})
    assert status == 400 and body["error"]["message"].startswith("fail_rate:")
    status, body = admin(faults, "POST", {"explode": True})
    assert status == 400 and body["error"]["message"].startswith("explode: unknown field")
    assert admin(faults, "GET") == (200, {"fail_rate": 0.0, "drop_rate": 0.0,
                                          "drop_after_tokens": 1, "stall_rate": 0.0,
                                          "stall_after_tokens": 1, "stall_s": 0.0})


def test_down_refuses_connections_then_comes_back(faults: Server) -> None:
    live = stream(faults, 400)
    first = next(iter(live))
    assert first.choices[0].delta.role == "assistant"
    status, _ = admin(faults, "POST", {"down_for_s": 1.0})
    assert status == 200
    # The open stream is cut, as when an engine process dies.
    with pytest.raises((HTTPError, openai.APIError)):
        for _ in live:
            pass
    time.sleep(0.1)
    with pytest.raises(openai.APIConnectionError):
        client(faults).completions.create(model=MODEL, prompt="x", max_tokens=2)
    deadline = time.monotonic() + 5
    while True:
        try:
            ok = client(faults).completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                   extra_body={"ignore_eos": True})
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "engine did not come back"
            time.sleep(0.1)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
    with urllib.request.urlopen(faults.url + "/admin/state", timeout=5) as response:
        state = json.loads(response.read())
    assert state["kv_cache_usage"] == 0.0  # the crash dropped the running request's blocks
