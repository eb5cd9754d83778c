"""What admission keeps per pool, what it is asked, and what it hands back."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.admission.decision import Mode
from gateway.admission.guard import LatencyGuard
from gateway.admission.pace import Pace
from gateway.admission.queue import PRIORITIES, FairQueue
from gateway.admission.thresholds import Thresholds
from gateway.policy.model import PoolSpec
from gateway.records import record
from gateway.routing.backends import Backend
from gateway.signals.quantiles import WindowedQuantiles
from gateway.signals.streams import LiveStreams, Watched
from gateway.state import Lease, StateBackend

# A full pool's drain (requests queued or refused for its capacity) replaces the planned one
# once it has been seen for this long: five of the ticker's samples, past which the first one,
# taken while the pool was still filling, weighs under a quarter of the average...
MEASURED_S = 5.0
# ...and this many requests have ended in it: engines whose requests run for longer than that
# (a 70B model on slow engines) release nothing in their first seconds full, which says the
# drain is not seen yet, not that it is zero.
MEASURED_RELEASES = 3


@record
class Ask:
    """What admission needs to know of a request."""

    pool: str
    blocks: int  # KV blocks to reserve (prompt + expected output)
    tokens: int  # tokens of work (prompt + expected output)
    priority: int = PRIORITIES["standard"]
    caller: str = "anonymous"
    deadline_s: float | None = None  # a client's shorter queue deadline
    overflow: bool = False
    tenant: str = ""
    tenant_share: float | None = None  # the tenant's max share of the pool's KV budget
    tenant_shadow: bool = False  # the tenant's share is counted, not enforced
    prompt_tokens: int = 0  # what its engine must prefill before the first token
    backend: str | None = None  # only this backend may take it (it holds the conversation)
    waited_s: float = 0.0  # time in the gateway before admission (counting, its tokenizer)
    # Prefix routing: the prompt's block hashes at `hash_block` tokens a block (used where the
    # pool's block size is that), and the session it belongs to (header or `user`).
    hashes: Sequence[int] = ()
    hash_block: int = 0
    session: str | None = None


@dataclass(eq=False)
class Ticket:
    pool: str
    backend: Backend
    lease: Lease | None
    store: StateBackend | None
    decision: str  # "admitted" | "queued"
    reason: str
    queue_s: float = 0.0
    overflow: bool = False
    watched: Watched | None = None  # followed by the latency guard while it streams
    prefill: int = 0  # prompt tokens counted in its backend's prefill backlog until 1st byte
    cached_tokens: int = 0  # of its prompt predicted in its backend's prefix cache
    tokens: int = 0  # counted in its backend's in-flight tokens until released
    held: Sequence[int] = ()  # its prompt blocks, held in its backend's prefix index till then
    holding: Sequence[int] = ()  # the blocks a hold still to run learns and holds (prefixes.py)


@dataclass(eq=False)
class PoolState:
    name: str
    spec: PoolSpec
    thresholds: Thresholds
    queue: FairQueue
    guard: LatencyGuard
    ttft: WindowedQuantiles
    tpot: WindowedQuantiles
    live: LiveStreams
    capacity: dict[str, int] = field(default_factory=dict)  # backend -> KV blocks
    # Slot engines (llama.cpp): backend -> KV blocks of one slot, which every request there
    # reserves whole: a slot's context is its own whether the request fills it or not.
    slot_blocks: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)  # last known, backend -> blocks
    reserved_tokens: int = 0
    prefill: dict[str, int] = field(default_factory=dict)  # backend -> tokens before 1st byte
    inflight_tokens: dict[str, int] = field(default_factory=dict)  # backend -> this replica's
    drained_tokens: float = 0.0
    drained_requests: int = 0
    # Tokens/s released while the pool was full, EWMA (gateway/admission/ticker.py), and how
    # many seconds and releases of that it has seen; `pressed`: queued or refused for
    # capacity since the last tick.
    drain_rate: float = 0.0
    drain_busy_s: float = 0.0
    drain_releases: int = 0
    pressed: bool = False
    # Tokens/s this replica's share of the pool drains at when full, by plan (pace.py), and
    # what it is planned from; 0 and None: nothing to plan from.
    planned_drain_rate: float = 0.0
    pace: Pace | None = None
    overflow_inflight: int = 0
    overflow_cap: int = 0  # overflowed long requests this pool runs at once
    overbook: dict[str, float] = field(default_factory=dict)  # backend -> reserved / used
    tenant_blocks: dict[str, int] = field(default_factory=dict)  # this replica's, for shadow
    drain_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def drain_measured(self) -> bool:
        return self.drain_busy_s >= MEASURED_S and self.drain_releases >= MEASURED_RELEASES

    @property
    def wait_rate(self) -> float | None:
        """Tokens/s queue waits are predicted from: the drain measured while the pool was full,
        once it is (`drain_measured`), else the planned one, else what is measured so far; None
        where nothing is known (no prediction: the queue's deadline decides)."""
        if self.drain_measured:
            return self.drain_rate
        if self.planned_drain_rate > 0:
            return self.planned_drain_rate
        return self.drain_rate if self.drain_rate > 0 else None

    @property
    def mode(self) -> Mode:
        a = self.spec.admission
        if not a.enabled:
            return "disabled"
        if a.mode == "static":
            return "static"
        return "shadow" if a.shadow else "enforce"
