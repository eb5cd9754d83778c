"""The tokenizer's piece cache: rendered-text piece -> its token count or ids (tokenizer.py).

Chat requests repeat themselves (system prompts, few-shot blocks, the whole history on every
turn); the rendered text is cut at the special tokens between messages and each piece's count,
or its ids where prefix routing needs them, is kept here.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict


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
        self._max_chars = max_chars
        self._chars = 0
        self._entries: OrderedDict[tuple[int, int], int | array[int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, piece: str) -> int | None:
        key = (hash(piece), len(piece))
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found if isinstance(found, int) else len(found)

    def get_ids(self, piece: str) -> array[int] | None:
        """The piece's ids, when they were kept (a count alone is a miss here)."""
        key = (hash(piece), len(piece))
        with self._lock:
            found = self._entries.get(key)
            if found is None or isinstance(found, int):
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, piece: str, count: int | array[int]) -> None:
        key = (hash(piece), len(piece))
        if len(piece) > self._max_chars:
            return
        with self._lock:
            if key not in self._entries:
                self._chars += len(piece)
            self._entries[key] = count
            self._entries.move_to_end(key)
            while self._chars > self._max_chars:
                (_, length), _ = self._entries.popitem(last=False)
                self._chars -= length

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._chars = 0
