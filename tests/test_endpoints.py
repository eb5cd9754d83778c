"""The endpoints beyond chat and completions, driven with the official SDK through the gateway
to the simulated engine: Responses (create, stream, retrieve, cancel, continue), embeddings,
tokenize and detokenize, one model, and image parts.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import Server, http, metric, openai_client, poll_metric, quiet


@pytest.fixture
def two_engines(start_sim: StartSim, start_gateway: StartGateway) -> Iterator[Server]:
    with start_sim() as a, start_sim() as b, start_gateway(policy_yaml([a.url, b.url])) as gw:
        yield gw


def estimate(gw: Server, body: dict[str, object]) -> dict[str, object]:
    reply = http("POST", gw.url + "/gateway/estimate", body)
    assert reply.status == 200, reply.body
    out: dict[str, object] = reply.json()
    return out


# --- Responses --------------------------------------------------------------------------------

def test_responses_create_is_admitted_counted_and_metered(two_engines: Server) -> None:
    gw = two_engines
    client = openai_client(gw.url)
    raw = client.responses.with_raw_response.create(
        model="test-model", instructions="Answer briefly.", input="What is KV cache?",
        max_output_tokens=16)
    assert raw.headers["x-gateway-pool"] == "default"
    assert raw.headers["x-gateway-decision"] == "admitted"
    resp = raw.parse()
    # At max_output_tokens vLLM says "incomplete" (incomplete_details: max_output_tokens).
    assert resp.status in ("completed", "incomplete") and resp.output_text
    assert resp.usage is not None and 0 < resp.usage.output_tokens <= 16
    # The gateway counts the prompt as the engine renders it (instructions as a system turn).
    est = estimate(gw, {"model": "test-model", "instructions": "Answer briefly.",
                        "input": "What is KV cache?", "max_output_tokens": 16})
    assert est["endpoint"] == "responses"
    assert est["prompt_tokens"] == resp.usage.input_tokens
    samples = quiet(gw.url)
    assert metric(samples, "gateway_tokens_total", kind="output") == resp.usage.output_tokens
    assert metric(samples, "gateway_requests_total", status="200") >= 1


def test_responses_stream_passes_events_through_and_times_the_first_token(
        two_engines: Server) -> None:
    gw = two_engines
    client = openai_client(gw.url)
    kinds: list[str] = []
    completed = None
    with client.responses.stream(model="test-model", input="Tell me a story.",
                                 max_output_tokens=12) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.completed":
                completed = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert completed is not None and completed.usage is not None
    samples = poll_metric(gw.url, "gateway_tokens_total", lambda v: v > 0, kind="output")
    assert metric(samples, "gateway_tokens_total", kind="output") == \
        completed.usage.output_tokens
    # TTFT is the first delta's, not the response.created event's.
    assert metric(samples, "gateway_ttft_seconds_count") >= 1


def test_stored_responses_are_found_on_the_backend_that_made_them(two_engines: Server) -> None:
    gw = two_engines
    client = openai_client(gw.url)
    made = client.responses.with_raw_response.create(model="test-model", input="Hello",
                                                     max_output_tokens=4, store=True)
    first = made.parse()
    backend = made.headers["x-gateway-backend"]
    for _ in range(4):  # whichever backend has more room, retrieve reaches the one holding it
        got = client.responses.with_raw_response.retrieve(first.id)
        assert got.headers["x-gateway-backend"] == backend
        assert got.parse().id == first.id
    # A turn that continues it goes to the same backend, its prompt counted with the history.
    follow = client.responses.with_raw_response.create(
        model="test-model", input="And then?", previous_response_id=first.id,
        max_output_tokens=4)
    assert follow.headers["x-gateway-backend"] == backend
    assert int(follow.headers["x-gateway-prompt-tokens"]) > first.usage.input_tokens  # type: ignore[union-attr]
    # vLLM cancels only background responses; a finished one is a 400 from the very engine
    # that holds it, in OpenAI's error shape.
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(first.id)
    assert refused.value.response.headers["x-gateway-backend"] == backend
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


# --- embeddings, tokenize, models ------------------------------------------------------------

def test_embeddings_are_prefill_only_and_metered(two_engines: Server) -> None:
    gw = two_engines
    client = openai_client(gw.url)
    raw = client.embeddings.with_raw_response.create(model="test-model",
                                                     input=["first text", "second one"])
    assert raw.headers["x-gateway-decision"] == "admitted"
    result = raw.parse()
    assert len(result.data) == 2 and len(result.data[0].embedding) > 0
    est = estimate(gw, {"model": "test-model", "input": ["first text", "second one"]})
    cost = est["cost"]
    assert isinstance(cost, dict) and cost["max_output_tokens"] == 0
    samples = quiet(gw.url)
    assert metric(samples, "gateway_tokens_total", kind="input") == result.usage.prompt_tokens
    assert metric(samples, "gateway_tokens_total", kind="output") == 0


def test_tokenize_and_detokenize_reach_an_engine(two_engines: Server) -> None:
    gw = two_engines
    reply = http("POST", gw.url + "/tokenize", {"model": "test-model", "prompt": "Hello world"})
    assert reply.status == 200, reply.body
    tokens = reply.json()["tokens"]
    assert reply.json()["count"] == len(tokens) > 0
    back = http("POST", gw.url + "/detokenize", {"model": "test-model", "tokens": tokens})
    assert back.status == 200 and back.json()["prompt"] == "Hello world"
    missing = http("POST", gw.url + "/tokenize", {"model": "nope", "prompt": "x"})
    assert missing.status == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_one_model_is_retrieved(two_engines: Server) -> None:
    client = openai_client(two_engines.url)
    assert client.models.retrieve("test-model").id == "test-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


# --- image parts ---------------------------------------------------------------------------

def png(width: int, height: int) -> str:
    """A real (tiny, grey) PNG of that size, as a data URL."""
    row = b"\x00" + b"\x80" * width
    raw = zlib.compress(row * height)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    body = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0,
                                                            0, 0, 0)) + \
        chunk(b"IDAT", raw) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(body).decode()


def image_message(url: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in it?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_image_parts_on_a_vision_model_are_counted_by_its_rule(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    vision = policy_yaml(["http://127.0.0.1:1"]).replace(
        "    architecture: llama-3-8b\n",
        "    architecture: llama-3-8b\n    vision: {tokens_per_image: 500, patch_px: 28}\n", 1)
    with start_sim() as sim, start_gateway(vision.replace("http://127.0.0.1:1", sim.url)) as gw:
        text_only = estimate(gw, {"model": "test-model", "messages": image_message("")})
        sized = estimate(gw, {"model": "test-model", "messages": image_message(png(280, 140))})
        unknown = estimate(gw, {"model": "test-model",
                                "messages": image_message("https://example.invalid/x.png")})
        base = text_only["prompt_tokens"]
        assert isinstance(base, int)
        assert sized["prompt_tokens"] == base - 500 + 10 * 5  # 280x140 px in 28 px squares
        assert unknown["prompt_tokens"] == base  # no size to read: the rule's default
        assert sized["exact"] is False
        resp = openai_client(gw.url).chat.completions.create(
            model="test-model", max_tokens=4, messages=image_message(png(56, 56)))  # type: ignore[arg-type]
        assert resp.usage is not None and resp.usage.prompt_tokens > 0
    with start_sim() as sim, start_gateway(policy_yaml([sim.url])) as gw:
        reply = http("POST", gw.url + "/v1/chat/completions",
                     {"model": "test-model", "messages": image_message(png(56, 56))})
        assert reply.status == 400 and "text-only model" in reply.json()["error"]["message"]
