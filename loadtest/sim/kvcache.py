"""The paged KV cache: a pool of fixed-size blocks with prefix caching by block hash.

It follows vLLM V1's `BlockPool` / `KVCacheManager`:
- a request holds a list of block ids covering its computed tokens plus those scheduled now;
- every full block gets a hash that chains its parent's hash and its own tokens, so equal hashes
  mean equal prefixes; a full block is registered under its hash once computed;
- a freed block keeps its hash and content and goes to the tail of the free queue; allocation
  takes from the head (least recently freed first) and only then forgets the hash. A new request
  whose leading block hashes are registered takes those blocks back ("touch") instead of
  computing them: that is a prefix-cache hit;
- a request's blocks are freed tail first, so a sequence's last blocks are evicted before its
  shared prefix is;
- usage (`vllm:kv_cache_usage_perc`) is the share of blocks not in the free queue;
- with an event sink (`--kv-events-endpoint`), where vLLM's block pool queues its KV cache
  events, so does this one: a stored run of blocks, an evicted block, a reset.

Blocks are bare ints; all state lives in flat lists, so one step's bookkeeping is cheap.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class BlockOwner(Protocol):
    """What the cache needs of a request (implemented by `scheduler.SimRequest`)."""

    blocks: list[int]
    num_registered_blocks: int
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    def block_hash(self, index: int) -> int: ...

    def block_tokens(self, index: int, block_size: int) -> Sequence[int]: ...


class KVEventSink(Protocol):
    """Where the cache's events go (implemented by `kv_events.KVEventPublisher`)."""

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int],
               block_size: int) -> None: ...

    def removed(self, block_hash: int) -> None: ...

    def cleared(self) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.events: KVEventSink | None = None
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        # An OrderedDict is an O(1) doubly linked free queue with O(1) removal of a touched block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def is_free(self, block: int) -> bool:
        return self._ref[block] == 0

    def touch(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def allocate(self, count: int) -> list[int]:
        out: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:  # evict: its content is about to be overwritten
                if self._cached.get(old) == block:
                    del self._cached[old]
                    if self.events is not None:
                        self.events.removed(old)
                self._hash[block] = None
            self._ref[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def register(self, block: int, block_hash: int) -> bool:
        # A duplicate (two requests computed the same prefix in the same step) stays unregistered,
        # as in vLLM: the first copy serves later hits.
        if block_hash not in self._cached and self._hash[block] is None:
            self._cached[block_hash] = block
            self._hash[block] = block_hash
            return True
        return False

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (an engine restart loses the cache)."""
        for block_hash, block in self._cached.items():
            if self._hash[block] == block_hash:
                self._hash[block] = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Prefix-cache counters in tokens, as vllm:prefix_cache_queries / _hits count them; the
        # scheduler adds to them when a lookup is used (not when the request could not fit).
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def computed_blocks(self, request: BlockOwner) -> list[int]:
        """Registered blocks matching the request's leading hashes (its prefix-cache hit).

        At most `num_tokens - 1` tokens can hit: the last token must be computed to get logits.
        """
        if not self.enable_prefix_caching:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for index in range(limit):
            block = self.pool.lookup(request.block_hash(index))
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: BlockOwner, num_new_tokens: int,
                       new_computed: Sequence[int] = ()) -> bool:
        """Blocks for `num_new_tokens` more tokens; False (nothing changed) if too few are free."""
        total = request.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(request.blocks) - len(new_computed)
        if needed <= 0 and not new_computed:
            return True  # a decode inside its last block: most calls, nothing to do
        # Hit blocks sitting in the free queue stop being free once touched.
        reclaimed = sum(1 for block in new_computed if self.pool.is_free(block))
        if needed > self.pool.num_free - reclaimed:
            return False
        if new_computed:
            self.pool.touch(new_computed)
            request.blocks.extend(new_computed)
            request.num_registered_blocks = len(request.blocks)
        if needed > 0:
            request.blocks.extend(self.pool.allocate(needed))
        return True

    def register_full_blocks(self, request: BlockOwner) -> None:
        """Register the blocks that became full of computed tokens this step."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.blocks))
        if full <= request.num_registered_blocks:
            return  # no block filled up this step (15 steps in 16 of a decode)
        events = self.pool.events
        run: list[int] = []  # indexes of this step's consecutive newly cached blocks
        for index in range(request.num_registered_blocks, full):
            if self.pool.register(request.blocks[index], request.block_hash(index)):
                run.append(index)
            elif run and events is not None:
                self._stored(request, run, events)
                run = []
        if run and events is not None:
            self._stored(request, run, events)
        request.num_registered_blocks = max(request.num_registered_blocks, full)

    def _stored(self, request: BlockOwner, run: list[int], events: KVEventSink) -> None:
        # One BlockStored per run, its parent the block before it, as vLLM's cache_full_blocks.
        first = run[0]
        tokens: list[int] = []
        for index in run:
            tokens.extend(request.block_tokens(index, self.block_size))
        events.stored([request.block_hash(i) for i in run],
                      request.block_hash(first - 1) if first > 0 else None, tokens,
                      self.block_size)

    def free(self, request: BlockOwner) -> None:
        self.pool.release(request.blocks)
        request.blocks = []
        request.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
