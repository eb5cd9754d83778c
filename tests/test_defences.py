"""Defences: what a careless or hostile caller gets, and that the gateway stays whole."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import Server, http, metric, quiet

CHAT = "/v1/chat/completions"


def test_deep_json_and_absurd_arrays_400(sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    deep = b'{"model": "test-model", "messages": [{"role": "user", "content": ' \
        + b"[" * 200 + b"]" * 200 + b"}]}"
    status, _, body = http("POST", gw.url + CHAT, deep)
    assert status == 400 and b"nested deeper than 32 levels" in body
    wide = json.dumps({"model": "test-model", "messages": [{"role": "user", "content": "x"}],
                       "stop": [0] * 300_000}).encode()
    status, _, body = http("POST", gw.url + CHAT, wide)
    assert status == 400 and b"more than 200000 values" in body
    very_deep = b"[" * 5000 + b"]" * 5000  # beyond the JSON parser's own recursion limit
    status, _, body = http("POST", gw.url + CHAT, very_deep)
    assert status == 400 and b"invalid_json" in body


def test_headers_over_the_limit_431(sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        for i in range(200):
            s.sendall(b"x-filler-%d: %s\r\n" % (i, b"a" * 1000))
        s.sendall(b"\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 431")
    assert b"request_header_fields_too_large" in reply
    # The server is fine afterwards.
    assert http("POST", gw.url + CHAT, b"{}").status == 400


def test_flood_is_answered_503_at_once(start_sim: StartSim,
                                       start_gateway: StartGateway) -> None:
    extra = "server: {max_concurrent_requests: 3}\n"
    with start_sim() as sim, start_gateway(policy_yaml([sim.url], extra=extra)) as gw:
        body = json.dumps({"model": "test-model", "max_tokens": 300, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        with cf.ThreadPoolExecutor(10) as pool:
            results = list(pool.map(lambda _: http("POST", gw.url + CHAT, body, timeout=15),
                                    range(10)))
        statuses = sorted(r.status for r in results)
        assert statuses.count(200) >= 3
        busy = [r.body for r in results if r.status == 503]
        assert busy and b'"code":"server_busy"' in busy[0]
        assert metric(quiet(gw.url), "gateway_inflight_requests") == 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30)

fields = {
    "model": st.one_of(st.just("test-model"), st.just("nope"), json_values),
    "messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system",
                                                                   "assistant", "tool", "x"])},
                                       optional={"content": json_values,
                                                 "tool_calls": json_values}), max_size=4),
        json_values),
    "prompt": json_values,
    "max_tokens": st.one_of(st.integers(-5, 20), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "n": st.one_of(st.integers(-1, 3), json_values),
    "tools": json_values,
    "stream_options": json_values,
}
bodies = st.fixed_dictionaries({}, optional=fields).map(lambda d: json.dumps(d).encode()) \
    | st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode())


def test_fuzzed_bodies_never_5xx_and_leave_nothing_reserved(
        sim_and_gateway: tuple[Server, Server]) -> None:
    _, gw = sim_and_gateway
    seen: dict[int, int] = {}

    @settings(max_examples=2500, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                              "/gateway/estimate"]))
    def one(body: bytes, path: str) -> None:
        # Short generations: the point is the parser and the release paths, not the engine.
        try:
            data = json.loads(body)
            if isinstance(data, dict) and isinstance(data.get("max_tokens"), int) \
                    and data["max_tokens"] > 4:
                data["max_tokens"] = 4
                body = json.dumps(data).encode()
        except ValueError:
            pass
        status, _, reply = http("POST", gw.url + path, body, timeout=15)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (status, body, reply)

    one()
    assert sum(seen.values()) >= 2500
    assert seen.get(200, 0) >= 1 and seen.get(400, 0) >= 100, seen
    s = quiet(gw.url)
    assert metric(s, "gateway_kv_blocks_reserved") == 0
    assert metric(s, "gateway_inflight_requests") == 0
    assert metric(s, "gateway_queue_depth") == 0
