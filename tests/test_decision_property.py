"""The preview (`/gateway/estimate`) says what admission then does: one decision, never two.

Hypothesis builds random pools (modes, backends up or down, capacities, reservations held,
engines' own reports, the latency guard's cut, queue contents, drain rates, tenants' shares,
overflow, how much of the request's prompt each backend's prefix index holds and whether
requests in flight there hold its blocks) and random requests (with or without block hashes
and a session); for each, the preview's answer must equal what `admit`, called
next on the same state, does: admit on the same backend for the same reason, queue, or
refuse for the same reason.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.admission.controller import Admission, Ask, Ticket
from gateway.admission.queue import PRIORITIES, Waiter
from gateway.errors import NoBackendAvailable, Overloaded
from gateway.observe.metrics import GatewayMetrics
from gateway.policy import parse_policy
from gateway.routing.backends import Backends
from gateway.signals.engines import EngineSample, EngineScraper
from gateway.state import MemoryState

METRICS = GatewayMetrics()  # one registry for all examples: label children are reused


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Engine:
    up: bool
    capacity: int
    held: tuple[int, ...]  # blocks of the requests already admitted there
    waiting: int | None
    kv_usage: float | None
    outstanding: int
    cached: float  # share of the request's prompt blocks in the backend's prefix index
    shares: bool  # the requests held there hold the prompt's leading blocks too


@dataclass(frozen=True)
class Pool:
    mode: str
    engines: tuple[Engine, ...]
    queue_size: int
    queue_wait_max_s: float
    waiting_max: int | None
    prefill_tokens_max: int | None
    inflight_tokens_max: int | None
    overbook: float
    guard_fraction: float  # the guard's limit as a share of its ceiling
    drain_rate: float
    queued: tuple[int, ...]  # priorities of requests already waiting
    overflow_cap: int
    overflow_inflight: int


engines = st.builds(
    Engine, up=st.sampled_from([True, True, True, True, False]), capacity=st.integers(20, 200),
    held=st.lists(st.integers(1, 120), max_size=3).map(tuple),
    waiting=st.none() | st.integers(0, 8), kv_usage=st.none() | st.floats(0, 1),
    outstanding=st.integers(0, 4), cached=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
    shares=st.booleans())

pools = st.builds(
    Pool, mode=st.sampled_from(["enforce"] * 5 + ["static", "shadow", "disabled"]),
    engines=st.lists(engines, min_size=1, max_size=3).map(tuple),
    queue_size=st.integers(0, 3), queue_wait_max_s=st.sampled_from([0.0, 1.0, 30.0]),
    waiting_max=st.none() | st.integers(0, 6),
    prefill_tokens_max=st.none() | st.integers(100, 3000),
    inflight_tokens_max=st.none() | st.integers(500, 20_000),
    overbook=st.sampled_from([1.0, 1.5]), guard_fraction=st.sampled_from([1.0, 0.5, 0.1]),
    drain_rate=st.sampled_from([0.0, 50.0, 5000.0]),
    queued=st.lists(st.sampled_from(list(PRIORITIES.values())), max_size=3).map(tuple),
    overflow_cap=st.integers(0, 2), overflow_inflight=st.integers(0, 2))

asks = st.builds(
    Ask, pool=st.just("p"), blocks=st.integers(1, 300), tokens=st.integers(1, 6000),
    priority=st.sampled_from(list(PRIORITIES.values())),
    caller=st.sampled_from(["a", "b"]), deadline_s=st.none() | st.sampled_from([0.0, 0.5, 9.0]),
    overflow=st.booleans(), tenant=st.sampled_from(["a", "b"]),
    tenant_share=st.none() | st.sampled_from([0.1, 0.5]), tenant_shadow=st.booleans(),
    prompt_tokens=st.integers(0, 2000), session=st.none() | st.sampled_from(["s1", "s2"]))

PROMPT_HASHES = tuple(range(1, 2000 // 16 + 1))  # the prompt's blocks, at block_size 16


def policy_text(pool: Pool) -> str:
    admission = [f"queue_size: {pool.queue_size}", f"queue_wait_max_s: {pool.queue_wait_max_s}",
                 "kv_usage_max: 0.9", f"overbook_max: {pool.overbook}"]
    if pool.mode == "static":
        admission.append("mode: static")
    if pool.mode == "shadow":
        admission.append("shadow: true")
    if pool.mode == "disabled":
        admission.append("enabled: false")
    for key in ("waiting_max", "prefill_tokens_max", "inflight_tokens_max"):
        value = getattr(pool, key)
        if value is not None:
            admission.append(f"{key}: {value}")
    backends = "\n".join(f"      - {{name: b{i}, url: \"http://127.0.0.1:{i + 1}\"}}"
                         for i in range(len(pool.engines)))
    return f"""
models:
  - {{name: m, architecture: llama-3-8b}}
pools:
  p:
    models: [m]
    max_model_len: 8192
    kv_blocks: 100
    admission: {{{", ".join(admission)}}}
    backends:
{backends}
"""


async def build(pool: Pool, ask: Ask) -> tuple[Admission, Clock]:
    clock = Clock()
    policy = parse_policy(policy_text(pool))
    backends = Backends(policy, METRICS, clock)
    adm = Admission(policy, backends, MemoryState(clock), METRICS, EngineScraper(5, clock),
                    clock)
    ps = adm.pools["p"]
    for engine, backend in zip(pool.engines, backends.pools["p"], strict=True):
        ps.capacity[backend.name] = engine.capacity
        if pool.overbook > 1:
            ps.overbook[backend.name] = pool.overbook
        # Reservations held there, taken as admission takes them (tenant a holds the first).
        for i, blocks in enumerate(engine.held):
            shared = ask.hashes[: blocks // 2] if engine.shares else ()
            lease_ask = Ask("p", blocks, blocks * 16, tenant="a" if i == 0 else "c",
                            prompt_tokens=blocks * 8, hashes=shared, hash_block=16)
            await adm._reserve(ps, lease_ask, backend, force=True)
        for _ in range(2):  # blocks are held two turns of the loop later (admission/prefixes)
            await asyncio.sleep(0)
        index = adm.prefix.indexes.get("p", backend.name)
        assert index is not None
        index.clear()  # what the held requests stored: the index holds what `cached` says
        index.store(ask.hashes[: int(len(ask.hashes) * engine.cached)])
        adm.scraper.samples[("p", backend.name)] = EngineSample(
            at=clock.now, waiting=engine.waiting, kv_usage=engine.kv_usage)
        backend.probe_ok = engine.up
        backend.outstanding = engine.outstanding
    adm.capacity.rescale_guard(ps)
    ps.guard.limit = max(ps.guard.floor, ps.guard.ceiling * pool.guard_fraction)
    ps.drain_rate = pool.drain_rate
    ps.overflow_cap = pool.overflow_cap
    ps.overflow_inflight = pool.overflow_inflight
    loop = asyncio.get_running_loop()
    for i, priority in enumerate(pool.queued):
        future: asyncio.Future[str] = loop.create_future()
        future.add_done_callback(_retrieve)  # one shed by the newcomer: seen, not logged
        ps.queue.push(Waiter(priority, f"q{i}", 100, clock.now, clock.now + 60, future,
                             ask=Ask("p", 10_000, 100)))
    return adm, clock


def _retrieve(future: asyncio.Future[str]) -> None:
    if not future.cancelled():
        future.exception()


async def outcome(adm: Admission, ask: Ask) -> tuple[str, str | None, str | None]:
    """(action, reason, backend) of what `admit` does now."""
    task = asyncio.ensure_future(adm.admit(ask))
    for _ in range(5):
        await asyncio.sleep(0)
    if not task.done():
        assert any(w.ask is ask for w in adm.pools["p"].queue.waiters)
        task.cancel()
        return "queue", None, None
    try:
        ticket: Ticket = task.result()
    except NoBackendAvailable:
        return "reject", "no_backend", None
    except Overloaded as err:
        return "reject", err.reason, None
    return "admit", ticket.reason, ticket.backend.name


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool=pools, ask=asks, hashed=st.booleans())
def test_the_preview_is_the_decision_admission_takes(pool: Pool, ask: Ask,
                                                     hashed: bool) -> None:
    if hashed:
        ask = replace(ask, hashes=PROMPT_HASHES[: ask.prompt_tokens // 16], hash_block=16)

    async def check() -> None:
        adm, _ = await build(pool, ask)
        preview = adm.preview(ask)
        action, reason, backend = await outcome(adm, ask)
        event(f"{pool.mode}: {action} ({reason or preview['reason']})")  # what was covered
        backends: Any = preview["backends"]
        chosen = backends.get(backend or "", {}).get("prefix") or {}
        if chosen.get("cached_tokens") or chosen.get("shared_blocks"):
            event("admitted where the prompt is cached or shared")
        assert preview["decision"] == action, (preview, reason)
        if action != "queue":
            assert preview["reason"] == reason
            assert preview["backend"] == backend

    # Hypothesis drives plain functions: each example gets an event loop of its own.
    asyncio.run(check())
