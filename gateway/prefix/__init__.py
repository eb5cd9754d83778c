"""Where prompts' prefixes live: block hashes of a prompt and a per-backend index of them.

    hashing.py  a prompt's chained block hashes (vLLM's chaining, our own hash function)
    index.py    per backend: which of those hashes it holds, aged to its KV capacity; the
                registry of every backend's index and the mode it is kept in
"""

from gateway.prefix.hashing import ROOT_HASH, block_hashes, chain_hash
from gateway.prefix.index import IndexMode, PrefixIndex, PrefixIndexes

__all__ = ["ROOT_HASH", "IndexMode", "PrefixIndex", "PrefixIndexes", "block_hashes",
           "chain_hash"]
