"""Precise mode: follow an engine's own KV cache events into its backend's `PrefixIndex`.

The wire format is vLLM's (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`, read there and
in `examples/online_serving/kv_events_subscriber.py`; SGLang publishes the same):
- a PUB socket sends three frames per batch: topic, the batch's sequence number (8 bytes,
  big-endian, counting from 0 when the engine starts), and the batch, msgpack-encoded by
  msgspec: `[ts, [event, ...], data_parallel_rank]` (`EventBatch`, array-like);
- each event is a tagged struct: `BlockStored` (the engine's hashes of newly cached full
  blocks, the hash of the block before them or None, their token ids, block size, LoRA,
  medium, extra keys), `BlockRemoved` (hashes), `AllBlocksCleared`. Up to vLLM 0.2x they are
  tagged arrays (`["BlockStored", hashes, ...]`); vllm-project/vllm#42892 made them tagged maps
  (`{"type": "BlockStored", "block_hashes": ...}`). Both are decoded; fields added later have
  defaults, unknown ones are ignored. A hash is an int or (sha256 hashing) bytes;
- a ROUTER replay socket: a DEALER sends `["", start seq (8 bytes)]` and gets back
  `["", seq, batch]` for every buffered batch from there, then `["", -1 (signed), ""]`.
  (vLLM's example uses REQ, which can take only the first of those replies.)

The engine's hashes cannot be reproduced by the gateway (seeded sha256 or pickled tuples), so
each stored block is re-hashed from its token ids with the gateway's chained hash
(gateway/prefix/hashing.py), continuing the chain from the parent's gateway hash, and the index
keeps engine hash -> gateway hash for removals. An engine whose blocks are a multiple of the
pool's `block_size` (a CPU vLLM's 128 under the default 16) is followed in the pool's blocks,
the last of each engine block standing for it (gateway/signals/blocks.py says why). A block
whose parent the gateway never saw (published before it subscribed) cannot be chained and is
skipped: it would never be matched anyway, as a match needs every leading block.

Faults never reach a request: an undecodable batch, an unfilled gap in the sequence, a stream
that stays silent while the engine has work from us, or a lost connection switches the
backend to `FELL_BACK` (the index is kept, and the router learns from traffic on top), counted
by reason and logged once per backend and reason. It recovers by itself to `PRECISE` once
batches decode in order again for `recover_s`. A restarted engine (sequence back below ours)
or `AllBlocksCleared` empties the index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.prefix.hashing import ROOT_HASH, block_hashes
from gateway.prefix.index import IndexMode, PrefixIndex, PrefixIndexes

log = logging.getLogger("gateway.prefix.events")

Clock = Callable[[], float]
EngineHash = int | bytes  # vLLM's ExternalBlockHash

END_SEQ = -1  # the replay's end marker, a signed 8-byte -1
FAULTS = ("garbage", "gap", "stopped", "disconnected", "block_size")
_GPU_MEDIA = (None, "GPU")  # vLLM's MEDIUM_GPU; blocks offloaded to CPU or disk are not served
                            # at GPU speed and are not the engine's prefix cache


# --- the wire format: tagged arrays (vLLM < #42892) -------------------------------------------


class _StoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _RemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _BatchOfArrays(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: int | None = None


# --- the wire format: tagged maps (vLLM >= #42892; the batch itself stays an array) --------


class _StoredMap(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _BatchOfMaps(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    data_parallel_rank: int | None = None


_STORED = (_StoredMap, _StoredArray)
_REMOVED = (_RemovedMap, _RemovedArray)
# msgspec cannot put array-like and map structs in one union: one decoder each, the current
# format first.
_DECODERS = (msgspec.msgpack.Decoder(_BatchOfMaps), msgspec.msgpack.Decoder(_BatchOfArrays))


class BadBatch(ValueError):
    """A payload that is not a KV event batch in either of vLLM's encodings."""


def decode_batch(payload: bytes) -> list[Any]:
    """The events of one batch, in order (raises `BadBatch`)."""
    error: Exception | None = None
    for decoder in _DECODERS:
        try:
            return decoder.decode(payload).events
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            error = exc
    raise BadBatch(str(error))


def _key(h: EngineHash) -> int:
    # sha256 hashes arrive as 32 bytes; the index is keyed by ints.
    return h if isinstance(h, int) else int.from_bytes(h, "big")


# --- following the events ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where a backend's engine publishes (the policy's `kv_events` on the backend)."""

    endpoint: str                       # its PUB socket, e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # its ROUTER socket, e.g. tcp://10.0.0.5:5558
    topic: str = ""                     # vLLM's default; its example uses "kv-events"


class EventState:
    """What the metrics and the admin API show of one backend's subscription."""

    __slots__ = ("batches", "blocks_removed", "blocks_stored", "connected", "fallbacks",
                 "gaps_lost", "gaps_recovered", "last_seq", "orphans", "precise", "skipped")

    def __init__(self) -> None:
        self.connected = False
        self.precise = True
        self.last_seq = -1
        self.batches = 0
        self.blocks_stored = 0
        self.blocks_removed = 0
        self.orphans = 0        # stored blocks whose parent the gateway never saw
        self.skipped = 0        # events for blocks the gateway does not hash (LoRA, media, ...)
        self.gaps_recovered = 0
        self.gaps_lost = 0
        self.fallbacks = dict.fromkeys(FAULTS, 0)


class Follower:
    """One backend's event stream applied to its index: sequence, gaps, faults, recovery.

    No sockets here, and time comes from `clock`, so tests drive it batch by batch.
    """

    def __init__(self, pool: str, backend: str, indexes: PrefixIndexes, block_size: int,
                 clock: Clock = time.monotonic, recover_s: float = 5.0,
                 on_change: Callable[[Follower], None] | None = None) -> None:
        self.pool = pool
        self.backend = backend
        self.indexes = indexes
        self.block_size = block_size
        self.clock = clock
        self.recover_s = recover_s
        self.on_change = on_change
        self.state = EventState()
        self._refs: dict[int, int] = {}  # engine hash -> copies the engine holds (no dedup)
        self._last_fault = -float("inf")
        self._since_fault = 0  # batches applied in order since the last fault
        self._logged: set[str] = set()

    @property
    def index(self) -> PrefixIndex | None:
        return self.indexes.get(self.pool, self.backend)

    # -- the stream ---------------------------------------------------------------------------
    def expected(self) -> int:
        """The next sequence number wanted."""
        return self.state.last_seq + 1

    def receive(self, seq: int, payload: bytes) -> None:
        """A batch in stream order; the caller has filled any gap first (or given up on it)."""
        state = self.state
        if seq < state.last_seq:
            # The sequence started again: the engine restarted, and its cache with it.
            log.info("kv events %s/%s: engine restarted (sequence %d after %d); index cleared",
                     self.pool, self.backend, seq, state.last_seq)
            self._clear()
        elif seq <= state.last_seq:
            return  # a duplicate (replayed and also received live)
        state.last_seq = seq
        try:
            events = decode_batch(payload)
        except BadBatch as exc:
            self.fault("garbage", f"sequence {seq}: {exc}")
            return
        self._apply(events)
        state.batches += 1
        self._since_fault += 1
        self._maybe_recover()
        self._changed()

    def gap(self, first: int, upto: int, recovered: bool) -> None:
        """Batches first..upto-1 were missed; `recovered`: the replay delivered them all."""
        if recovered:
            self.state.gaps_recovered += 1
            self._changed()
            return
        self.state.gaps_lost += 1
        self.fault("gap", f"batches {first}..{upto - 1} lost (replay could not fill them)")

    def fault(self, reason: str, detail: str) -> None:
        state = self.state
        self._last_fault = self.clock()
        self._since_fault = 0
        if state.precise:
            state.precise = False
            state.fallbacks[reason] += 1
            self.indexes.set_mode(self.pool, self.backend, IndexMode.FELL_BACK)
            key = reason
            if key not in self._logged:  # once per backend and reason: a flapping stream
                self._logged.add(key)     # must not flood the log
                log.warning("kv events %s/%s: %s (%s); approximate routing until the events "
                            "recover", self.pool, self.backend, reason, detail)
        self._changed()

    def set_connected(self, connected: bool) -> None:
        if connected == self.state.connected:
            return
        self.state.connected = connected
        if not connected:
            self.fault("disconnected", "the publisher's socket closed")
        self._changed()

    def tick(self) -> None:
        """Periodic: recovery needs time to pass even when no batch comes."""
        self._maybe_recover()

    # -- applying -----------------------------------------------------------------------------
    def _apply(self, events: Sequence[Any]) -> None:
        index = self.index
        if index is None:
            return
        state = self.state
        refs = self._refs
        for event in events:
            if isinstance(event, _STORED):
                self._store(index, event)
            elif isinstance(event, _REMOVED):
                if event.medium not in _GPU_MEDIA or event.group_idx not in (None, 0):
                    continue
                gone: list[int] = []
                for h in event.block_hashes:
                    e = _key(h)
                    count = refs.get(e, 0) - 1
                    if count > 0:
                        refs[e] = count
                    elif count == 0:
                        del refs[e]
                        gone.append(e)
                state.blocks_removed += index.remove_engine(gone)
            else:  # AllBlocksCleared
                self._clear()
        if len(refs) > 4 * index.capacity_blocks:
            # Blocks the index clamped away stay counted here until the engine removes them;
            # a publisher claiming far more than its capacity must not grow this for ever.
            self._refs = {e: c for e, c in refs.items() if index.gateway_hash(e) is not None}

    def _store(self, index: PrefixIndex, event: Any) -> None:
        state = self.state
        if event.block_size % self.block_size:
            self.fault("block_size", f"the engine's blocks are {event.block_size} tokens, "
                       f"which the pool's block_size {self.block_size} does not divide")
            return
        if (event.medium not in _GPU_MEDIA or event.group_idx not in (None, 0)
                or event.lora_id is not None or event.lora_name is not None
                or (event.extra_keys and any(k is not None for k in event.extra_keys))):
            # The engine's hash covers what ours does not (an adapter, images, a cache salt):
            # its blocks and their children are left out.
            state.skipped += len(event.block_hashes)
            return
        engine = [_key(h) for h in event.block_hashes]
        if len(event.token_ids) != len(engine) * event.block_size:
            self.fault("garbage", f"BlockStored with {len(engine)} blocks and "
                       f"{len(event.token_ids)} token ids")
            return
        if event.parent_block_hash is None:
            seed = ROOT_HASH
        else:
            parent = index.gateway_hash(_key(event.parent_block_hash))
            if parent is None:
                state.orphans += len(engine)
                return
            seed = parent
        ours = block_hashes(event.token_ids, self.block_size, seed)
        refs = self._refs
        for e in engine:
            refs[e] = refs.get(e, 0) + 1
        ratio = event.block_size // self.block_size
        if ratio > 1:
            # The engine's block is `ratio` of the pool's: each is learnt, and the last of
            # them stands for the engine's block (its chain's end is the next block's parent).
            # Removing that one ends any match inside the engine's block, which predictions
            # round down to it; the ones before wait for the index's LRU.
            index.store(ours)
            ours = ours[ratio - 1::ratio]
        index.store(ours, engine)
        state.blocks_stored += len(engine)

    def _clear(self) -> None:
        self._refs.clear()
        index = self.index
        if index is not None:
            index.clear()

    def _maybe_recover(self) -> None:
        state = self.state
        if (not state.precise and state.connected and self._since_fault > 0
                and self.clock() - self._last_fault >= self.recover_s):
            state.precise = True
            self.indexes.set_mode(self.pool, self.backend, IndexMode.PRECISE)
            log.info("kv events %s/%s: in order again for %.0f s; precise routing resumed",
                     self.pool, self.backend, self.recover_s)
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)
