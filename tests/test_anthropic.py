"""Anthropic's Messages API through the gateway, with the official `anthropic` SDK, in front of
the simulated engine (which serves /v1/messages as vLLM does: loadtest/sim/messages.py).

A Messages request is counted as the chat request vLLM converts it to, admitted and metered
from the engine's Anthropic usage; count_tokens is the gateway's own count; every error on the
two endpoints is in Anthropic's shape, the gateway's 503 with its Retry-After."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import pytest

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import Reply, Server, http, metric, poll_metric, quiet

MODEL = "test-model"
SYSTEM = "You are terse."
TOOLS: Any = [{"name": "get_weather", "description": "The weather in a city now",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}},
              {"name": "get_time", "input_schema": {"properties": {}}}]
# A conversation with a tool call and its result, as an agent sends it.
TOOL_TURNS: Any = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": [{"type": "text", "text": "18 C, clear"}]},
        {"type": "text", "text": "And so?"}]},
]
# The chat request vLLM makes of it (vllm/entrypoints/anthropic/serving.py), written by hand.
CHAT_EQUIVALENT: Any = {
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, clear"},
        {"role": "user", "content": "And so?"}],
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": TOOLS[0]["input_schema"]}},
        {"type": "function", "function": {
            "name": "get_time", "description": None,
            "parameters": {"properties": {}, "type": "object"}}}],
}


def client(url: str, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused",
                               **{"max_retries": 0, "timeout": 30, **kw})


def prompt_of(usage: Any) -> int:
    """Anthropic's usage leaves what the prefix cache served out of input_tokens."""
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0)
               + (usage.cache_creation_input_tokens or 0))


def anthropic_error(reply: Reply, status: int, type_: str) -> str:
    assert reply.status == status, reply
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == type_, body
    assert set(body) == {"type", "error"} and isinstance(body["error"]["message"], str)
    return str(body["error"]["message"])


def test_messages_streamed_and_not_counted_and_metered_as_the_engine_reports(
        sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    sdk = client(gw.url)
    messages: Any = [{"role": "user", "content": "Name three rivers of Europe. " * 20}]
    raw = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=12, system=SYSTEM,
                                                messages=messages)
    done = raw.parse()
    counted = int(raw.headers["x-gateway-prompt-tokens"])
    assert raw.headers["x-gateway-decision"] == "admitted"
    assert done.type == "message" and done.role == "assistant"
    assert done.content[0].type == "text" and done.content[0].text
    assert prompt_of(done.usage) == counted and 1 <= done.usage.output_tokens <= 12

    with sdk.messages.stream(model=MODEL, max_tokens=20, system=SYSTEM,
                             messages=messages) as stream:
        assert int(stream.response.headers["x-gateway-prompt-tokens"]) == counted
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.stop_reason in ("end_turn", "max_tokens")
    assert prompt_of(final.usage) == counted and 1 <= final.usage.output_tokens <= 20

    # Metered as the engine reported both (the second's prompt partly from its cache).
    usages = [done.usage, final.usage]
    s = poll_metric(gw.url, "gateway_tokens_total", lambda v: v >= sum(
        prompt_of(u) + u.output_tokens for u in usages))
    assert metric(s, "gateway_tokens_total", kind="output") == sum(
        u.output_tokens for u in usages)
    assert metric(s, "gateway_tokens_total", kind="cached") == sum(
        u.cache_read_input_tokens or 0 for u in usages)
    assert metric(s, "gateway_requests_total", pool="default", status="200") >= 2
    quiet(gw.url)


def test_count_tokens_is_the_count_of_the_chat_request_vllm_makes(
        sim_and_gateway: tuple[Server, Server]) -> None:
    """System blocks, tool use, tool results and tools: the gateway's count_tokens is its count
    of the hand-written chat equivalent, the engine's own count_tokens, and the input the
    engine reports for the same request."""
    sim, gw = sim_and_gateway
    sdk = client(gw.url)
    system: Any = [{"type": "text", "text": SYSTEM}]
    counted = sdk.messages.count_tokens(model=MODEL, system=system, messages=TOOL_TURNS,
                                        tools=TOOLS).input_tokens
    chat = http("POST", gw.url + "/v1/chat/completions",
                {"model": MODEL, "max_tokens": 1, **CHAT_EQUIVALENT})
    assert chat.status == 200, chat
    assert counted == int(chat.headers["x-gateway-prompt-tokens"])
    body = {"model": MODEL, "system": system, "messages": TOOL_TURNS, "tools": TOOLS}
    engine = http("POST", sim.url + "/v1/messages/count_tokens", body)
    assert engine.status == 200 and engine.json()["input_tokens"] == counted, engine
    raw = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=4, system=system,
                                                messages=TOOL_TURNS, tools=TOOLS)
    assert int(raw.headers["x-gateway-prompt-tokens"]) == counted
    assert prompt_of(raw.parse().usage) == counted
    quiet(gw.url)


# Eight long requests at once on an engine of 20 KV blocks of 128: a few run, the rest are
# refused at once (tests/test_retry_after.py has the arithmetic).
ENGINE = ("--num-gpu-blocks", "20", "--block-size", "128")
POOL = """    block_size: 128
    kv_blocks: 20
    admission: {kv_usage_max: 0.9}
"""
PROMPT = "Plan the capacity of a fleet of engines for a burst of long prompts. " * 30


def test_an_overloaded_pool_answers_in_anthropics_shape_with_retry_after(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    async def burst(url: str, n: int) -> list[Any]:
        sdk = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0,
                                       timeout=60)
        async with sdk:
            return list(await asyncio.gather(*(sdk.messages.create(
                model=MODEL, max_tokens=200, messages=[{"role": "user", "content": PROMPT}],
                extra_body={"ignore_eos": True}) for _ in range(n)), return_exceptions=True))

    with start_sim(*ENGINE) as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=POOL)) as gw:
        answers = asyncio.run(burst(gw.url, 8))
        refused = [a for a in answers if isinstance(a, anthropic.APIStatusError)]
        assert all(isinstance(a, anthropic.types.Message) for a in answers
                   if a not in refused), answers
        assert refused, "the burst must overload the pool"
        for err in refused:
            # The SDK's own rules retry it: a 5xx, x-should-retry true, a delay it honours.
            assert isinstance(err, anthropic.InternalServerError) and err.status_code == 503
            assert err.body == {"type": "error", "error": {
                "type": "overloaded_error", "message": err.body["error"]["message"]}}, err.body
            headers = err.response.headers
            assert 1 <= int(headers["retry-after"]) <= 60
            assert 1 <= int(headers["retry-after-ms"]) <= 60_000
            assert headers["x-should-retry"] == "true" and headers["x-gateway-reason"]
        quiet(gw.url, timeout=20)


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/messages", b"{not json", "not valid JSON"),
    ("/v1/messages", [1, 2], "JSON object"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5}, "'messages' is a required property"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
     "'max_tokens' is a required property"),
    ("/v1/messages", {"model": MODEL, "max_tokens": "ten",
                      "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 0,
                      "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": "hi"}, "messages"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "stream": "yes",
                      "messages": [{"role": "user", "content": "hi"}]}, "stream"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5,
                      "messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5,
                      "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
     "hologram"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "tools": [{"name": "x"}],
                      "messages": [{"role": "user", "content": "hi"}]}, "input_schema"),
    ("/v1/messages/count_tokens", b"", "not valid JSON"),
    ("/v1/messages/count_tokens", {"model": MODEL}, "'messages' is a required property"),
    ("/v1/messages/count_tokens", {"model": 7, "messages": []}, "model"),
])
def test_a_malformed_request_is_a_400_in_anthropics_shape(
        sim_and_gateway: tuple[Server, Server], path: str, body: Any, words: str) -> None:
    _, gw = sim_and_gateway
    message = anthropic_error(http("POST", gw.url + path, body), 400, "invalid_request_error")
    assert words in message, message


def test_errors_of_the_gateway_and_the_engine_in_anthropics_shape(
        sim_and_gateway: tuple[Server, Server]) -> None:
    sim, gw = sim_and_gateway
    sdk = client(gw.url)
    with pytest.raises(anthropic.NotFoundError) as nf:
        sdk.messages.create(model="nope", max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["type"] == "error"  # type: ignore[index]
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(model=MODEL, max_tokens=100_000,
                            messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]

    # An engine failing: the gateway's 502, in Anthropic's shape (the engine's message kept
    # out, as on the OpenAI endpoints).
    assert http("POST", sim.url + "/admin/faults", {"fail_rate": 1.0}).status == 200
    try:
        reply = http("POST", gw.url + "/v1/messages", {
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        anthropic_error(reply, 502, "api_error")
        assert reply.headers["x-gateway-backend"] == "e0"
    finally:
        http("POST", sim.url + "/admin/faults", {"fail_rate": 0.0})
    quiet(gw.url)


def test_the_simulated_engine_speaks_vllms_messages_api(
        sim_and_gateway: tuple[Server, Server]) -> None:
    """The engine's own answers, as vLLM 0.32 writes them: a message, its events, its errors."""
    sim, _ = sim_and_gateway
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    whole = http("POST", sim.url + "/v1/messages", body).json()
    assert (whole["type"], whole["role"], whole["stop_reason"]) == ("message", "assistant",
                                                                    "max_tokens")
    assert whole["usage"]["output_tokens"] == 3
    streamed = http("POST", sim.url + "/v1/messages", {**body, "stream": True})
    events = [line[7:] for line in streamed.body.decode().splitlines()
              if line.startswith("event: ")]
    assert events == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                      "content_block_stop", "message_delta", "message_stop"], events
    data = [json.loads(line[6:]) for line in streamed.body.decode().splitlines()
            if line.startswith("data: ")]
    assert data[-2]["usage"]["output_tokens"] == 3
    assert data[-2]["delta"]["stop_reason"] == "max_tokens"
    missing = http("POST", sim.url + "/v1/messages", {"model": MODEL, "messages": []})
    assert missing.status == 400 and missing.json()["type"] == "error", missing
