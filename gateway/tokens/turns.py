"""A conversation's next turn: render, cut and walk only what is new since its last one.

A chat re-sends its whole history every turn. The block trie (blocks.py) spares encoding and
hashing it again, but not the way to the trie's node: rendering the history, cutting it at the
special tokens and hashing every piece, ~0.35-0.55 ms of a seen 16K-token history here, cold
(docs/benchmarks-proxy.md, fourteenth round), all of it on the event loop before the request
goes upstream. This remembers, per message, where the walk of a conversation stood at the end
of that message's text: a chain of keys over the messages as they came (role and content, or
the whole message where it has more), from a root of everything else the template reads (its
text, the tools, the arguments, the block size). A turn whose earlier messages were seen looks
them up, one hash of each message and one dict lookup, and the template renders from the first
new message on, which the walk follows from where the last known one left it.

That holds only where a message's text does not depend on what follows it, which the template
says (`native.Settled`: Qwen's tool results, whose turn is closed after the last of them, and
Qwen3's assistant turns after the last query, which keep their reasoning). A position is
remembered, and used, only after settled messages, so the text before it is what the whole
render would write, and the walk from it is exactly the walk of the whole (tests/test_turns.py
holds both to rendering and hashing the whole prompt).

A position is a step boundary of the block trie (after a special token) at or before the
message's end, and the text after it up to the message's end (`carry`: "\\n" after Qwen's
`<|im_end|>`, nothing after Llama's `<|eot_id|>`), which the next turn's render starts with.
A carry holding the first character of a special token is never remembered: a special token
could then begin in one message and end in the next, and the next turn's cut would differ.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.tokens.blocks import (
    ROOT,
    BlockChains,
    BlockTables,
    Learn,
    Node,
    PieceIds,
    Start,
    Walk,
    root_key,
)
from gateway.tokens.native import Settled

DEFAULT_MAX_TURNS = 200_000
DEFAULT_MAX_BLOCKS = 1_000_000


class Turn:
    """Where a walk stood after a conversation's first messages."""

    __slots__ = ("carry", "hashes", "key", "node", "parent")

    def __init__(self, key: int, node: Node, hashes: array[int], parent: Turn | None,
                 carry: str) -> None:
        self.key = key  # the block trie's key after the last step within these messages
        self.node = node  # its node
        self.hashes = hashes  # 'q': the blocks completed since the parent's position
        self.parent = parent  # the position one message earlier (None: the prompt's start)
        self.carry = carry  # these messages' text after that step

    def start(self) -> Start:
        """This position as a walk's start."""
        parts: list[array[int]] = []
        turn: Turn | None = self
        while turn is not None:
            parts.append(turn.hashes)
            turn = turn.parent
        parts.reverse()
        return self.key, self.node, parts


class Resumed:
    """A prompt's walk from a known position, with what is after it (the position's carry and
    the render of the new messages) left whole until `finish` cuts and walks it, in a worker
    where the new text is long (gateway/tokens/counter.py)."""

    __slots__ = ("_block_size", "_chains", "_learn", "_piece_ids", "_specials", "_splitter",
                 "_start", "_text", "_turn", "left_chars")

    def __init__(self, chains: BlockChains, turn: Turn, text: str, splitter: re.Pattern[str],
                 specials: dict[str, int], block_size: int, piece_ids: PieceIds,
                 learn: Learn | None) -> None:
        self._chains = chains
        self._turn = turn
        self._text = text  # the carry and the render from the first new message on
        self._splitter = splitter
        self._specials = specials
        self._block_size = block_size
        self._piece_ids = piece_ids
        self._learn = learn
        self._start: Start | None = None
        self.left_chars = len(text)  # at most: a piece of it may be known to the trie

    def _at(self) -> Start:
        if self._start is None:
            self._start = self._turn.start()
        return self._start

    def finish(self) -> tuple[int, array[int]]:
        key, node, done = self._at()
        walk: Walk = self._chains.walk(self._splitter.split(self._text), self._specials,
                                       self._block_size, self._piece_ids,
                                       (key, node, list(done)), self._learn)
        return walk.finish()


def message_key(chain: int, message: Any) -> int | None:
    """The chain's key after `message`, or None for a message that cannot be keyed.

    A message of a role and a string content, the most common by far, is keyed by the two
    strings; any other by its JSON text, which holds every field the template may read. A
    tool call's arguments were parsed by `json.loads` (gateway/tokens/templates.py), which reads
    NaN, which orjson writes as null: a message with a null in it is keyed by the standard
    library's text, which tells the two apart.
    """
    if type(message) is not dict:
        return None
    role = message.get("role")
    content = message.get("content")
    if len(message) == 2 and type(role) is str and type(content) is str:
        return hash((chain, role, content))
    try:
        text: bytes | str = orjson.dumps(message)
    except TypeError:
        return None
    if b"null" in text:
        text = json.dumps(message)
    return hash((chain, text))


def root_of(block_size: int, source: str, tools: Sequence[Any] | None,
            arguments: dict[str, Any]) -> int | None:
    """A conversation chain's first key: what the template reads besides the messages."""
    try:
        tools_text = None if tools is None else orjson.dumps(tools)
        arguments_text = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS) \
            if arguments else None
    except TypeError:
        return None
    return hash(("turns", block_size, source, tools_text, arguments_text))


class Turns(BlockTables[Turn]):
    """Chain key -> `Turn`, bounded LRU by positions and by the block hashes they hold;
    thread-safe."""

    def __init__(self, max_turns: int = DEFAULT_MAX_TURNS,
                 max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        super().__init__(max_turns, max_blocks)

    def find(self, root: int, messages: Sequence[Any], settled: Settled
             ) -> tuple[int, int, Turn | None, int]:
        """How many leading messages are known (settled, and seen in this order after the same
        root), the chain's key after them, their position (None: none are known) and how many
        leading messages are settled."""
        last_query = _last_query(messages, settled)
        if last_query is None:
            return 0, root, None, 0
        unsettled = settled.unsettled
        chain, turn, known = root, None, 0
        tables, mask = self._tables, self._mask
        with self._lock:
            # message_key and settled_count, written out: this runs on the loop for every
            # chat request, a conversation's every message.
            for m in messages:
                if type(m) is not dict:
                    break
                role = m.get("role")
                if role in unsettled or (role == "assistant" and known > last_query):
                    break
                content = m.get("content")
                if len(m) == 2 and type(role) is str and type(content) is str:
                    key = hash((chain, role, content))
                else:
                    other = message_key(chain, m)
                    if other is None:
                        break
                    key = other
                table = tables[key & mask]
                found = table.get(key)
                if found is None:
                    break
                table.move_to_end(key)
                chain, turn, known = key, found, known + 1
        return known, chain, turn, known + _settled_from(messages, known, unsettled, last_query)


def settled_count(messages: Sequence[Any], settled: Settled) -> int:
    """How many leading messages the template writes the same whatever follows them."""
    last_query = _last_query(messages, settled)
    return 0 if last_query is None else _settled_from(messages, 0, settled.unsettled,
                                                      last_query)


def _last_query(messages: Sequence[Any], settled: Settled) -> int | None:
    """The index after which an assistant turn is not settled (past the end where none is);
    None for messages outside the render's domain, where nothing is settled."""
    if settled.last_query is None:
        return len(messages)
    try:
        return settled.last_query(messages)
    except Exception:
        return None


def _settled_from(messages: Sequence[Any], start: int, unsettled: frozenset[str],
                  last_query: int) -> int:
    """How many messages from `start` on are settled."""
    for i in range(start, len(messages)):
        m = messages[i]
        role = m.get("role") if type(m) is dict else None
        if role in unsettled or (role == "assistant" and i > last_query):
            return i - start
    return len(messages) - start


class Learning:
    """What a walk that started at a conversation's `start`-th message learns at its end: the
    position after each new settled message, up to `settled` (a `blocks.Learn` callback)."""

    __slots__ = ("_chain", "_ends", "_firsts", "_messages", "_origin", "_parent", "_parts",
                 "_settled", "_start", "_turns")

    def __init__(self, turns: Turns, messages: Sequence[Any], start: int, settled: int,
                 chain: int, parent: Turn | None, parts: list[str], ends: list[int],
                 firsts: frozenset[str], block_size: int) -> None:
        self._turns = turns
        # The walk's start: the parent's position, or the prompt's.
        self._origin = (parent.key, parent.node) if parent is not None \
            else (root_key(block_size), ROOT)
        self._messages = messages
        self._settled = settled
        self._start = start
        self._chain = chain
        self._parent = parent
        self._parts = parts  # the render from message `start` on
        self._ends = ends  # after each message from `start`, the parts written so far
        self._firsts = firsts  # the first characters of the special tokens

    def __call__(self, pieces: list[str], steps: list[tuple[int, Node]]) -> None:
        parent = self._parent
        # The walk's text is the parent's carry, then the render; offsets count from its start.
        at = len(parent.carry) if parent is not None else 0
        chain = self._chain
        parts, done = self._parts, 0
        step, step_end = -1, 0  # the last step at or before a message's end, and its end
        key, node = self._origin
        for i in range(self._start, self._settled):
            end = self._ends[i - self._start]
            at += sum(map(len, parts[done:end]))
            done = end
            hashes = array("q")
            while step + 1 < len(steps):
                nxt = step_end + len(pieces[2 * step + 2]) + len(pieces[2 * step + 3])
                if nxt > at:
                    break
                step, step_end = step + 1, nxt
                key, node = steps[step]
                hashes.extend(node.hashes)
            carry = pieces[2 * step + 2][:at - step_end]
            if len(carry) != at - step_end or not self._firsts.isdisjoint(carry):
                return  # a special token may begin in this message and end in the next
            chain_key = message_key(chain, self._messages[i])
            if chain_key is None:
                return
            parent = Turn(key, node, hashes, parent, carry)
            self._turns._put(chain_key, parent)
            chain = chain_key


def first_characters(specials: Sequence[str]) -> frozenset[str]:
    return frozenset(s[0] for s in specials if s)


__all__ = [
    "Learning",
    "Resumed",
    "Turn",
    "Turns",
    "first_characters",
    "message_key",
    "root_of",
]
