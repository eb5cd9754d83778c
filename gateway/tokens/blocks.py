"""A prompt's token count and block hashes through a trie of its rendered pieces.

A conversation re-sends its whole history every turn. The piece cache (gateway/tokens/tokenizer.py)
spares re-encoding it, but hashing its ids again for prefix routing costs ~20 ns a token: 0.35 ms
of a 16K-token history every turn, for blocks whose hashes were known the turn before. The
rendered prompt is cut at the template's special tokens into pieces; a node here is the state
after one step of a piece sequence (a text piece and the special token after it), keyed by its
parent's key and the step: the tokens so far, the hashes of the blocks that step completed, and
the ids left in the block it leaves open. A turn whose earlier pieces were seen walks their
nodes (one str hash and one dict lookup a step) and encodes and hashes only what is new. The
result is exactly `block_hashes` of the whole prompt's ids (tests/test_block_chains.py holds it
to that).

`Walk` splits the work where it is cheapest: the walk over known pieces is Python and short, so
the counter runs it on the event loop; what is left (encoding new pieces, hashing their blocks)
runs inline when it is small and in a worker thread when it is not (gateway/tokens/counter.py).

A walk may start part-way, at a position a conversation's earlier messages reached
(gateway/tokens/turns.py), so a seen history is neither rendered nor walked again; the steps a
walk takes are then handed to a `Learn` callback, which remembers the new messages' positions.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from gateway.prefix.hashing import ROOT_HASH, block_hashes
from gateway.prefix.index import table_count

# What the trie keeps: nodes and the block hashes in them (8 bytes each, so 1M blocks are 8 MB,
# 16M tokens of history at 16 tokens a block).
DEFAULT_MAX_NODES = 200_000
DEFAULT_MAX_BLOCKS = 1_000_000
SHARD_BLOCKS = 8_192  # nodes in one LRU table at most

PieceIds = Callable[[list[str]], list["array[int]"]]  # text pieces -> their ids, in order


@dataclass(frozen=True, slots=True)
class Node:
    tokens: int  # ids in the prompt up to the end of this piece
    hashes: array[int]  # 'q': the hashes of the blocks completed within this piece
    tail: array[int]  # 'I': the ids after the last full block
    last: int  # the hash of the last full block so far (ROOT_HASH before the first)


ROOT = Node(0, array("q"), array("I"), ROOT_HASH)

# Where a walk starts: the key and node of the step before its first piece, and the hashes of
# the blocks completed up to there (in parts, in order; a list of the walk's own, extended).
Start = tuple[int, Node, list["array[int]"]]
# After a walk's last step: its pieces and, for each step with a special token after its text,
# that step's key and node (the steps a later walk may start after).
Learn = Callable[[list[str], list[tuple[int, Node]]], None]


class PromptWalk(Protocol):
    """What the counter reads of a prompt's walk (`Walk`, or turns.py's `Resumed`)."""

    left_chars: int  # characters that may still need encoding

    def finish(self) -> tuple[int, array[int]]: ...


def root_key(block_size: int) -> int:
    """The key before a prompt's first step."""
    return hash(("blocks", block_size))


class HoldsBlocks(Protocol):
    @property
    def hashes(self) -> array[int]: ...


V = TypeVar("V", bound=HoldsBlocks)


class BlockTables(Generic[V]):
    """Key -> value, bounded LRU by entries and by the block hashes the values hold;
    thread-safe. Cut into tables of at most SHARD_BLOCKS entries by key, each aged out on its
    own, for the reason the prefix index is (gateway/prefix/index.py: a whole-table rehash
    holds the loop, ~45 ms at 200,000 entries here). The block trie's nodes and the turns
    memo's positions (turns.py) are kept so."""

    def __init__(self, max_entries: int, max_blocks: int) -> None:
        n = table_count(max_entries, SHARD_BLOCKS)
        self._mask = n - 1
        self._max_entries = -(-max_entries // n)  # a table's share
        self._max_blocks = -(-max_blocks // n)
        self._tables: list[OrderedDict[int, V]] = [OrderedDict() for _ in range(n)]
        self._blocks = [0] * n  # block hashes held, per table
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(map(len, self._tables))

    def _put(self, key: int, value: V) -> None:
        t = key & self._mask
        table = self._tables[t]
        with self._lock:
            old = table.get(key)
            if old is not None:
                self._blocks[t] -= len(old.hashes)
            table[key] = value
            table.move_to_end(key)
            self._blocks[t] += len(value.hashes)
            while len(table) > self._max_entries or self._blocks[t] > self._max_blocks:
                _, evicted = table.popitem(last=False)
                self._blocks[t] -= len(evicted.hashes)

    def clear(self) -> None:
        with self._lock:
            for table in self._tables:
                table.clear()
            self._blocks = [0] * len(self._tables)


class BlockChains(BlockTables[Node]):
    """The trie (see the module's docstring)."""

    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES,
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        super().__init__(max_nodes, max_blocks)

    def walk(self, pieces: list[str], specials: dict[str, int], block_size: int,
             piece_ids: PieceIds, start: Start | None = None, learn: Learn | None = None
             ) -> Walk:
        """Follow the known nodes from the prompt's start, or from `start` where the pieces
        are what follows it; the rest is left to `Walk.finish`.

        `pieces` alternate text and special-token content, text first and last (the splitter's
        output); `piece_ids` gives the ids of text pieces the trie does not know. A step is one
        text piece and the special token after it (None after the last): half the steps of one
        a piece, and a walk stops at the same text piece either way, since a turn's new text
        is what differs, not the template's token after it.
        """
        done: list[array[int]]
        if start is None:
            key, node, done = root_key(block_size), ROOT, []
        else:
            key, node, done = start
        steps: list[tuple[int, Node]] | None = [] if learn is not None else None
        at = 0
        tables, mask = self._tables, self._mask
        with self._lock:
            for text, special in zip(pieces[::2], [*pieces[1::2], None], strict=True):
                step = hash((key, text, len(text), special))
                table = tables[step & mask]
                found = table.get(step)
                if found is None:
                    break
                table.move_to_end(step)
                done.append(found.hashes)
                key, node = step, found
                at += 2
                if steps is not None and special is not None:
                    steps.append((step, found))
        return Walk(self, pieces, specials, block_size, piece_ids, at, key, node, done,
                    learn, steps)


class Walk:
    """A prompt's walk: the known part done, `left_chars` of text still to encode."""

    __slots__ = (
        "_at",
        "_block_size",
        "_chains",
        "_done",
        "_key",
        "_learn",
        "_node",
        "_piece_ids",
        "_pieces",
        "_specials",
        "_steps",
        "left_chars",
    )

    def __init__(self, chains: BlockChains, pieces: list[str], specials: dict[str, int],
                 block_size: int, piece_ids: PieceIds, at: int, key: int, node: Node,
                 done: list[array[int]], learn: Learn | None = None,
                 steps: list[tuple[int, Node]] | None = None) -> None:
        self._chains = chains
        self._pieces = pieces
        self._specials = specials
        self._block_size = block_size
        self._piece_ids = piece_ids
        self._at = at
        self._key = key
        self._node = node
        self._done = done
        self._learn = learn
        self._steps = steps
        self.left_chars = sum(map(len, pieces[at::2]))

    def finish(self) -> tuple[int, array[int]]:
        """The prompt's token count and every full block's hash, learning the new steps."""
        pieces, at, bs, specials = self._pieces, self._at, self._block_size, self._specials
        key, node = self._key, self._node
        out = array("q")
        for part in self._done:
            out.extend(part)
        texts = pieces[at::2]
        if not texts:  # every step was walked
            self._learned()
            return node.tokens, out
        encoded = self._piece_ids(texts)
        # The last text piece has no special token after it.
        after: list[str | None] = [*pieces[at + 1::2], None]
        tokens, last = node.tokens, node.last
        buf = array("I", node.tail)
        for text, ids, special in zip(texts, encoded, after, strict=True):
            buf.extend(ids)
            tokens += len(ids)
            if special is not None:
                buf.append(specials[special])
                tokens += 1
            made = array("q", block_hashes(buf, bs, last))
            if made:
                last = made[-1]
                del buf[:len(made) * bs]
            out.extend(made)
            key = hash((key, text, len(text), special))
            node = Node(tokens, made, array("I", buf), last)
            self._chains._put(key, node)
            if self._steps is not None and special is not None:
                self._steps.append((key, node))
        self._learned()
        return tokens, out

    def _learned(self) -> None:
        learn, steps = self._learn, self._steps
        if learn is not None and steps is not None:
            self._learn = None  # once: a second finish would hand the steps over twice
            learn(self._pieces, steps)
