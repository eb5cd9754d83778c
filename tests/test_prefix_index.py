"""The prefix index and block hashing: plain code, no server (gateway/prefix/)."""

from __future__ import annotations

import random
from array import array

from gateway.admission.capacity import UNKNOWN_CAPACITY_BLOCKS
from gateway.prefix import ROOT_HASH, IndexMode, PrefixIndex, PrefixIndexes, block_hashes
from gateway.prefix.hashing import chain_hash
from gateway.prefix.index import MAX_TABLES, SHARD_BLOCKS
from loadtest.sim import prompts as sim_prompts
from loadtest.sim.kvcache import KVCacheManager
from loadtest.sim.scheduler import SimRequest


def test_hashes_chain_per_full_block_only() -> None:
    ids = list(range(50))
    hashes = block_hashes(ids, 16)
    assert len(hashes) == 3  # 48 tokens in full blocks; the last 2 are never hashed
    assert hashes[0] == chain_hash(ROOT_HASH, ids[:16])
    assert hashes[2] == chain_hash(hashes[1], ids[32:48])
    # A chain continues from a parent: an event's blocks after its parent block.
    assert block_hashes(ids[16:48], 16, seed=hashes[0]) == hashes[1:]
    # Equal leading blocks, equal leading hashes; one token changed changes every later hash.
    other = [*ids[:20], 999, *ids[21:]]
    h2 = block_hashes(other, 16)
    assert h2[0] == hashes[0] and h2[1] != hashes[1] and h2[2] != hashes[2]


def test_hashes_are_the_chain_definition_for_every_sequence_kind() -> None:
    """The fast loop gives hash((parent, tuple(block))) per full block, from any sequence."""
    rng = random.Random(3)
    for n in (0, 1, 15, 16, 17, 47, 48, 1000):
        ids = [rng.randrange(150_000) for _ in range(n)]
        for block_size in (1, 16, 32):
            want, parent = [], 12345
            for start in range(0, n - block_size + 1, block_size):
                parent = hash((parent, tuple(ids[start:start + block_size])))
                want.append(parent)
            for kind in (list, tuple, lambda x: array("I", x), lambda x: array("q", x)):
                assert block_hashes(kind(ids), block_size, seed=12345) == want


def test_hashing_agrees_with_the_simulator() -> None:
    rng = random.Random(7)
    ids = [rng.randrange(150_000) for _ in range(1000)]
    for block_size in (16, 32, 64):
        assert sim_prompts.from_token_ids(ids, block_size) == block_hashes(ids, block_size)
    # And the simulator's cache finds by those hashes the blocks a request registered.
    kv = KVCacheManager(num_blocks=100, block_size=16, enable_prefix_caching=True)
    first = SimRequest("a", 1000, 1, 1, 0.0, sim_prompts.from_token_ids(ids, 16))
    assert kv.allocate_slots(first, 1000)
    first.num_computed_tokens = 1000
    kv.register_full_blocks(first)
    kv.free(first)
    again = SimRequest("b", 1000, 1, 1, 0.0, block_hashes(ids, 16))
    assert len(kv.computed_blocks(again)) == 62  # (1000 - 1) // 16: the last token is computed


def test_match_counts_leading_blocks_and_is_pure() -> None:
    index = PrefixIndex(capacity_blocks=10)
    index.store([1, 2, 3])
    assert index.match([1, 2, 3, 4]) == 3
    assert index.match([1, 9, 3]) == 1
    assert index.match([]) == 0
    before = list(index._tables[0])
    index.match([3, 2, 1])
    assert list(index._tables[0]) == before


def test_lru_ages_tails_first_and_keeps_shared_prefix() -> None:
    index = PrefixIndex(capacity_blocks=5)
    index.store([1, 2, 3])  # a system prompt and a turn
    index.store([1, 2, 7, 8])  # the same system prompt, another conversation
    assert len(index) == 5 and index.evicted == 0
    index.store([1, 2, 9])  # one more block: the oldest tail goes, not the shared prefix
    assert index.match([1, 2]) == 2
    assert len(index) == 5 and index.evicted == 1
    assert 3 not in index  # conversation 1's tail was the least recently used


def test_a_large_index_is_cut_into_tables_each_aged_on_its_own() -> None:
    """Over SHARD_BLOCKS blocks an index is several tables by hash (a whole-table rehash
    would hold the loop for ~340 ms at 1M blocks): within its capacity, the most recent
    prompts kept whole and the oldest gone, and a resize that changes the tables keeps that."""
    rng = random.Random(7)
    index = PrefixIndex(capacity_blocks=8 * SHARD_BLOCKS)
    assert len(index._tables) == 8
    prompts = [[rng.getrandbits(63) - 2**62 for _ in range(64)] for _ in range(6_000)]
    for p in prompts:
        index.store(p)
    assert len(index) == 8 * SHARD_BLOCKS
    assert index.evicted == 6_000 * 64 - 8 * SHARD_BLOCKS
    assert all(index.match(p) == 64 for p in prompts[-100:])
    assert all(index.match(p) == 0 for p in prompts[:100])
    for p in prompts[-100:]:  # a history stored again, the common turn: nothing goes
        assert index.store(p) == 0
    assert len(index) == 8 * SHARD_BLOCKS and index.evicted == 6_000 * 64 - 8 * SHARD_BLOCKS
    index.resize(2 * SHARD_BLOCKS)
    assert len(index._tables) == 2 and len(index) == 2 * SHARD_BLOCKS
    assert all(index.match(p) == 64 for p in prompts[-100:])
    assert sum(index.match(p) for p in prompts[:4_000]) == 0
    # Precise mode across tables: the engine's hashes find their blocks in any of them.
    engine = [h + 1 for h in prompts[-1]]
    index.store(prompts[-1], engine_hashes=engine)
    assert index.gateway_hash(engine[5]) == prompts[-1][5]
    assert index.remove_engine(engine) == 64 and index.match(prompts[-1]) == 0


def test_an_unknown_capacity_makes_at_most_max_tables() -> None:
    """Admission's stand-in for a capacity not known yet is ~2^31 blocks: an index of it was
    2^18 tables, made at start-up for a llama.cpp pool (the gateway never came up)."""
    index = PrefixIndex(UNKNOWN_CAPACITY_BLOCKS)
    assert len(index._tables) == MAX_TABLES
    index.store([1, 2, 3])
    index.resize(100)
    assert len(index._tables) == 1 and index.match([1, 2, 3]) == 3


def test_remove_and_clear() -> None:
    index = PrefixIndex(capacity_blocks=10)
    index.store([1, 2, 3])
    index.remove([2, 42])
    assert index.match([1, 2, 3]) == 1
    index.clear()
    assert len(index) == 0 and index.match([1]) == 0


def test_precise_store_maps_engine_hashes_and_clamps() -> None:
    index = PrefixIndex(capacity_blocks=3)
    assert index.store([11, 12], engine_hashes=[101, 102]) == 0
    assert index.gateway_hash(102) == 12
    assert index.remove_engine([101, 555]) == 1
    assert index.match([11]) == 0 and 12 in index
    # An engine claiming more blocks than its capacity: clamped, oldest out, counted.
    assert index.store([21, 22, 23, 24], engine_hashes=[201, 202, 203, 204]) == 2
    assert index.clamped == 2 and len(index) == 3
    assert index.gateway_hash(102) is None  # its block was clamped out: the mapping too
    assert index.match([21, 22, 23]) == 3


def test_registry_modes_forget_and_retain() -> None:
    reg = PrefixIndexes()
    a = reg.configure("p", "a", 100)
    reg.configure("p", "b", 100, IndexMode.PRECISE)
    a.store([1, 2])
    assert reg.learns_from_traffic("p", "a") and not reg.learns_from_traffic("p", "b")
    reg.set_mode("p", "b", IndexMode.FELL_BACK)
    assert reg.mode("p", "b") is IndexMode.FELL_BACK and reg.learns_from_traffic("p", "b")
    reg.forget("p", "a")
    assert reg.get("p", "a") is a and a.match([1]) == 0
    assert reg.configure("p", "a", 50) is a and a.capacity_blocks == 50
    reg.retain([("p", "a")])
    assert reg.get("p", "b") is None and reg.get("p", "a") is a
