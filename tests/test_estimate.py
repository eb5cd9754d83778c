"""`POST /gateway/estimate`: the cost and decision a request would get, without forwarding."""

from __future__ import annotations

import http.client
import json

from openai import OpenAI

from tests.conftest import metric, scrape
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
