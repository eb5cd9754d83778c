"""What a misbehaving engine does to the gateway's callers, through both engine clients (the
gateway's own for plain http://, aiohttp's): events split across reads at every byte, JSON with
spaces, gzip nobody asked for, a protocol switch, silence after the request (issue 43).

The engine is tests/misbehaving.py, on raw sockets; the callers read the gateway's answer as
bytes and through the official SDK. Every stream a caller gets is whole events of valid JSON
ending with `[DONE]`, the usage-only chunk only for a caller who asked for it, and the usage
charged is the engine's, to the token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartGateway, policy_yaml
from tests.misbehaving import ERROR, TEXT, USAGE, Misbehaving, running, stream_bytes
from tests.servers import Reply, Server, async_openai_client, http, metric, quiet, scrape

# The stream cut at every position p with p % K == r, for each r: every byte position of the
# stream is a cut in one request of K.
K = 23
CLIENTS = ["native", "aiohttp"]


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Misbehaving, Misbehaving]]:
    with running() as e0, running() as e1:
        yield e0, e1


@pytest.fixture(params=CLIENTS)
def gateway(request: pytest.FixtureRequest, engines: tuple[Misbehaving, Misbehaving],
            start_gateway: StartGateway) -> Iterator[Server]:
    upstream = f"upstream:\n  client: {request.param}\n  read_timeout_s: 1.5\n"
    with start_gateway(policy_yaml([e.url for e in engines], extra=upstream)) as gw:
        yield gw


def body(words: str, stream: bool = True, usage: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "test-model", "max_tokens": 16, "stream": stream,
                           "messages": [{"role": "user", "content": words}]}
    if usage:
        out["stream_options"] = {"include_usage": True}
    return out


def events(raw: bytes) -> list[Any]:
    """The caller's stream as SSE events, each `data:` parsed: `[DONE]` as the string."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    out: list[Any] = []
    for event in raw[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), (event, raw)
        data = event[6:]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def post_all(gw: Server, bodies: list[dict[str, Any]]) -> list[Reply]:
    limit = asyncio.Semaphore(6)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        async def one(b: dict[str, Any]) -> Reply:
            async with limit, client.post(gw.url + "/v1/chat/completions", json=b) as resp:
                return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()},
                             await resp.read())
        return await asyncio.gather(*(one(b) for b in bodies))


def post(gw: Server, b: dict[str, Any]) -> Reply:
    return http("POST", gw.url + "/v1/chat/completions", b, timeout=30)


def charged(gw: Server, kind: str) -> float:
    return metric(scrape(gw.url), "gateway_tokens_total", kind=kind)


@pytest.mark.anyio
@pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
async def test_events_split_at_every_byte_reach_the_caller_whole_and_usage_is_charged(
        gateway: Server, spaced: bool) -> None:
    words = "stream spaced" if spaced else "stream"
    asks = [(r, usage) for r in range(K) for usage in (False, True)]
    before = charged(gateway, "output"), charged(gateway, "input")
    replies = await post_all(gateway, [body(f"{words} cut {K} {r}", usage=usage)
                                       for r, usage in asks])
    for (r, usage), reply in zip(asks, replies, strict=True):
        assert reply.status == 200, (r, reply.body)
        got = events(reply.body)
        assert got[-1] == "[DONE]" and "[DONE]" not in got[:-1], (r, got)
        chunks = got[:-1]
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks if c["choices"])
        assert text == "".join(TEXT), (r, got)
        usage_chunks = [c for c in chunks if not c["choices"]]
        if usage:
            assert [c["usage"] for c in usage_chunks] == [USAGE], (r, got)
        else:  # asked of the engine by the gateway, not by this caller
            assert usage_chunks == [], (r, got)
    quiet(gateway.url)
    assert charged(gateway, "output") - before[0] == USAGE["completion_tokens"] * len(asks)
    assert charged(gateway, "input") - before[1] == USAGE["prompt_tokens"] * len(asks)


@pytest.mark.anyio
async def test_the_official_sdk_reads_every_split_stream(gateway: Server) -> None:
    async with async_openai_client(gateway.url) as client:  # closed on this test's loop
        for r in range(K):
            stream = await client.chat.completions.create(
                model="test-model", max_tokens=16, stream=True,
                messages=[{"role": "user", "content": f"stream spaced cut {K} {r}"}])
            chunks = [chunk async for chunk in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
                "".join(TEXT)
            assert all(c.choices for c in chunks), r


@pytest.mark.anyio
@pytest.mark.parametrize("spaced", [False, True], ids=["compact", "spaced"])
async def test_an_error_event_split_at_every_byte_reaches_the_caller_in_openais_shape(
        gateway: Server, spaced: bool) -> None:
    words = "stream error spaced" if spaced else "stream error"
    replies = await post_all(gateway, [body(f"{words} cut {K} {r}") for r in range(K)])
    for r, reply in enumerate(replies):
        got = events(reply.body)
        errors = [e["error"] for e in got if isinstance(e, dict) and "error" in e]
        assert errors == [{"message": ERROR["message"], "type": "invalid_request_error",
                           "param": None, "code": None}], (r, got)
        assert got[-1] == "[DONE]"


def test_every_cut_of_the_test_stream_is_made() -> None:
    """The cuts above cover every byte position of the streams they cut."""
    for spaced in (False, True):
        for error in (False, True):
            n = len(stream_bytes(spaced, error))
            assert {p for p in range(1, n) for r in range(K) if p % K == r} == \
                set(range(1, n))


def test_usage_in_json_with_spaces_is_charged(gateway: Server) -> None:
    before = charged(gateway, "output")
    reply = post(gateway, body("whole spaced", stream=False))
    assert reply.status == 200, reply.body
    assert reply.json()["usage"] == USAGE
    quiet(gateway.url)
    assert charged(gateway, "output") - before == USAGE["completion_tokens"]


@pytest.mark.parametrize("script, says", [
    ("gzip", "answered in content-encoding `gzip`, which the gateway did not ask for"),
    ("switch", "answered HTTP 101, which is not an answer the gateway relays"),
])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_the_gateway_cannot_relay_is_a_502_in_openais_shape(
        gateway: Server, script: str, says: str, stream: bool) -> None:
    reply = post(gateway, body(script, stream=stream))
    assert reply.status == 502, reply.body
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "upstream_error"
    assert says in error["message"], error
    s = quiet(gateway.url)
    assert metric(s, "gateway_upstream_errors_total", kind="protocol") >= 1
    assert "Traceback" not in gateway.log()


def test_an_engine_silent_after_the_request_is_a_504_and_no_other_backend_gets_it(
        gateway: Server, engines: tuple[Misbehaving, Misbehaving]) -> None:
    before = sum(e.requests["silent"] for e in engines)
    reply = post(gateway, body("silent", stream=True))
    assert reply.status == 504, reply.body
    error = reply.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "upstream_timeout", error
    assert "did not answer within 1.5s" in error["message"]
    # The engine may be generating it: giving it to another would run it twice.
    assert sum(e.requests["silent"] for e in engines) - before == 1
    s = quiet(gateway.url)
    assert metric(s, "gateway_upstream_errors_total", kind="timeout") == 1
