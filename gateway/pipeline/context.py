"""What the stages share: one request's context, and what every request reads of the runtime.

`RequestContext` is the one request as the stages fill it in, in the order they run; each
stage reads what the ones before it wrote. `Shared` is what is worked out once per runtime
(the stage timers, each model's cost model per pool, the block size prompts are hashed at).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.admission.pool import Ticket
from gateway.admission.prefixes import hash_block_size
from gateway.cost import CostModel
from gateway.observe.record import Record
from gateway.pipeline.inbound import Client, Inbound
from gateway.pipeline.prepared import Prepared, Sent, profile_of
from gateway.policy import ModelSpec
from gateway.runtime import Runtime
from gateway.tenancy.quotas import QuotaTicket
from gateway.upstream.forward import STAGE_CLOCK, Relay, Upstream

# The stages timed into gateway_request_stage_seconds, in the order a request meets them;
# `queue` is the admission queue's wait, `admission` the decision and reservation without it.
STAGES = ("read", "parse", "count", "route", "quota", "queue", "admission", "upstream_headers")


class Gate:
    """The requests this process is serving, and how many it may (`server.
    max_concurrent_requests`): past that one is answered 503 at once rather than queued
    without bound."""

    __slots__ = ("cap", "open")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open = 0


@dataclass(slots=True)
class RequestContext:
    """One request, as its stages find it out."""

    inbound: Inbound
    client: Client
    watch: bool = False  # a disconnect cancels the request once its body is read
    timed: bool = False  # its stages' times go to gateway_request_stage_seconds
    # prepare: the caller, the parsed request, its prompt, pool and work. Let go once the
    # request is on its way (`sent` keeps what its end reads): a long prompt's text and
    # parsed body are not held for as long as its answer streams.
    prepared: Prepared | None = None
    sent: Sent | None = None
    quota: QuotaTicket | None = None  # quota
    ticket: Ticket | None = None  # admit: the reservation and the backend
    record: Record | None = None  # admit: what the access log and the metrics get
    relay: Relay = field(default_factory=Relay)  # forward: what the engine did
    upstream: Upstream | None = None  # forward: what was sent
    forward_start: float = 0.0
    refused: bool = False  # answered with an error (and counted) before a record was made
    preview: dict[str, Any] | None = None  # the preview's answer

    @property
    def p(self) -> Prepared:
        """The prepared request (for the stages after `prepare`)."""
        assert self.prepared is not None
        return self.prepared


class Shared:
    """What the stages of every request read: the runtime in force and what it worked out."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.loop_time = asyncio.get_running_loop().time
        self.timed = rt.policy.server.stage_metrics
        self.stage = {name: rt.metrics.stage_observer(name) for name in STAGES}
        self._costs: dict[tuple[str, str], CostModel] = {}
        pools = rt.policy.pools
        # The block size each model's prompts are hashed at for prefix routing (None: not).
        self.hash_block = {m.name: hash_block_size([pools[p] for p in rt.policy.pools_for(m.name)])
                           for m in rt.policy.models}

    def lap(self, ctx: RequestContext, stage: str, since: float) -> float:
        """Time `stage` from `since` to now, for a timed request; now, on STAGE_CLOCK."""
        now = STAGE_CLOCK()
        if ctx.timed and self.timed:
            self.stage[stage](now - since)
        return now

    def cost_model(self, model: ModelSpec, pool_name: str) -> CostModel:
        """`model`'s cost on `pool_name`, worked out on first use."""
        costs = self._costs.get((model.name, pool_name))
        if costs is None:
            rt = self.rt
            pool = rt.policy.pools[pool_name]
            costs = self._costs[model.name, pool_name] = CostModel(
                profile_of(model), block_size=pool.block_size, tp=pool.tp,
                default_max_tokens=pool.max_tokens_default or rt.policy.defaults.max_tokens,
                expected_output=rt.output_lengths[model.name],
                kv_dtype=model.kv_cache_dtype, max_model_len=pool.max_model_len)
        return costs


# A stage: reads and writes the request's context; raises a GatewayError to refuse it.
Stage = Callable[[Shared, RequestContext], Awaitable[None]]
