"""Hypothesis over the whole request surface, against a real gateway with tenants and quotas:
no 5xx, every refusal in OpenAI's error shape, nothing left reserved.

Bodies (messages with every kind of content part, tools, chat_template_kwargs, stream and
stream_options, token limits, n, unknown fields, completions prompts) and headers (keys,
priorities, queue deadlines, SDK timeouts, request ids) are drawn at random, valid or not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.tenancy.auth import hash_key
from tests.conftest import SIM_ARGS, policy_yaml
from tests.servers import Server, gateway_cmd, loadtest_cmd, metric, quiet, run_server, scrape

KEY_A, KEY_B = "sk-fuzz-a", "sk-fuzz-b"

POLICY_EXTRA = f"""
auth:
  require_keys: true
tenants:
  - name: team-a
    api_keys: ["{hash_key(KEY_A)}"]
    tokens_per_minute: 20000
    max_kv_share: 0.5
  - name: team-b
    api_keys: ["{hash_key(KEY_B)}"]
    priority: sheddable
server:
  max_body_bytes: 65536
  max_json_depth: 12
  max_prompt_chars: 20000
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    with run_server(loadtest_cmd("sim", *SIM_ARGS, "--port", "{port}"), "/health", tmp,
                    "sim") as sim:
        path = tmp / "policy.yaml"
        path.write_text(policy_yaml([sim.url], extra=POLICY_EXTRA))
        with run_server(gateway_cmd("serve", "--policy", str(path), "--port", "{port}"),
                        "/healthz", tmp, "gateway") as gw:
            yield gw


scalars = st.none() | st.booleans() | st.integers(-10, 10**6) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)

parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=50)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": st.sampled_from(["https://example.invalid/a.png",
                                 "data:image/png;base64,AA=="])})}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "file", "refusal", "x"])},
                          optional={"text": st.text(max_size=10)}),
    json_values)
contents = st.none() | st.text(max_size=200) | st.lists(parts, max_size=4) | json_values
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) |
     st.text(max_size=8)},
    optional={"content": contents, "name": st.text(max_size=8),
              "tool_calls": st.lists(json_values, max_size=2),
              "tool_call_id": st.text(max_size=8)})
plain = st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=200)})
# Mostly bodies the gateway takes, so the fuzz reaches counting, admission and the engine.
messages = st.lists(plain, min_size=1, max_size=3) | st.lists(plain, min_size=1, max_size=3) | \
    st.lists(message, max_size=4) | json_values
functions = st.fixed_dictionaries({"name": st.text(max_size=10)},
                                  optional={"parameters": json_values})
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": functions})
                 | json_values, max_size=3)
template_kwargs = st.dictionaries(
    st.sampled_from(["tools", "messages", "template", "special_tokens", "self", "documents",
                     "add_generation_prompt", "enable_thinking", "x"]), json_values,
    max_size=3) | json_values
token_limits = st.none() | st.integers(-5, 5000) | st.sampled_from([10**9, "10", 1.5, True])

chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["test-model"] * 4 + ["nope", ""]) | json_values,
     "messages": messages},
    optional={"max_tokens": token_limits, "max_completion_tokens": token_limits,
              "stream": st.booleans() | json_values,
              "stream_options": st.none() | st.fixed_dictionaries(
                  {}, optional={"include_usage": st.booleans() | json_values}) | json_values,
              "tools": st.none() | tools, "tool_choice": json_values,
              "chat_template_kwargs": template_kwargs,
              "n": st.none() | st.integers(-1, 3) | st.sampled_from([129, "2"]),
              "temperature": json_values, "extra_field": json_values})
completion_bodies = st.fixed_dictionaries(
    {"model": st.just("test-model") | json_values,
     "prompt": st.text(max_size=100) | st.lists(st.text(max_size=20), max_size=3) |
     st.lists(st.integers(-1, 200_000), max_size=20) | json_values},
    optional={"max_tokens": token_limits, "stream": st.booleans(), "n": st.integers(1, 2)})

header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20)
keys = st.sampled_from([f"Bearer {KEY_A}", f"Bearer {KEY_B}"])
headers = st.fixed_dictionaries({"authorization": keys | keys | keys | st.sampled_from(
    ["Bearer sk-no", "Basic abc", "Bearer", ""]) | header_text}, optional={
    "x-priority": st.sampled_from(["critical", "standard", "sheddable"]) | header_text,
    "x-gateway-max-queue-ms": st.sampled_from(["nan", "inf", "-1", "0", "100"]) | header_text,
    "x-stainless-timeout": st.sampled_from(["nan", "0", "600"]) | header_text,
    "x-request-id": header_text})


def send(gw: Server, path: str, body: object, hdrs: dict[str, str]) -> tuple[int, bytes]:
    conn = HTTPConnection("127.0.0.1", gw.port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **hdrs})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def check(status: int, raw: bytes) -> None:
    event(f"HTTP {status}")
    assert status < 500, (status, raw[:500])
    if status >= 400:
        err: Any = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str)
        assert "param" in err and "code" in err


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=chat_bodies, hdrs=headers,
       path=st.sampled_from(["/v1/chat/completions", "/gateway/estimate"]))
def test_chat_surface(gateway: Server, body: dict[str, Any], hdrs: dict[str, str],
                      path: str) -> None:
    check(*send(gateway, path, body, hdrs))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=completion_bodies, hdrs=headers)
def test_completions_surface(gateway: Server, body: dict[str, Any], hdrs: dict[str, str]) -> None:
    check(*send(gateway, "/v1/completions", body, hdrs))


def test_after_the_fuzz_nothing_is_reserved_and_no_5xx(gateway: Server) -> None:
    samples = quiet(gateway.url)
    assert metric(samples, "gateway_kv_blocks_reserved") == 0
    assert metric(samples, "gateway_inflight_requests") == 0
    answered = {labels: v for (name, labels), v in scrape(gateway.url).items()
                if name == "gateway_requests_total"}
    assert answered, "the fuzz sent nothing"
    fives = {labels: v for labels, v in answered.items() if dict(labels)["status"][0] == "5"}
    assert not fives, fives
