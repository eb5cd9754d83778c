"""Which prompt blocks each backend holds, by the gateway's block hash (gateway/prefix/hashing.py).

One `PrefixIndex` per backend, kept in one of two ways (`IndexMode`):
- approximate: the gateway stores the blocks of every prompt it sends the backend and ages them
  out, least recently used first, at a capacity in blocks that models the backend's KV cache.
  A prompt's blocks are stored last block first, so its first block is the most recently used
  and an eviction takes a sequence's tail before its shared prefix, as vLLM frees a request's
  blocks tail first;
- precise: the engine's own KV cache events store and remove blocks (gateway/prefix/events.py).
  Events carry the engine's hashes; the subscriber re-hashes their token ids with the gateway's
  function and stores both, so a later BlockRemoved (engine hashes only) finds its blocks
  (`remove_engine`) and a BlockStored's parent (`gateway_hash`) continues the chain. Events
  that claim more blocks than the capacity are clamped to it, oldest out (`clamped` counts them).
When the events fail (garbage, silence, a gap the replay cannot fill) a backend falls back to
approximate (`FELL_BACK`) until they recover.

`PrefixIndexes` holds every backend's index by (pool, backend) and forgets one (clears it)
when its backend is ejected, fails its probe or restarts: its engine's cache is gone or unknown.
Everything here runs on the event loop and is O(blocks of the request).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence


class IndexMode(enum.Enum):
    APPROXIMATE = "approximate"
    PRECISE = "precise"
    FELL_BACK = "fell_back"  # precise wanted, events failing: kept as approximate meanwhile


# Blocks in one LRU table. A table is an OrderedDict, and a dict rehashes itself whole when it
# grows and, at a steady size, every so many inserts and evictions, the event loop held all
# along: measured here (benchmarks/index_churn.py, in git history: 64 blocks stored, 64
# evicted, a step) the
# worst step of one table is 6.2 ms at 30,000 blocks, 28 ms at 120,000 and 298 ms at 1,000,000.
# A backend's index (its KV capacity: millions of blocks with KV offload) is cut into tables of
# at most this many, by hash, each aged out on its own: least recently used within its table,
# which for hashes spread evenly is the LRU of the whole to within a table's share. Worst step
# then: 1.7, 2.6 and 5.9 ms (tables fill at one rate, so several rehash in one step).
SHARD_BLOCKS = 8_192
# A capacity that is not known reads as a very large one (admission's UNKNOWN_CAPACITY_BLOCKS):
# past this many tables each may grow beyond SHARD_BLOCKS, which a real index rarely reaches.
MAX_TABLES = 256


def table_count(size: int, per_table: int) -> int:
    """How many LRU tables keep `size` entries at most `per_table` each: a power of two (a
    hash's low bits pick its table), at most MAX_TABLES. The block trie and the piece cache
    (gateway/tokens) are cut by the same rule."""
    n = 1
    while n * per_table < size and n < MAX_TABLES:
        n *= 2
    return n


class PrefixIndex:
    """A backend's cached blocks: gateway hash -> the engine's hash (None in approximate mode),
    in least-recently-used order (oldest first) within each of its tables."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self._tables: list[OrderedDict[int, int | None]] = []
        self._mask = 0
        self._table_cap = 1
        self._shape(self.capacity_blocks)
        self._by_engine: dict[int, int] = {}  # engine hash -> gateway hash (precise mode)
        # gateway hash -> requests in flight holding it (kept apart from the cache: a block in
        # use is never evicted, and a forget leaves the requests' own bookkeeping alone)
        self._held: dict[int, int] = {}
        # Times forgotten (`clear`): what a request placed before a forget would teach it (its
        # blocks, learnt once it is on its way, gateway/admission/prefixes.py) is not learnt.
        self.forgets = 0
        self.clamped = 0  # blocks dropped because more were stored than the capacity
        self.evicted = 0  # blocks aged out (either mode)

    def _shape(self, capacity: int) -> None:
        """Tables enough that none holds more than SHARD_BLOCKS (a power of two of them, at most
        MAX_TABLES). A new
        count re-deals the blocks (once: engines' capacities do not move), merged by their
        place in their table's order, so the oldest still go first."""
        n = table_count(capacity, SHARD_BLOCKS)
        self._table_cap = -(-capacity // n)
        if n == len(self._tables):
            return
        old = sorted(((i / len(t), h, e) for t in self._tables for i, (h, e) in
                      enumerate(t.items())), key=lambda x: x[0])
        self._tables = [OrderedDict() for _ in range(n)]
        self._mask = n - 1
        for _, h, e in old:
            self._tables[h & self._mask][h] = e

    def __len__(self) -> int:
        return sum(map(len, self._tables))

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, int) and block_hash in self._tables[block_hash & self._mask]

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are held (the cached prefix, in blocks).
        Pure: a match does not refresh the blocks (a preview must change nothing)."""
        return _leading(self._tables, self._mask, hashes)

    def acquire(self, hashes: Sequence[int]) -> None:
        """A request in flight holds these blocks at the engine (they are shared, not free)."""
        held = self._held
        for h in hashes:
            held[h] = held.get(h, 0) + 1

    def release(self, hashes: Sequence[int]) -> None:
        held = self._held
        for h in hashes:
            n = held.get(h, 0) - 1
            if n > 0:
                held[h] = n
            else:
                held.pop(h, None)

    def held(self, hashes: Sequence[int], own: int = 0) -> int:
        """How many leading blocks of `hashes` requests in flight hold now; with `own`, other
        requests than one that holds the first `own` of them itself."""
        if not own:
            return _leading((self._held,), 0, hashes)
        # Each request holds a prompt's leading blocks, so what others hold is a prefix too:
        # of the request's own, those held twice; past them, those held at all.
        shared = _leading((_Twice(self._held),), 0, hashes[:own])
        if shared < own:
            return shared
        return own + _leading((self._held,), 0, hashes[own:])

    def store(self, hashes: Sequence[int], engine_hashes: Sequence[int] | None = None) -> int:
        """Hold `hashes` (a prompt's blocks in order, or an event's), most recent first block;
        returns how many blocks had to go to stay within the capacity."""
        tables, mask = self._tables, self._mask
        if engine_hashes is None:
            # Only a table that grew can be over its share (each is within it after every
            # store and resize): a history stored again, the common turn, shrinks nothing, and
            # its blocks are not walked a second time for their tables (~50 us a 16K-token
            # prompt here, at every request's hold).
            grew: set[int] = set()
            for h in reversed(hashes):
                table = tables[h & mask]
                if h in table:
                    table.move_to_end(h)
                else:
                    table[h] = None
                    grew.add(h & mask)
            return self._shrink(grew, clamp=False) if grew else 0
        by_engine = self._by_engine
        for h, e in zip(reversed(hashes), reversed(engine_hashes), strict=True):
            table = tables[h & mask]
            old = table.get(h)
            if old is not None and old != e and by_engine.get(old) == h:
                del by_engine[old]
            table[h] = e
            table.move_to_end(h)
            by_engine[e] = h
        return self._shrink({h & mask for h in hashes} if mask else (0,), clamp=True)

    def touch(self, hashes: Sequence[int]) -> None:
        """Refresh held blocks (an engine event said they were used again)."""
        tables, mask = self._tables, self._mask
        for h in reversed(hashes):
            table = tables[h & mask]
            if h in table:
                table.move_to_end(h)

    def remove(self, hashes: Iterable[int]) -> None:
        tables, mask = self._tables, self._mask
        for h in hashes:
            e = tables[h & mask].pop(h, None)
            if e is not None and self._by_engine.get(e) == h:
                del self._by_engine[e]

    def remove_engine(self, engine_hashes: Iterable[int]) -> int:
        """Remove blocks named by the engine's hashes (BlockRemoved); returns how many were held."""
        tables, mask = self._tables, self._mask
        n = 0
        for e in engine_hashes:
            h = self._by_engine.pop(e, None)
            if h is not None and tables[h & mask].get(h) == e:
                del tables[h & mask][h]
                n += 1
        return n

    def gateway_hash(self, engine_hash: int) -> int | None:
        """The gateway's hash of a block the engine named (None: not held, or never seen)."""
        return self._by_engine.get(engine_hash)

    def clear(self) -> None:
        self.forgets += 1
        for table in self._tables:
            table.clear()
        self._by_engine.clear()

    def resize(self, capacity_blocks: int) -> None:
        if max(1, capacity_blocks) == self.capacity_blocks:
            return  # every engine scrape says it again
        self.capacity_blocks = max(1, capacity_blocks)
        self._shape(self.capacity_blocks)
        self._shrink(range(len(self._tables)), clamp=False)

    def _shrink(self, which: Iterable[int], clamp: bool) -> int:
        by_engine, cap = self._by_engine, self._table_cap
        dropped = 0
        for i in which:
            table = self._tables[i]
            over = len(table) - cap
            for _ in range(max(0, over)):
                _, e = table.popitem(last=False)
                if e is not None:
                    by_engine.pop(e, None)
            dropped += max(0, over)
        if clamp:
            self.clamped += dropped
        else:
            self.evicted += dropped
        return dropped


class _Twice:
    """Blocks more than one request holds."""

    __slots__ = ("_held",)

    def __init__(self, held: dict[int, int]) -> None:
        self._held = held

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, int) and self._held.get(block_hash, 0) > 1


def _leading(tables: Sequence[Container[int]], mask: int, hashes: Sequence[int]) -> int:
    """The number of leading `hashes` held (in `tables[hash & mask]`), assuming the held ones
    form a prefix: probes at 1, 2, 4, ... blocks, then bisects the last gap, O(log n) lookups.
    Chained hashes make a held block's ancestors held too in both modes (a prompt is stored
    first block last, and engines evict a sequence's tail first), so this is the linear count
    in practice; where an ancestor did go first, the count is what the engine would report as
    far as that block. The table is picked inline, not through `PrefixIndex.__contains__`: a
    method call per probe made a 16K-token prompt's match 6.2-6.5 us against 4.3-4.4, and
    placement matches once per backend."""
    n = len(hashes)
    if n == 0 or hashes[0] not in tables[hashes[0] & mask]:
        return 0
    lo, step = 1, 1  # hashes[:lo] are held
    while lo < n:
        probe = min(n, lo + step)
        h = hashes[probe - 1]
        if h not in tables[h & mask]:
            hi = probe - 1  # hashes[hi] is not held
            while lo < hi:
                mid = (lo + hi) // 2
                h = hashes[mid]
                if h in tables[h & mask]:
                    lo = mid + 1
                else:
                    hi = mid
            return lo
        lo = probe
        step *= 2
    return n


class PrefixIndexes:
    """Every backend's index, by (pool, backend name), and the mode each is kept in."""

    def __init__(self) -> None:
        self._indexes: dict[tuple[str, str], PrefixIndex] = {}
        self._modes: dict[tuple[str, str], IndexMode] = {}

    def configure(self, pool: str, backend: str, capacity_blocks: int,
                  mode: IndexMode = IndexMode.APPROXIMATE) -> PrefixIndex:
        """The backend's index (made on first use, resized after), in `mode`."""
        key = (pool, backend)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = PrefixIndex(capacity_blocks)
        elif index.capacity_blocks != capacity_blocks:
            index.resize(capacity_blocks)
        self._modes[key] = mode
        return index

    def get(self, pool: str, backend: str) -> PrefixIndex | None:
        return self._indexes.get((pool, backend))

    def mode(self, pool: str, backend: str) -> IndexMode | None:
        return self._modes.get((pool, backend))

    def set_mode(self, pool: str, backend: str, mode: IndexMode) -> None:
        """Precise <-> fell back, as the backend's event stream fails and recovers. Falling back
        keeps what the events said (still the best guess) and learns from traffic on top."""
        if (pool, backend) in self._indexes:
            self._modes[(pool, backend)] = mode

    def learns_from_traffic(self, pool: str, backend: str) -> bool:
        """Whether the router should store what it sends this backend (not in precise mode,
        where the engine's events say what it really kept)."""
        return self._modes.get((pool, backend)) is not IndexMode.PRECISE

    def forget(self, pool: str, backend: str) -> None:
        """The backend restarted, was ejected or went down: what it held is gone or unknown."""
        index = self._indexes.get((pool, backend))
        if index is not None:
            index.clear()

    def retain(self, keys: Iterable[tuple[str, str]]) -> None:
        """Drop the indexes of backends no longer in the policy (after a reload)."""
        keep = set(keys)
        for key in [k for k in self._indexes if k not in keep]:
            del self._indexes[key]
            self._modes.pop(key, None)

    def items(self) -> Iterable[tuple[tuple[str, str], PrefixIndex]]:
        return self._indexes.items()
