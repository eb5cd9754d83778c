"""Fault injection on a real simulated engine: each fault behaves as docs/simulator.md says.

Faults are set through `POST /admin/faults` and cleared with `DELETE /admin/faults` after each
test; the "down" test closes the listening socket, so it runs on its own engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from typing import Any

import aiohttp
import openai
import pytest

try:  # the openai SDK's HTTP client: httpx2 from openai 3, httpx before
    from httpx2 import HTTPError
except ImportError:
    from httpx import HTTPError

from tests.servers import Server, http, loadtest_cmd, openai_client, run_server

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
    reply = http(method, server.url + "/admin/faults", body)
    return reply.status, reply.json()


def stream(server: Server, tokens: int) -> Any:
    return openai_client(server.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=tokens,
        stream=True, extra_body={"ignore_eos": True})


def tokens_per_write(server: Server, tokens: int) -> list[int]:
    """A chat stream read one HTTP chunk at a time: the content tokens in each. The engine
    sends each write as one chunk, so this shows how it paced the stream without a clock."""
    conn = HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                     body=json.dumps({"model": MODEL, "max_tokens": tokens, "ignore_eos": True,
                                      "stream": True,
                                      "messages": [{"role": "user", "content": "count"}]}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.chunked
        raw = resp.fp  # the chunked framing itself, which HTTPResponse.read() hides
        assert raw is not None
        counts = []
        while size := int(raw.readline().split(b";")[0], 16):
            frames = raw.read(size).split(b"\n\n")
            raw.readline()  # the CRLF after the chunk
            counts.append(sum(1 for f in frames if f.startswith(b"data: {")
                              and json.loads(f[6:])["choices"][0]["delta"].get("content")))
        return counts
    finally:
        conn.close()


def test_fail_rate_answers_500_in_vllms_error_shape(faults: Server) -> None:
    status, settings = admin(faults, "POST", {"fail_rate": 1.0})
    assert status == 200 and settings["fail_rate"] == 1.0
    with pytest.raises(openai.InternalServerError) as info:
        openai_client(faults.url).completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert info.value.status_code == 500
    assert info.value.body == {"message": "Simulated engine failure (fault injection: fail_rate).",
                               "type": "InternalServerError", "param": None, "code": 500}
    admin(faults, "DELETE")
    ok = openai_client(faults.url).completions.create(model=MODEL, prompt="x", max_tokens=3)
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
        openai_client(faults.url).completions.create(model=MODEL, prompt="x", max_tokens=5)


def test_stall_pauses_a_stream_then_it_completes(faults: Server) -> None:
    admin(faults, "POST", {"stall_rate": 1.0, "stall_after_tokens": 2, "stall_s": 0.6})
    counts = tokens_per_write(faults, 8)
    assert sum(counts) == 8
    # Silent after token 2 while the engine goes on (it makes the other six in far less than
    # 0.6 s), then the tokens made meanwhile arrive in one burst.
    sent = [sum(counts[:i + 1]) for i in range(len(counts))]
    assert 2 in sent, counts
    assert counts[sent.index(2) + 1:] == [6], counts


def test_bad_fault_settings_name_the_field(faults: Server) -> None:
    status, body = admin(faults, "POST", {"fail_rate": 2})
    assert status == 400 and body["error"]["message"].startswith("fail_rate:")
    status, body = admin(faults, "POST", {"explode": True})
    assert status == 400 and body["error"]["message"].startswith("explode: unknown field")
    assert admin(faults, "GET") == (200, {"fail_rate": 0.0, "drop_rate": 0.0,
                                          "drop_after_tokens": 1, "stall_rate": 0.0,
                                          "stall_after_tokens": 1, "stall_s": 0.0,
                                          "split_rate": 0.0, "split_pause_s": 0.002,
                                          "spaced_rate": 0.0})
    status, body = admin(faults, "POST", {"split_pause_s": 5})
    assert status == 400 and body["error"]["message"].startswith("split_pause_s:")


async def reads_of_a_stream(server: Server, tokens: int) -> list[bytes]:
    """A chat stream (usage asked for) read through aiohttp as the bytes arrive, one entry
    per read: where each read ends is what the split fault changes."""
    body = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "count"}]}
    async with aiohttp.ClientSession() as session, session.post(
            server.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        return [chunk async for chunk in resp.content.iter_any()]


def test_split_and_spaced_frames_arrive_in_parts_and_reassemble(faults: Server) -> None:
    admin(faults, "POST", {"split_rate": 1.0, "spaced_rate": 1.0})
    reads = asyncio.run(reads_of_a_stream(faults, 12))
    data = b"".join(reads)
    events = data.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]", data[-200:]
    # Role, 12 tokens, usage, [DONE]; each cut in 2-4 parts, most of them read on their own.
    assert len(events) - 1 == 15
    assert len(reads) > 15, len(reads)
    assert sum(1 for r in reads if not r.endswith(b"\n\n")) >= 5, reads
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]).split() \
        == ["the", "of", "a", "model", "engine", "token", "and", "to", "is", "in",
            "simulated", "output"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert b'"usage": {"prompt_tokens": ' in data  # json.dumps' spacing, not vLLM's

    # Without the faults: whole frames, compact JSON.
    admin(faults, "DELETE")
    data = b"".join(asyncio.run(reads_of_a_stream(faults, 12)))
    assert b'"usage":{"prompt_tokens":' in data and b'"usage": {' not in data


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
        openai_client(faults.url).completions.create(model=MODEL, prompt="x", max_tokens=2)
    deadline = time.monotonic() + 5
    while True:
        try:
            ok = openai_client(faults.url).completions.create(
                model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "engine did not come back"
            time.sleep(0.1)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
    state = http("GET", faults.url + "/admin/state").json()
    assert state["kv_cache_usage"] == 0.0  # the crash dropped the running request's blocks
