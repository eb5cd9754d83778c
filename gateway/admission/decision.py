"""The admission decision as one pure function over a snapshot of a pool.

`decide(view, ask)` is the only place that says admit, queue or reject, and why. The real path
(`Admission.admit`) and the preview (`/gateway/estimate`) both build a `PoolView` of the pool as
it stands and call it, so the two cannot drift. The real path then acts: it reserves on the
chosen backend in the state backend, whose check-and-reserve is atomic across replicas and
applies the very limits the view carries (`limits_for`); a replica that lost a race sees the
store's refusal, refreshes its view and decides again.

The checks, in order:
1. mode `disabled`: the least-loaded available backend, nothing reserved;
2. no backend available: reject (`no_backend`);
3. a request overflowed from a long-context pool beyond the overflow cap: reject;
4. mode `static`: the least-loaded backend whose engine is under the static rule, else reject;
5. a request that has already spent the pool's TTFT target in the gateway (reading, counting,
   waiting for the tokenizer behind a burst of long prompts) cannot meet it: reject
   (`ttft_spent`), even where it would fit, so the engines' time goes to requests that can;
6. placement (`place`): backends by KV headroom, most first, or by prefix cost within the
   imbalance bound where the pool routes by prefix (gateway/routing/router.py `prefix_order`); a
   backend is skipped when its engine's own report or its prefill backlog (less what it holds
   of the prompt) rules it out (one that holds part of the prompt still takes it when it
   would reach the first token no later than the backend taking it instead); the first where
   the reservation (less the prompt blocks it already holds for requests in flight) fits its
   block limit, the pool's in-flight tokens and the tenant's share takes it;
7. nothing placed: queue when the queue has room and the predicted wait fits the deadline,
   else reject with the reason that tells why;
8. mode `shadow`: whatever 1-7 said is recorded, and the request is admitted anyway.
"""

from __future__ import annotations

from typing import Literal

from gateway.records import record
from gateway.routing.router import PrefixRule, least_outstanding, most_headroom_first, prefix_order

Mode = Literal["enforce", "static", "shadow", "disabled"]
Action = Literal["admit", "queue", "reject"]


@record
class BackendView:
    name: str
    available: bool
    limit_blocks: int  # what our reservations may take here (kv_usage_max, overbooking, ...)
    reserved_blocks: int
    outstanding: int  # requests this gateway has in flight there
    ruled_out: str | None  # the engine's report or its prefill backlog excludes it, and why
    over_static_rule: bool  # the engine reports more waiting or KV than the static rule allows
    # A slot engine's (llama.cpp) blocks per slot: each request there reserves one slot whole,
    # so its block limit (slots x slot blocks) holds it at its slot count.
    slot_blocks: int | None = None
    # For this request, where the pool routes by prefix (0 / False otherwise):
    cached_tokens: int = 0  # of its prompt predicted in the backend's prefix cache
    shared_blocks: int = 0  # of its blocks held there by requests in flight: not reserved twice
    inflight_tokens: int = 0  # tokens this gateway has in flight there
    prefill_tokens: int = 0  # its prefill backlog (prompt tokens admitted, no first token yet)
    affinity: bool = False  # the backend the request's session hashes to

    @property
    def headroom(self) -> int:
        return self.limit_blocks - self.reserved_blocks


@record
class PoolView:
    name: str
    mode: Mode
    backends: tuple[BackendView, ...]
    reserved_tokens: int
    token_limit: int | None  # the in-flight token limit when it binds (policy, or guard's cut)
    tenant_held: int  # blocks the asking tenant holds on this pool
    tenant_max: int | None  # the most it may hold, when its share is enforced
    overflow_inflight: int
    overflow_cap: int | None  # for a request that overflowed here: how many may run at once
    queue_size: int
    queue_admits: bool  # the queue has room for this ask, or someone less important to shed
    predicted_wait_s: float
    deadline_s: float  # what is left of the queue deadline after the time already waited
    ttft_budget_s: float | None = None  # the TTFT line in force, if any
    prefix: PrefixRule | None = None  # the pool routes by prefix (None: by headroom)


@record
class Placement:
    backend: str | None
    reason: str  # "fits", or why no backend took it


@record
class Decision:
    action: Action
    reason: str  # what refused it (or "fits"); for a rejection, x-gateway-reason
    backend: str | None = None
    cause: str | None = None  # for a queue-stage rejection: what was full in the first place
    enforced: Decision | None = None  # shadow mode: what enforcing would have done


@record
class AskView:
    """The parts of a request the decision reads."""

    blocks: int
    tokens: int
    overflow: bool = False
    waited_s: float = 0.0  # in the gateway before admission
    prompt_tokens: int = 0


def reservation_blocks(ask_blocks: int, limit_blocks: int, slot_blocks: int | None = None,
                       shared_blocks: int = 0) -> int:
    """A reservation larger than a whole backend would never fit: capped at the limit, so the
    request runs alone rather than waiting forever. The blocks of its prompt that requests in
    flight there already hold are shared by the engine, not reserved twice (at least one block
    is). On a slot engine a request takes one slot, whatever its length or what it shares."""
    if slot_blocks:
        return min(slot_blocks, max(1, limit_blocks))
    return min(max(1, ask_blocks - shared_blocks), max(1, limit_blocks))


def blocks_on(backend: BackendView, ask_blocks: int) -> int:
    """What `ask_blocks` reserves on `backend` (`reservation_blocks` with its view)."""
    return reservation_blocks(ask_blocks, backend.limit_blocks, backend.slot_blocks,
                              backend.shared_blocks)


def fits(view: PoolView, backend: BackendView, ask: AskView) -> str | None:
    """None when `ask` fits on `backend`, else the limit it hits. The state backends check
    the same three limits, in the same order, atomically (gateway/state/)."""
    blocks = blocks_on(backend, ask.blocks)
    if backend.reserved_blocks + blocks > backend.limit_blocks:
        return "kv_blocks"
    # Alone on an empty pool a request is admitted whatever its tokens, so the token limit
    # can never starve a large request forever.
    if view.token_limit is not None and view.reserved_tokens > 0 \
            and view.reserved_tokens + ask.tokens > view.token_limit:
        return "inflight_tokens"
    if view.tenant_max is not None and view.tenant_held > 0 \
            and view.tenant_held + blocks > view.tenant_max:
        return "tenant_share"
    return None


def order(view: PoolView, ask: AskView) -> list[BackendView]:
    """The available backends in the order placement tries them."""
    available = [b for b in view.backends if b.available]
    if view.prefix is not None and view.prefix.act:
        return prefix_order(available, view.prefix, ask.tokens, ask.prompt_tokens)
    return most_headroom_first(available)


def place(view: PoolView, ask: AskView) -> Placement:
    """The backend that takes `ask` now, most KV headroom (or prefix cost) first; or why
    none does.

    With prefix routing, a backend that holds part of the prompt but is ruled out by its
    prefill backlog alone is kept aside, and still takes the request if it would reach the
    request's first token no later than the backend that would take it instead (its backlog
    plus the part of the prompt not cached, against the other's): the backlog limit is there
    for that request's first token, and sending it where nothing is cached would only add
    prefill work to the pool without bringing its first token sooner.
    """
    reason = "kv_blocks"
    held: list[BackendView] = []  # cached there, ruled out by the prefill backlog only
    for b in order(view, ask):
        if b.ruled_out is not None:
            reason = b.ruled_out
            if b.ruled_out == "prefill_tokens" and b.cached_tokens and view.prefix is not None \
                    and view.prefix.act:
                held.append(b)
            continue
        refused = fits(view, b, ask)
        if refused is None:
            return Placement(_sooner(view, ask, held, b).name, "fits")
        reason = refused
        if refused == "inflight_tokens":  # pool-wide: no other backend can do better
            break
    return Placement(None, reason)


def _sooner(view: PoolView, ask: AskView, held: list[BackendView],
            chosen: BackendView) -> BackendView:
    """`chosen`, or the first of `held` whose prefill before this request's first token
    (backlog + prompt not cached there) is no longer than at `chosen`, where it fits."""
    def prefill(b: BackendView) -> int:
        return b.prefill_tokens + ask.prompt_tokens - b.cached_tokens

    for b in held:
        if prefill(b) <= prefill(chosen) and fits(view, b, ask) is None:
            return b
    return chosen


def decide(view: PoolView, ask: AskView) -> Decision:
    available = [b for b in view.backends if b.available]
    if view.mode == "disabled":
        chosen = least_outstanding(available)
        return Decision("admit", "admission_disabled", chosen.name) if chosen \
            else Decision("reject", "no_backend")
    if not available:
        return Decision("reject", "no_backend")
    if ask.overflow and view.overflow_cap is not None \
            and view.overflow_inflight >= view.overflow_cap:
        return Decision("reject", "overflow_cap")
    if view.mode == "static":
        chosen = least_outstanding([b for b in available if not b.over_static_rule])
        return Decision("admit", "static_rule", chosen.name) if chosen \
            else Decision("reject", "static_rule")
    enforced = _enforce(view, ask)
    if view.mode == "shadow":
        if enforced.action == "admit":
            return Decision("admit", enforced.reason, enforced.backend, enforced=enforced)
        forced = max(available, key=lambda b: b.headroom)
        return Decision("admit", "shadow", forced.name, enforced=enforced)
    return enforced


def _enforce(view: PoolView, ask: AskView) -> Decision:
    if view.ttft_budget_s is not None and ask.waited_s >= view.ttft_budget_s:
        return Decision("reject", "ttft_spent")
    placed = place(view, ask)
    if placed.backend is not None:
        return Decision("admit", "fits", placed.backend)
    return after_placement(view, placed.reason)


def after_placement(view: PoolView, cause: str) -> Decision:
    """The queue stage, for a request no backend takes now because of `cause`."""
    if view.queue_size == 0 or view.deadline_s <= 0:
        return Decision("reject", cause, cause=cause)
    if view.predicted_wait_s > view.deadline_s:
        return Decision("reject", "predicted_wait", cause=cause)
    if not view.queue_admits:
        return Decision("reject", "queue_full", cause=cause)
    return Decision("queue", cause)
