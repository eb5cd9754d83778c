"""The tokenizer's piece cache: rendered-text piece -> its token count or ids (tokenizer.py).

Chat requests repeat themselves (system prompts, few-shot blocks, the whole history on every
turn); the rendered text is cut at the special tokens between messages and each piece's count,
or its ids where prefix routing needs them, is kept here.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

from gateway.prefix.index import table_count

# Characters in one LRU table at most. One OrderedDict of every piece would rehash whole on the
# event loop (a conversation's short turns: a million entries of 30 characters, ~300 ms; see
# gateway/prefix/index.py); cut by hash, each table aged out on its own, a table of short pieces
# holds some 30,000. A piece longer than a table's share (1M characters, ~250K tokens) is not
# kept: encoded each time.
TABLE_CHARS = 1_048_576


class PieceCache:
    """Bounded LRU of rendered-text piece -> token count, or its token ids, safe across worker
    threads.

    Keyed by the piece's hash and length, not the text, so a 64 KB history is not kept alive
    twice. Python's str hash is SipHash with a per-process random key: collisions among a few
    thousand entries are ~1e-12 likely and cannot be forced by a client who does not know the key.
    A piece's ids (kept where prefix routing needs them) are an `array('I')`: 4 bytes a token,
    ~1 byte a character of text, a quarter of what a list of ints would hold.
    """

    def __init__(self, max_chars: int) -> None:
        n = table_count(max_chars, TABLE_CHARS)
        self._mask = n - 1
        self._max_chars = -(-max_chars // n)  # a table's share
        self._chars = [0] * n
        self._tables: list[OrderedDict[tuple[int, int], int | array[int]]] = [
            OrderedDict() for _ in range(n)]
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, piece: str) -> int | None:
        key = (hash(piece), len(piece))
        table = self._tables[key[0] & self._mask]
        with self._lock:
            found = table.get(key)
            if found is None:
                self.misses += 1
                return None
            table.move_to_end(key)
            self.hits += 1
            return found if isinstance(found, int) else len(found)

    def get_ids(self, piece: str) -> array[int] | None:
        """The piece's ids, when they were kept (a count alone is a miss here)."""
        key = (hash(piece), len(piece))
        table = self._tables[key[0] & self._mask]
        with self._lock:
            found = table.get(key)
            if found is None or isinstance(found, int):
                self.misses += 1
                return None
            table.move_to_end(key)
            self.hits += 1
            return found

    def put(self, piece: str, count: int | array[int]) -> None:
        key = (hash(piece), len(piece))
        if len(piece) > self._max_chars:
            return
        t = key[0] & self._mask
        table = self._tables[t]
        with self._lock:
            if key not in table:
                self._chars[t] += len(piece)
            table[key] = count
            table.move_to_end(key)
            while self._chars[t] > self._max_chars:
                (_, length), _ = table.popitem(last=False)
                self._chars[t] -= length

    def clear(self) -> None:
        with self._lock:
            for table in self._tables:
                table.clear()
            self._chars = [0] * len(self._tables)
