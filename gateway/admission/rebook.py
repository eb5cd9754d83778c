"""A reservation booked on a bound of the prompt, booked again on its count.

A long prompt new to the gateway goes upstream on a bound of its tokens while a worker counts it
(gateway/pipeline.py, `server.count_behind_chars`): its lease, its backend's in-flight tokens
and prefill backlog, its tenant's blocks and its prefix blocks were booked on that bound. When
the count lands, `rebook` books the count instead, on the same backend, whatever the limits say:
the request is running there already, and the count is never above the bound.

The store's lease is replaced, not edited: the new one is taken (forced), then the old one given
back, so the store holds at least the request's blocks at every moment; if the store fails, the
bound stays booked (the safe side) and expires with its lease. `Admission.release` waits for a
rebooking under way, so the two never interleave.
"""

from __future__ import annotations

from typing import Protocol

from gateway.admission.capacity import UNKNOWN_CAPACITY_BLOCKS, Capacity
from gateway.admission.decision import reservation_blocks
from gateway.admission.pool import Ask, PoolState, Ticket
from gateway.admission.prefixes import PrefixPlacement
from gateway.observe.metrics import GatewayMetrics
from gateway.routing import PrefixRule
from gateway.state import Lease, Limits, StateBackend, StateError


class Books(Protocol):
    """What of admission (gateway/admission/controller.py) a rebooking reads and writes."""

    pools: dict[str, PoolState]
    rules: dict[str, PrefixRule | None]
    prefix: PrefixPlacement
    capacity: Capacity
    metrics: GatewayMetrics
    state: StateBackend

    def live_in(self, store: StateBackend) -> dict[str, Lease]: ...


async def rebook(adm: Books, ticket: Ticket, ask: Ask) -> None:
    ps = adm.pools[ticket.pool]
    name = ticket.backend.name
    old = ticket.lease
    if old is None or ticket.store is None:
        return  # admission disabled or the static rule: nothing was booked
    rule = adm.rules[ps.name]
    # Its own blocks are not "held by others".
    cached, shared = adm.prefix.at(ps, ask, name, ticket) if rule else (0, 0)
    blocks = reservation_blocks(ask.blocks, adm.capacity.max_blocks(ps, name),
                                ps.slot_blocks.get(name), shared)
    new = Lease(old.pool, name, f"{old.lease_id}r", blocks, ask.tokens, old.tenant)
    store = ticket.store
    try:
        result = await store.reserve(new, Limits(UNKNOWN_CAPACITY_BLOCKS, None, None),
                                     ps.spec.admission.lease_ttl_s)
    except StateError:
        adm.metrics.state_errors.labels("reserve").inc()
        result = None
    if result is not None and result.ok:
        live = adm.live_in(store)
        live[new.lease_id] = new
        live.pop(old.lease_id, None)
        ticket.lease = new
        ps.tenant_blocks[old.tenant] = max(
            0, ps.tenant_blocks.get(old.tenant, 0) + new.blocks - old.blocks)
        if store is adm.state:
            ps.reserved[name] = max(0, result.backend_blocks - old.blocks)
            ps.reserved_tokens = max(0, result.pool_tokens - old.tokens)
            adm.metrics.kv_blocks_reserved.labels(ps.name, name).set(ps.reserved[name])
        try:
            await store.release(old)
        except StateError:  # not refreshed any more: it expires within its TTL
            adm.metrics.state_errors.labels("release").inc()
    ps.inflight_tokens[name] = max(0, ps.inflight_tokens.get(name, 0) + ask.tokens
                                   - ticket.tokens)
    ticket.tokens = ask.tokens
    if ticket.prefill:  # not prefilled yet: its backlog is the count's, less what is cached
        prefill = max(0, ask.prompt_tokens - cached)
        adm.capacity.prefill_remove(ps, name, ticket.prefill)
        adm.capacity.prefill_add(ps, name, prefill)
        ticket.prefill = prefill
    ticket.cached_tokens = cached
    if rule is not None:
        adm.prefix.counted(ps, ask, ticket)  # every block of it, learnt and held there
