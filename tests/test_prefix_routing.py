"""Prefix-aware routing and cost (issue 19): the placement rule as plain code, then a real
gateway in front of two simulated engines, where a repeated conversation hits the engine's
prefix cache where the gateway predicted it would."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from gateway.admission.controller import Admission, Ask
from gateway.admission.decision import AskView, BackendView, PoolView, blocks_on, decide, place
from gateway.observe.metrics import GatewayMetrics
from gateway.policy import Policy, parse_policy
from gateway.prefix import IndexMode
from gateway.routing.backends import Backends
from gateway.routing.router import PrefixRule, most_headroom_first, prefix_order
from gateway.signals.engines import EngineScraper
from gateway.state import MemoryState
from loadtest.workload import Item, WorkloadError, multiturn_items, parse_multiturn
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import (
    gateway_cmd,
    http,
    loadtest_cmd,
    metric,
    openai_client,
    poll_metric,
    quiet,
    scrape,
)

RULE = PrefixRule()  # the policy's defaults
TIGHT = PrefixRule(epsilon=0.25, slack_tokens=0)  # a hard bound that binds at these loads


def backend(name: str, **kw: object) -> BackendView:
    base = BackendView(name=name, available=True, limit_blocks=10_000, reserved_blocks=0,
                       outstanding=0, ruled_out=None, over_static_rule=False)
    return replace(base, **kw)  # type: ignore[arg-type]


def pool(backends: Sequence[BackendView], rule: PrefixRule | None = RULE) -> PoolView:
    return PoolView(name="p", mode="enforce", backends=tuple(backends), reserved_tokens=0,
                    token_limit=None, tenant_held=0, tenant_max=None, overflow_inflight=0,
                    overflow_cap=None, queue_size=8, queue_admits=True, predicted_wait_s=0.0,
                    deadline_s=10.0, prefix=rule)


ASK = AskView(blocks=200, tokens=3000, prompt_tokens=2800)


def test_conversation_stays_on_its_backend_while_the_prefill_it_saves_outweighs_its_load(
        ) -> None:
    # a holds 2,400 of the prompt's 2,800 tokens; b and c hold nothing and have more headroom.
    # Cost: prefill backlog + the prompt not cached + 0.25 x tokens in flight. b and c cost
    # 2,800 + 0.25 x 3,000 = 3,550; a 400 + 0.25 x L: a keeps the conversation while
    # L < 12,600, turn after turn.
    a = backend("a", cached_tokens=2400, reserved_blocks=500)
    b, c = backend("b", inflight_tokens=3000), backend("c", inflight_tokens=3000)
    for load in (0, 6000, 12_500):
        view = pool([replace(a, inflight_tokens=load), b, c])
        assert place(view, ASK).backend == "a", load
    # Past it the turn goes to the cheapest other backend (b and c tie: policy order).
    view = pool([replace(a, inflight_tokens=12_700), b, c])
    assert [x.name for x in prefix_order(view.backends, RULE, 3000, 2800)] == ["b", "c", "a"]
    assert place(view, ASK).backend == "b"
    # A prefill backlog ahead of it counts in full: 3,200 + 400 > 3,550.
    assert place(pool([replace(a, prefill_tokens=3200), b, c]), ASK).backend == "b"


def test_the_hard_imbalance_bound_overrides_the_cost() -> None:
    a = backend("a", cached_tokens=2400, inflight_tokens=9000)
    b, c = backend("b", inflight_tokens=3000), backend("c", inflight_tokens=2000)
    # a is cheapest (400 + 2,250 against 3,550 and 3,300), but 9,000 + 3,000 is past
    # 1.25 x the mean after the request (17,000 / 3): b and c first, by cost.
    assert [x.name for x in prefix_order([a, b, c], TIGHT, 3000, 2800)] == ["c", "b", "a"]
    assert place(pool([a, b, c], TIGHT), ASK).backend == "c"
    # The absolute slack: 12,000 <= 17,000 / 3 + 8,192, so the cost decides again.
    assert place(pool([a, b, c], replace(TIGHT, slack_tokens=8192)), ASK).backend == "a"


def test_least_loaded_backend_is_always_within_the_bound() -> None:
    # Two idle backends and a large request: the mean after it cannot hold it anywhere, but
    # placing on the least loaded is always allowed.
    a, b = backend("a", cached_tokens=2000), backend("b")
    assert prefix_order([a, b], RULE, ask_tokens=100_000, prompt_tokens=2800)[0] is a


def test_prompts_that_never_repeat_are_placed_and_charged_as_before() -> None:
    backends = [backend("a", reserved_blocks=900), backend("b", reserved_blocks=100),
                backend("c", reserved_blocks=400, inflight_tokens=99_999)]
    assert prefix_order(backends, RULE, 3000, 2800) == most_headroom_first(backends)
    prefix_off = pool(backends, rule=None)
    on = pool(backends)
    assert decide(on, ASK) == decide(prefix_off, ASK)
    assert all(blocks_on(b, ASK.blocks) == ASK.blocks for b in backends)


def test_blocks_held_for_requests_in_flight_are_not_reserved_twice() -> None:
    b = backend("a", shared_blocks=150, cached_tokens=2400)
    assert blocks_on(b, 200) == 50
    assert blocks_on(replace(b, shared_blocks=500), 200) == 1  # never less than a block
    # A backend whose KV limit only fits the request with the sharing takes it.
    tight = replace(b, limit_blocks=1000, reserved_blocks=900)
    assert place(pool([tight]), ASK).backend == "a"
    assert place(pool([replace(tight, shared_blocks=0)]), ASK).backend is None


def test_session_affinity_while_it_costs_least() -> None:
    a, b = backend("a"), backend("b", affinity=True, reserved_blocks=2000)
    assert place(pool([a, b]), ASK).backend == "b"
    # Loaded past what it saves (0.25 x 50,000 > 2,800), the session's backend waits its turn
    # like any other; the same past the hard bound.
    loaded = replace(b, inflight_tokens=50_000)
    assert place(pool([a, loaded]), ASK).backend == "a"
    assert place(pool([a, loaded], TIGHT), ASK).backend == "a"


def test_shadow_rule_places_by_headroom() -> None:
    a = backend("a", cached_tokens=2400, reserved_blocks=500)
    b = backend("b")
    assert place(pool([a, b], replace(RULE, act=False)), ASK).backend == "b"
    assert place(pool([a, b]), ASK).backend == "a"


# --- end to end: a real gateway, two simulated engines ----------------------------------------

SYSTEM = "You are a careful assistant for a parts catalogue. " * 60  # ~600 tokens


def turn(history: list[Any], text: str) -> list[Any]:
    return [*history, {"role": "user", "content": text}]


@pytest.mark.parametrize("stream", [False, True])
def test_repeated_conversation_hits_the_engine_cache_where_predicted(
        start_sim: StartSim, start_gateway: StartGateway, stream: bool) -> None:
    with start_sim() as s0, start_sim() as s1, \
            start_gateway(policy_yaml([s0.url, s1.url])) as gw:
        client = openai_client(gw.url)
        history: list[Any] = [{"role": "system", "content": SYSTEM}]
        seen: list[tuple[str, int, int, int]] = []  # backend, predicted, engine cached, prompt
        for k in range(3):
            history = turn(history, f"Question {k}: which bolts fit part {uuid.uuid4().hex}?")
            raw = client.chat.completions.with_raw_response.create(
                model="test-model", messages=history, max_tokens=8, stream=stream,
                stream_options={"include_usage": True} if stream else None)
            predicted = int(raw.headers["x-gateway-cached-tokens"])
            answer: Any = raw.parse()
            usage = [c.usage for c in answer if c.usage is not None][-1] if stream \
                else answer.usage
            assert usage is not None
            details = usage.prompt_tokens_details
            engine = details.cached_tokens or 0 if details is not None else 0
            seen.append((raw.headers["x-gateway-backend"], predicted, engine,
                         usage.prompt_tokens))
            history.append({"role": "assistant", "content": "Those of size M6."})
        backends = {b for b, *_ in seen}
        assert len(backends) == 1, seen  # the conversation stayed where its cache is
        assert seen[0][1] == 0 and seen[0][2] == 0
        for _, predicted, engine, prompt in seen[1:]:
            assert predicted > 500 and predicted == engine, seen
            assert predicted < prompt
        samples = quiet(gw.url)
        assert metric(samples, "gateway_kv_reserved_blocks") == 0
        assert metric(samples, "gateway_prefix_predicted_cached_tokens_total") == \
            metric(samples, "gateway_prefix_engine_cached_tokens_total") == \
            sum(p for _, p, _, _ in seen)
        assert metric(samples, "gateway_prefix_placements_total", by="prefix") == 2


def test_estimate_shows_cached_tokens_and_score_per_backend(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    with start_sim() as s0, start_sim() as s1, \
            start_gateway(policy_yaml([s0.url, s1.url])) as gw:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        body = {"model": "test-model", "messages": messages, "max_tokens": 4}
        first = http("POST", gw.url + "/v1/chat/completions", body)
        assert first.status == 200 and first.headers["x-gateway-cached-tokens"] == "0"
        where = first.headers["x-gateway-backend"]
        reply = http("POST", gw.url + "/gateway/estimate", body)
        assert reply.status == 200, reply.body
        out = json.loads(reply.body)
        backends = out["decision"]["backends"]
        assert backends[where]["prefix"]["cached_tokens"] > 500
        other = next(name for name in backends if name != where)
        assert backends[other]["prefix"]["cached_tokens"] == 0
        assert backends[where]["prefix"]["cost_tokens"] < backends[other]["prefix"]["cost_tokens"]
        assert out["decision"]["backend"] == where
        assert out["decision"]["cached_tokens"] == backends[where]["prefix"]["cached_tokens"]
        assert out["prompt_blocks_hashed"] > 0
        quiet(gw.url)


def test_prefix_off_is_headroom_routing_with_a_zero_header(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    off = "    routing: {prefix: {mode: \"off\"}}\n"
    with start_sim() as s0, start_gateway(policy_yaml([s0.url], pool_extra=off)) as gw:
        body = {"model": "test-model", "max_tokens": 4,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "Hi"}]}
        for _ in range(2):
            reply = http("POST", gw.url + "/v1/chat/completions", body)
            assert reply.status == 200
            assert reply.headers["x-gateway-cached-tokens"] == "0"
        samples = scrape(gw.url)
        assert metric(samples, "gateway_prefix_prompt_tokens_total") == 0


def test_bad_routing_policy_is_refused_at_load(tmp_path: Path) -> None:
    bad = "    routing: {prefix: {mode: sometimes}}\n"
    path = tmp_path / "bad.yaml"
    path.write_text(policy_yaml(["http://127.0.0.1:9"], pool_extra=bad))
    out = subprocess.run(gateway_cmd("check", str(path)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "routing.prefix.mode" in out.stdout + out.stderr
    # The share-based score's weights are gone: a policy naming them is told what replaced them.
    old = "    routing: {prefix: {cache_weight: 2.0, kv_weight: 0.1}}\n"
    path.write_text(policy_yaml(["http://127.0.0.1:9"], pool_extra=old))
    out = subprocess.run(gateway_cmd("check", str(path)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "cache_weight, kv_weight: replaced by `inflight_weight`" in out.stdout + out.stderr


def test_loadtest_multiturn_reports_engine_predicted_and_potential_hit_rates(
        start_sim: StartSim, start_gateway: StartGateway, tmp_path: Path) -> None:
    with start_sim() as s0, start_sim() as s1, \
            start_gateway(policy_yaml([s0.url, s1.url])) as gw:
        out = tmp_path / "run.json"
        done = subprocess.run(loadtest_cmd(
            "run", "--url", gw.url, "--multiturn",
            "conversations=4,turns=3,system=1024,turn=512,out=4,think=0.4,start=10",
            "--duration", "20", "--no-progress", "--out", str(out)),
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "Prefix cache" in done.stdout
        prefix = json.loads(out.read_text())["prefix_cache"]
        # 12 requests of 3, 4, 5 blocks of 512 (+ 32 unique tokens): the 2 system blocks hit
        # for the 3 later conversations, each turn's whole history for its next turn.
        assert prefix["potential_hit_rate"] == pytest.approx(
            (3 * 2 + 4 * 3 + 4 * 4) * 512 / (4 * (1568 + 2080 + 2592)), abs=0.001)
        assert prefix["engine_hit_rate"] > 0.4
        assert abs(prefix["predicted_hit_rate"] - prefix["engine_hit_rate"]) < 0.1
        quiet(gw.url)


def test_every_exit_returns_reservations_and_held_blocks_to_zero(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """A cached conversation's turns end every way a request can end; after each, nothing is
    reserved, nothing held in the prefix index, no in-flight tokens counted, no backlog.
    (Failures do not eject the backend here: an ejection forgets its index, tested apart.)"""
    with start_sim() as s0, start_gateway(policy_yaml([s0.url]).replace(
            "failure_threshold: 2", "failure_threshold: 100")) as gw:
        client = openai_client(gw.url)
        history: list[Any] = [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Which bolts fit part 7?"}]
        body = {"model": "test-model", "messages": history, "max_tokens": 4}

        def check_zero() -> None:
            samples = quiet(gw.url)
            assert metric(samples, "gateway_kv_reserved_blocks") == 0
            out = json.loads(http("POST", gw.url + "/gateway/estimate", body).body)
            prefix = out["decision"]["backends"]["e0"]["prefix"]
            assert prefix["shared_blocks"] == 0 and prefix["inflight_tokens"] == 0, prefix
            assert out["decision"]["backends"]["e0"]["prefill_pending_tokens"] == 0

        assert http("POST", gw.url + "/v1/chat/completions", body).status == 200  # completed
        check_zero()
        # The caller leaves mid-stream.
        stream = client.chat.completions.create(
            model="test-model", messages=history, max_tokens=4000, stream=True,
            extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        next(it)
        stream.close()
        check_zero()
        # The engine fails the request.
        assert http("POST", s0.url + "/admin/faults", {"fail_rate": 1.0}).status == 200
        assert http("POST", gw.url + "/v1/chat/completions", body).status >= 500
        assert http("POST", s0.url + "/admin/faults", {"fail_rate": 0.0}).status == 200
        check_zero()
        # The engine drops the connection mid-stream.
        assert http("POST", s0.url + "/admin/faults",
                    {"drop_rate": 1.0, "drop_after_tokens": 2}).status == 200
        with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a cut stream varies
            list(client.chat.completions.create(model="test-model", messages=history,
                                                max_tokens=50, stream=True))
        assert http("POST", s0.url + "/admin/faults", {"drop_rate": 0.0}).status == 200
        check_zero()
        # A request refused before admission (its prompt is over the context window).
        too_long = {**body, "max_tokens": 100_000}
        assert http("POST", gw.url + "/v1/chat/completions", too_long).status == 400
        check_zero()
        # And the conversation still hits where the gateway predicts it.
        raw = client.chat.completions.with_raw_response.create(
            model="test-model", messages=history, max_tokens=4)
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        engine_cached = usage.prompt_tokens_details.cached_tokens or 0
        assert int(raw.headers["x-gateway-cached-tokens"]) == engine_cached > 500
        check_zero()


def test_an_ejected_backend_forgets_what_it_held(start_sim: StartSim,
                                                 start_gateway: StartGateway) -> None:
    with start_sim() as s0, start_sim() as s1, \
            start_gateway(policy_yaml([s0.url, s1.url])) as gw:
        body = {"model": "test-model", "max_tokens": 4,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "Hi"}]}
        first = http("POST", gw.url + "/v1/chat/completions", body)
        where = first.headers["x-gateway-backend"]
        sim = s0 if where == "e0" else s1

        def cached() -> int:
            out = json.loads(http("POST", gw.url + "/gateway/estimate", body).body)
            return int(out["decision"]["backends"][where]["prefix"]["cached_tokens"])

        assert cached() > 500
        assert http("POST", sim.url + "/admin/faults", {"fail_rate": 1.0}).status == 200
        for _ in range(2):  # failure_threshold 2: ejected (the gateway retries elsewhere)
            http("POST", gw.url + "/v1/chat/completions", body)
        samples = scrape(gw.url)
        assert metric(samples, "gateway_prefix_index_forgotten_total", backend=where,
                      why="ejected") == 1
        assert cached() == 0


def test_sessions_stick_to_one_backend_where_nothing_is_cached(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Prompts too short to fill a block give no prefix to route by: the session's backend
    (x-session-id, else `user`) takes each session's requests, and sessions spread."""
    with start_sim() as s0, start_sim() as s1, \
            start_gateway(policy_yaml([s0.url, s1.url])) as gw:
        where: dict[str, set[str]] = {}
        for k in range(3):
            for n in range(12):
                session = f"session-{n}"
                by_header = n % 2 == 0
                body: dict[str, Any] = {
                    "model": "test-model", "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"hi {k}"}]}
                if not by_header:
                    body["user"] = session
                reply = http("POST", gw.url + "/v1/chat/completions", body,
                             headers={"x-session-id": session} if by_header else None)
                assert reply.status == 200
                assert reply.headers["x-gateway-cached-tokens"] == "0"
                where.setdefault(session, set()).add(reply.headers["x-gateway-backend"])
        assert all(len(b) == 1 for b in where.values()), where
        assert len(set().union(*where.values())) == 2  # 12 sessions: both backends take some
        samples = quiet(gw.url)
        assert metric(samples, "gateway_prefix_placements_total", by="affinity") == 36


def test_shadow_mode_counts_what_prefix_routing_would_do(start_sim: StartSim,
                                                        start_gateway: StartGateway) -> None:
    shadow = "    routing: {prefix: {mode: shadow}}\n"
    with start_sim() as s0, start_sim() as s1, \
            start_gateway(policy_yaml([s0.url, s1.url], pool_extra=shadow)) as gw:
        history: list[Any] = [{"role": "system", "content": SYSTEM}]
        for k in range(3):
            history = turn(history, f"Question {k}?")
            reply = http("POST", gw.url + "/v1/chat/completions",
                         {"model": "test-model", "messages": history, "max_tokens": 2})
            assert reply.status == 200
            history.append({"role": "assistant", "content": "M6."})
            # The reservation is released just after the answer's last byte: until then e0 has
            # less headroom than e1, and headroom placement would send the next turn there.
            poll_metric(gw.url, "gateway_kv_reserved_blocks", lambda v: v == 0)
        samples = quiet(gw.url)
        assert metric(samples, "gateway_prefix_shadow_total") == 3
        # Idle engines: headroom picks e0 every time, where the cache is: they agree.
        assert metric(samples, "gateway_prefix_shadow_total", agreed="true") == 3
        assert metric(samples, "gateway_prefix_shadow_cached_tokens_total") > 1000


def test_a_restarted_engine_is_forgotten(start_sim: StartSim,
                                         start_gateway: StartGateway) -> None:
    body = {"model": "test-model", "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Hi"}]}
    with start_sim() as s0:
        port = s0.port
        with start_gateway(policy_yaml([s0.url])) as gw:
            assert http("POST", gw.url + "/v1/chat/completions", body).status == 200
            estimate = json.loads(http("POST", gw.url + "/gateway/estimate", body).body)
            assert estimate["decision"]["cached_tokens"] > 500
            s0.stop()
            with start_sim(port=port):
                # Down (a probe failed) or restarted (its prefix counters fell): forgotten.
                samples = poll_metric(gw.url, "gateway_prefix_index_forgotten_total",
                                      lambda v: v >= 1, timeout=10)
                assert metric(samples, "gateway_prefix_index_forgotten_total", backend="e0") >= 1
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    reply = http("POST", gw.url + "/gateway/estimate", body)
                    if reply.status == 200:
                        break
                    time.sleep(0.2)
                assert json.loads(reply.body)["decision"]["cached_tokens"] == 0


def test_multiturn_workload_shape_and_errors() -> None:
    mt = parse_multiturn("conversations=3,turns=4,system=1024,turn=600,out=16,think=2,start=1")
    items = multiturn_items(mt, seed=1)
    assert len(items) == 12
    assert [i.arrival_s for i in items] == sorted(i.arrival_s for i in items)
    by_conversation: dict[str | None, list[Item]] = {}
    for i in items:
        by_conversation.setdefault(i.session, []).append(i)
    assert len(by_conversation) == 3
    system = items[0].block_hashes[:2]
    for turns in by_conversation.values():
        # 2 system blocks, then 2 blocks a turn (600 tokens rounded up to 512-token blocks),
        # each turn's history the previous turn's plus its own, 2 s apart.
        assert [len(t.block_hashes) for t in turns] == [4, 6, 8, 10]
        assert all(t.block_hashes[:2] == system for t in turns)
        assert all(b.block_hashes[:len(a.block_hashes)] == a.block_hashes
                   for a, b in pairwise(turns))
        assert [round(b.arrival_s - a.arrival_s, 6) for a, b in
                pairwise(turns)] == [2.0, 2.0, 2.0]
        assert turns[-1].prompt_tokens == 10 * 512 + 32
    with pytest.raises(WorkloadError, match="expected positive conversations=N"):
        parse_multiturn("conversations=3,turns=0")
    with pytest.raises(WorkloadError, match="expected positive"):
        parse_multiturn("rounds=3")


def test_a_cached_backend_over_its_prefill_backlog_takes_the_request_if_sooner() -> None:
    # a holds 2,400 of 2,800 tokens but is prefilling 9,000 (over the backlog limit with the
    # 400 it would add); b is idle and holds nothing: b's first token needs 2,800 of prefill,
    # a's 9,400: b takes it.
    a = backend("a", cached_tokens=2400, prefill_tokens=9000, ruled_out="prefill_tokens")
    b = backend("b")
    assert place(pool([a, b]), ASK).backend == "b"
    # a prefilling 2,000: 2,400 tokens before its first token against b's 2,800: a takes it.
    assert place(pool([replace(a, prefill_tokens=2000), b]), ASK).backend == "a"
    # Without prefix routing (or in shadow) the backlog rule stands as before.
    assert place(pool([replace(a, prefill_tokens=2000), b], rule=None), ASK).backend == "b"
    assert place(pool([replace(a, prefill_tokens=2000), b], replace(RULE, act=False)),
                 ASK).backend == "b"
    # Ruled out for another reason (the engine's own report): never.
    other = replace(a, prefill_tokens=2000, ruled_out="engine_kv")
    assert place(pool([other, b]), ASK).backend == "b"


def _pool_p(rest: str) -> Policy:
    """One pool `p` of model `m` (1,000 KV blocks) and `rest` of the pool's keys."""
    return parse_policy("""
models:
  - {name: m, architecture: llama-3-8b}
pools:
  p:
    models: [m]
    max_model_len: 8192
    kv_blocks: 1000
""" + rest)


def test_precise_mode_counts_blocks_of_requests_in_flight_as_cached() -> None:
    """The engine's events name a block once computed; a follow-up sent while the first
    request still prefills is scheduled after it and hits: it is predicted so."""
    policy = _pool_p("""    routing: {prefix: {mode: precise}}
    backends:
      - {name: a, url: "http://127.0.0.1:1", kv_events: {endpoint: "tcp://127.0.0.1:2"}}
      - {name: b, url: "http://127.0.0.1:3", kv_events: {endpoint: "tcp://127.0.0.1:4"}}
""")
    hashes = tuple(range(1, 101))

    async def check() -> None:
        metrics = GatewayMetrics()
        adm = Admission(policy, Backends(policy, metrics), MemoryState(), metrics,
                        EngineScraper(5.0))
        assert adm.prefix.indexes.mode("p", "a") is IndexMode.PRECISE
        ask = Ask("p", blocks=110, tokens=1800, prompt_tokens=1600, hashes=hashes,
                  hash_block=16)
        first = await adm.admit(ask)
        for _ in range(2):  # blocks are held two turns of the loop later (admission/prefixes)
            await asyncio.sleep(0)
        index = adm.prefix.indexes.get("p", first.backend.name)
        assert index is not None and len(index) == 0  # precise: nothing learnt from traffic
        view = adm.view(ask)
        at = {b.name: b.cached_tokens for b in view.backends}
        assert at[first.backend.name] == 99 * 16 and sum(at.values()) == 99 * 16
        # The other backend busy with a prompt of its own (by headroom: it holds nothing of it),
        # the follow-up costs least where its blocks are being computed, and is told so.
        other = await adm.admit(Ask("p", blocks=260, tokens=4200, prompt_tokens=4000,
                                    hashes=tuple(range(1000, 1250)), hash_block=16))
        assert other.backend is not first.backend
        second = await adm.admit(ask)
        assert second.backend is first.backend and second.cached_tokens == 99 * 16
        for t in (first, other, second):
            await adm.release(t)
        assert all(b.cached_tokens == 0 for b in adm.view(ask).backends)

    asyncio.run(check())
