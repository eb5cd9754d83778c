"""Block hashes of a prompt, for prefix caching: equal leading hashes mean a shared prefix.

vLLM hashes each full block of token ids chained with its parent's hash. The simulator does that
exactly when it has the ids (a completions prompt given as token ids, or any prompt when it has
an exact tokenizer), with the gateway's function (gateway/prefix/hashing.py). Otherwise:

- `prefix_hash_ids` (a request field, for replaying traces without text): one id per
  `prefix_hash_block_size` tokens (512 in Mooncake traces). Engine block i lies in hash block
  i x block_size // prefix_hash_block_size; its hash chains (that id, i).
- chat messages: counting gives the exact prompt length but not token ids, so block boundaries
  are estimated per message (characters x TOKENS_PER_CHAR + MESSAGE_OVERHEAD_TOKENS, a function
  of the message alone). A block's hash chains the digest of the messages up to the one it ends
  in, so two requests share exactly the blocks that lie inside their common leading messages
  (system prompt, few-shot examples, earlier turns), give or take the estimate at the boundary.
- a completions prompt string: the same, on a fixed grid of characters per block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from gateway.prefix.hashing import block_hashes

# Estimate for block boundaries only (the prompt's token count is always exact): BPE vocabularies
# of 100K+ tokens average ~4 characters a token on English text.
TOKENS_PER_CHAR = 0.25
# Role markers and separators a template adds per message (<|im_start|>role\n...<|im_end|>\n).
MESSAGE_OVERHEAD_TOKENS = 5


def from_token_ids(ids: Sequence[int], block_size: int) -> list[int]:
    # The gateway's own definition, so its prefix index and this cache name blocks alike.
    return block_hashes(ids, block_size)


def from_hash_ids(hash_ids: Sequence[int], hash_block_size: int, prompt_tokens: int,
                  block_size: int) -> list[int]:
    per = hash_block_size // block_size
    full = min(prompt_tokens // block_size, len(hash_ids) * per)
    hashes: list[int] = []
    parent = 0
    for index in range(full):
        parent = hash((parent, hash_ids[index // per], index % per))
        hashes.append(parent)
    return hashes


def from_messages(messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None, prompt_tokens: int,
                  block_size: int) -> list[int]:
    full = prompt_tokens // block_size
    if full == 0:
        return []
    digest = hash(orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)) if tools else 0
    ends: list[tuple[int, int]] = []  # (estimated end token of message k, digest of 0..k)
    position = 0
    for message in messages:
        encoded = orjson.dumps(message, option=orjson.OPT_SORT_KEYS)
        digest = hash((digest, encoded))
        position += math.ceil(len(encoded) * TOKENS_PER_CHAR) + MESSAGE_OVERHEAD_TOKENS
        ends.append((position, digest))
    hashes: list[int] = []
    parent = 0
    k = 0
    for index in range(full):
        end = (index + 1) * block_size
        while k < len(ends) - 1 and ends[k][0] < end:
            k += 1
        parent = hash((parent, ends[k][1] if ends else 0, index))
        hashes.append(parent)
    return hashes


def from_text(text: str, prompt_tokens: int, block_size: int) -> list[int]:
    chars_per_block = max(1, round(block_size / TOKENS_PER_CHAR))
    hashes: list[int] = []
    parent = 0
    for index in range(prompt_tokens // block_size):
        start = index * chars_per_block
        parent = hash((parent, text[start:start + chars_per_block], index))
        hashes.append(parent)
    return hashes
