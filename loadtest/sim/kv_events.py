"""KV cache events from the simulated engine, in vLLM's wire format (`--kv-events-endpoint`).

What vLLM does (vllm/distributed/kv_events.py, vllm/v1/core/block_pool.py), done here too:
- the block pool queues an event where its cache changes: `BlockStored` when full blocks are
  cached (their hashes, the hash of the block before them or None, their token ids, the block
  size), `BlockRemoved` when a cached block is evicted to be reused, `AllBlocksCleared` when
  the prefix cache is reset (a crash, here);
- once per engine step the queued events go out as one batch, `[ts, [event...], dp_rank]`,
  msgpack-encoded (events as tagged maps, as vLLM since vllm-project/vllm#42892), on a PUB
  socket in three frames: topic, sequence number (8 bytes big-endian, from 0), payload;
- the last `buffer_steps` batches are kept for a ROUTER replay socket: `["", start]` from a
  DEALER gets `["", seq, payload]` for each kept batch from `start`, then `["", -1, ""]`.

Hashes are the simulator's own (unsigned 64-bit, as vLLM's int hashes); token ids are the
prompt's where the request brought them (token-id prompts, chat counted exactly), and elsewhere
(generated tokens, prompts known only by length) ids of the model's vocabulary drawn from the
request and the block (scheduler.py `synthetic_ids`), which no other prompt will match: every
id fits the u32 that routers consuming vLLM's events type them as.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("loadtest.sim.kv_events")

MASK64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


class KVEventPublisher:
    """Queues the block pool's events (`stored`, `removed`, `cleared`); `flush` publishes
    them as one batch. Implements `kvcache.KVEventSink`."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._sync = zmq.Context()
        self._pub = self._sync.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)  # vLLM's default high-water mark
        self._pub.bind(endpoint)
        self._async = zmq.asyncio.Context()
        self._router: zmq.asyncio.Socket | None = None
        if replay_endpoint is not None:
            self._router = self._async.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[Any] = []
        self.seq = 0

    # -- kvcache.KVEventSink ------------------------------------------------------------------
    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int],
               block_size: int) -> None:
        self._pending.append(BlockStored(
            [h & MASK64 for h in hashes], None if parent is None else parent & MASK64,
            token_ids, block_size))

    def removed(self, block_hash: int) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash & MASK64)
        else:
            self._pending.append(BlockRemoved([block_hash & MASK64]))

    def cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    # -- publishing ---------------------------------------------------------------------------
    def flush(self) -> None:
        """The step's events as one batch (nothing when the step changed no cached block)."""
        if not self._pending:
            return
        payload = self._encoder.encode(EventBatch(time.time(), self._pending, 0))
        self._pending = []
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        try:
            # PUB never blocks: past the high-water mark ZMQ drops, as for a slow subscriber.
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("kv events: batch %d not sent: %s", seq, exc)

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        router = self._router
        if router is None:
            return
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events: replay request of %d frames ignored", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await router.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
        self._sync.term()
        self._async.term()


async def run_replay(publisher: KVEventPublisher) -> None:
    """`serve_replay` as a task body that logs instead of dying on a socket error."""
    try:
        await publisher.serve_replay()
    except zmq.ZMQError as exc:
        log.warning("kv events: replay socket closed: %s", exc)
    except asyncio.CancelledError:
        raise
