"""Prefix identity and KV reservations at the engine's own block size
(gateway/signals/blocks.py): the pool's `block_size` (16 by default) stays the gateway's unit,
and what an engine of larger blocks (a CPU vLLM's 128) caches and allocates is rounded to its
block. The simulator reports its block size as vLLM does (`vllm:cache_config_info`), so it
stands in for vLLM here; tests/test_vllm.py holds the same against vLLM itself.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import msgspec

from gateway.commands.check import protections
from gateway.cost import CostModel
from gateway.cost.profiles import get_model
from gateway.pipeline.prepared import Work
from gateway.policy import parse_policy
from gateway.prefix import IndexMode, PrefixIndexes, block_hashes
from gateway.prefix.events import Follower
from gateway.signals.blocks import EngineBlocks, disagreement
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import free_port, gateway_cmd, http, metric, poll_metric, quiet, scrape

FAST_SCRAPES = """signals:
  scrape_interval_s: 0.2
"""


def test_engine_blocks_keep_each_engines_and_the_pools_largest() -> None:
    blocks = EngineBlocks()
    assert blocks.pool("p", 16) == 16 and blocks.of("p", "a", 16) == 16  # until a scrape
    assert blocks.report("p", "a", 128) and not blocks.report("p", "a", 128)
    assert blocks.report("p", "b", 32)
    assert blocks.pool("p", 16) == 128 and blocks.of("p", "b", 16) == 32
    assert blocks.report("p", "a", 16)  # restarted with smaller blocks
    assert blocks.pool("p", 16) == 32 and blocks.reported("p") == {"a": 16, "b": 32}


def test_disagreements_are_said_with_what_they_cost() -> None:
    assert disagreement(16, {}) is None and disagreement(16, {"a": 16, "b": 16}) is None
    same = disagreement(16, {"a": 128})
    assert same is not None and "follow the engines' 128" in same and "8x faster" in same
    odd = disagreement(48, {"a": 128})
    assert odd is not None and "does not divide" in odd and "lower bound" in odd
    mixed = disagreement(16, {"a": 16, "b": 128})
    assert mixed is not None and "a 16, b 128" in mixed and "largest (128)" in mixed


def test_check_says_the_rule_it_cannot_check() -> None:
    """`gateway check` reads no engine: for a vLLM pool it says whose block size will govern
    and where a disagreement will be said."""
    p = parse_policy(policy_yaml(["http://127.0.0.1:9"]), "policy.yaml")
    (line,) = [x for x in protections(p, p.pools["default"]) if x.startswith("KV blocks:")]
    assert "engines' own size" in line and "until then of block_size 16" in line
    assert "gateway_engine_kv_block_size_tokens" in line


def test_a_reservation_is_the_engines_whole_blocks_in_the_pools() -> None:
    costs = CostModel(get_model("llama-3-8b"), block_size=16, expected_output=40)
    work = Work(costs.cost(60, 200), sequences=2)  # 100 tokens each
    assert work.blocks == 2 * 7  # ceil(100 / 16)
    assert work.blocks_at(0) == work.blocks_at(16) == work.blocks  # not scraped yet
    assert work.blocks_at(128) == 2 * 8  # one 128-token block each, 8 of the pool's
    assert Work(costs.cost(200, 200), 1).blocks_at(128) == 16  # 240 tokens: two


def _stored(hashes: list[int], parent: int | None, tokens: list[int], size: int) -> bytes:
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
             "token_ids": tokens, "block_size": size, "lora_id": None, "medium": "GPU",
             "lora_name": None, "extra_keys": None, "group_idx": 0,
             "kv_cache_spec_kind": "full_attention"}  # as vLLM 0.32 sends it
    return msgspec.msgpack.encode([time.time(), [event], None])


def _removed(hashes: list[int]) -> bytes:
    return msgspec.msgpack.encode([time.time(), [{"type": "BlockRemoved", "block_hashes": hashes,
                                                  "medium": "GPU", "group_idx": 0}], None])


def test_precise_mode_follows_larger_engine_blocks_in_the_pools() -> None:
    """A BlockStored of 128-token blocks under a pool of 16: learnt as 8 of the pool's blocks
    each, chained from its parent; a BlockRemoved ends matches inside the removed block."""
    indexes = PrefixIndexes()
    indexes.configure("p", "b", 1000, IndexMode.PRECISE)
    follower = Follower("p", "b", indexes, 16)
    prompt = list(range(100, 100 + 300))
    follower.receive(0, _stored([11], None, prompt[:128], 128))
    follower.receive(1, _stored([12], 11, prompt[128:256], 128))
    index = indexes.get("p", "b")
    assert index is not None and follower.state.precise
    hashes = block_hashes(prompt, 16)
    assert index.match(hashes) == 16  # 256 tokens: both engine blocks
    follower.receive(2, _removed([12]))
    assert 8 <= index.match(hashes) < 16  # rounds down to the first engine block
    indexes.configure("p", "c", 1000, IndexMode.PRECISE)
    odd = Follower("p", "c", indexes, 48)
    odd.receive(0, _stored([11], None, prompt[:128], 128))
    assert not odd.state.precise and odd.state.fallbacks["block_size"] == 1


def _turns(gw_url: str, rounds: int = 4) -> list[tuple[int, int]]:
    """(predicted, served) cached tokens of each turn of one conversation."""
    messages = [{"role": "system", "content": "You are terse. " * 40}]
    seen = []
    for turn in range(rounds):
        messages.append({"role": "user", "content": f"Question {turn}: " + "why not? " * 37})
        reply = http("POST", gw_url + "/v1/chat/completions",
                     {"model": "test-model", "messages": messages, "max_tokens": 4})
        assert reply.status == 200, reply
        details = reply.json()["usage"].get("prompt_tokens_details") or {}
        seen.append((int(reply.headers["x-gateway-cached-tokens"]),
                     details.get("cached_tokens") or 0))
        messages.append({"role": "assistant", "content": f"Answer {turn}: " + "because. " * 20})
    return seen


def test_predicted_cached_tokens_are_the_engines_blocks(start_sim: StartSim,
                                                        start_gateway: StartGateway) -> None:
    """A simulated engine of 128-token blocks behind a pool of 16, approximate mode: each
    turn's prediction is what the engine served (at 16 it overshot by up to 112 tokens), and
    a short request reserves one engine block."""
    with start_sim("--block-size", "128", "--num-gpu-blocks", "64") as sim, \
            start_gateway(policy_yaml([sim.url], extra=FAST_SCRAPES)) as gw:
        poll_metric(gw.url, "gateway_engine_kv_block_size_tokens", lambda v: v == 128,
                    backend="e0")
        assert metric(scrape(gw.url), "gateway_kv_capacity_blocks", backend="e0") == 64 * 8
        turns = _turns(gw.url)
        assert all(p % 128 == 0 for p, _ in turns) and turns[-1][1] >= 256, turns
        assert [p for p, _ in turns] == [s for _, s in turns], turns
        estimate = http("POST", gw.url + "/gateway/estimate", {
            "model": "test-model", "max_tokens": 20,
            "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert estimate["decision"]["reserve_blocks"] == 8, estimate
        quiet(gw.url)


def test_precise_mode_at_the_engines_blocks(start_sim: StartSim,
                                            start_gateway: StartGateway) -> None:
    """The same conversation with the engine's KV events (128-token blocks) followed."""
    pub, replay = free_port(), free_port()
    with start_sim("--block-size", "128", "--num-gpu-blocks", "64",
                   "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                   "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}") as sim:
        backends = (f'      - {{name: e0, url: "{sim.url}", kv_events: {{endpoint: '
                    f'"tcp://127.0.0.1:{pub}", replay_endpoint: "tcp://127.0.0.1:{replay}"}}}}')
        policy = policy_yaml([sim.url], extra=FAST_SCRAPES,
                             pool_extra="    routing: {prefix: {mode: precise}}\n")
        policy = policy.replace(f'      - {{name: e0, url: "{sim.url}"}}', backends)
        with start_gateway(policy) as gw:
            poll_metric(gw.url, "gateway_kv_events_connected", lambda v: v == 1, backend="e0")
            time.sleep(0.3)  # the subscription reaches the engine's PUB socket
            turns = []
            for predicted, served in _turns(gw.url):
                turns.append((predicted, served))
                time.sleep(0.2)  # the turn's BlockStored reaches the index before the next
            assert [p for p, _ in turns] == [s for _, s in turns], turns
            assert turns[-1][1] >= 256, turns
            samples = scrape(gw.url)
            assert metric(samples, "gateway_kv_events_precise", backend="e0") == 1
            quiet(gw.url)


def test_check_reads_the_engines_block_sizes_when_asked(start_sim: StartSim,
                                                         tmp_path: Path) -> None:
    """`gateway check --engines` reads each engine's /metrics once: a pool whose engines'
    blocks differ gets a warning naming each backend and its size; engines of one size the
    pool's block_size divides get a note; an engine it cannot reach is said, not fatal."""
    with start_sim("--block-size", "16", "--num-gpu-blocks", "64") as small, \
            start_sim("--block-size", "128", "--num-gpu-blocks", "64") as large:
        mixed = tmp_path / "mixed.yaml"
        mixed.write_text(policy_yaml([small.url, large.url]))
        same = tmp_path / "same.yaml"
        same.write_text(policy_yaml([large.url, f"http://127.0.0.1:{free_port()}"]))
        done = subprocess.run([*gateway_cmd("check"), "--engines", str(mixed), str(same)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out, err = done.stdout, done.stderr
    assert "      - e0: KV blocks of 16 tokens, 64 blocks" in out, out
    assert "      - e1: KV blocks of 128 tokens, 64 blocks" in out, out
    (warning,) = [x for x in err.splitlines() if x.startswith(f"{mixed}: pools.default")]
    assert "its engines' KV blocks differ (e0 16, e1 128 tokens)" in warning, err
    assert f"{same}: pools.default" not in err, err
    assert "      - e1: not read (" in out and "note: its engines' KV blocks are 128" in out

    without = subprocess.run([*gateway_cmd("check"), str(mixed)], capture_output=True,
                             text=True, timeout=60)
    assert "engines (--engines)" not in without.stdout and "differ" not in without.stderr
