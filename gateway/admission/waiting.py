"""The queue stage: how long a request would wait, waiting itself, and the drain.

A request that fits nowhere now waits in its pool's fair queue if the predicted wait (the work
queued ahead of it and its own, over the pool's drain rate: measured while it was full, planned
until then; gateway/admission/ticker.py) fits its deadline; if not it is refused at once with a
Retry-After from the same prediction: early rejection, as Mooncake does, instead of a timeout.
The drain admits waiters in the queue's order on every release and on every tick, while they
fit.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from gateway.admission.pool import Ask, PoolState, Ticket
from gateway.admission.queue import Waiter
from gateway.errors import GatewayError, Overloaded
from gateway.wire.openai import RETRY_AFTER_MAX_S

Attempt = Callable[[PoolState, Ask], Awaitable[Ticket | None]]
Release = Callable[[Ticket], Awaitable[None]]

# What was full, and why waiting would not do: the two halves of a 503's message.
_FULL = {
    "kv_blocks": "its engines' KV cache is at the admission limit",
    "inflight_tokens": "its in-flight token limit is reached",
    "engine_waiting": "its engines are already queueing requests",
    "prefill_tokens": "its engines' prefill backlog is at the limit",
    "engine_kv": "its engines report their KV cache fuller than kv_usage_max",
    "tenant_share": "this tenant holds its whole share of the pool's KV cache",
}

# The longest wait a queue is predicted to take. Past ten minutes a prediction says only
# "long" (the pool's load will have changed many times over before such a queue ends), and a
# drain rate decayed near zero (a full pool that has released nothing for a while) would
# otherwise predict years, or overflow to infinity.
WAIT_HORIZON_S = 600.0


def outlook(ps: PoolState, ask: Ask) -> tuple[float, float]:
    """(predicted wait, deadline left) for `ask` joining the queue now: the work queued ahead
    of it and its own, over the pool's drain rate (`PoolState.wait_rate`; none known: 0), at
    most `WAIT_HORIZON_S`."""
    work = ps.queue.work_ahead(ask.priority, ask.caller) + ask.tokens
    rate = ps.wait_rate
    predicted = 0.0 if rate is None else \
        WAIT_HORIZON_S if work >= rate * WAIT_HORIZON_S else work / rate
    deadline = ps.thresholds.queue_wait_max_s.value or 0.0
    if ask.deadline_s is not None:
        deadline = min(deadline, ask.deadline_s)
    # The deadline counts from when the gateway had the request: time it already waited here
    # (for the tokenizer, behind a burst of long prompts) is time waited.
    return predicted, max(0.0, deadline - ask.waited_s)


def overloaded(ps: PoolState, cause: str, predicted: float, deadline: float,
               outcome: str | None = None) -> Overloaded:
    """503 saying what is full (`cause`) and, if it got that far, why waiting won't do.

    Its `retry_after_s` is the prediction (at most `WAIT_HORIZON_S`), so a wait past what
    the SDKs sleep says x-should-retry: false; the message says the Retry-After the headers
    carry, never more than `RETRY_AFTER_MAX_S` (gateway/wire/openai.py)."""
    if cause != "tenant_share":  # the pool is full: what it releases now is its drain
        ps.pressed = True
    retry = max(1, math.ceil(predicted if predicted > 0 else min(deadline, 5.0)))
    wait = f"{predicted:.1f}s" if predicted < WAIT_HORIZON_S else f"over {WAIT_HORIZON_S:g}s"
    then = {
        None: "",
        "predicted_wait": f", and the predicted wait ({wait}) exceeds the queue "
                          f"deadline ({deadline:g}s)",
        "queue_full": ", and its queue is full",
        "shed": ", and a request of higher priority took this one's place in the queue",
        "queue_timeout": f", and no capacity freed up within the queue deadline "
                         f"({deadline:g}s)",
    }[outcome]
    return Overloaded(f"Pool `{ps.name}` is at capacity: {_FULL.get(cause, cause)}{then}. "
                      f"Retry after {min(retry, math.ceil(RETRY_AFTER_MAX_S))}s.",
                      retry_after_s=retry, reason=outcome or cause)


async def wait(ps: PoolState, ask: Ask, cause: str, now: float,
               count: Callable[[str, str], None], on_change: Callable[[], None],
               release: Release) -> Ticket:
    """Queue `ask` (its decision said it may) until the drain admits it or its deadline ends.

    `count(decision, reason)` counts each outcome; `on_change()` follows every change of the
    queue's depth; `release` gives back a reservation made for a waiter that left just as it
    was made.
    """
    predicted, deadline = outlook(ps, ask)
    ps.pressed = True
    loop = asyncio.get_running_loop()
    waiter = Waiter(ask.priority, ask.caller, ask.tokens, now, now + deadline,
                    loop.create_future(), ask=ask)
    out = ps.queue.push(waiter)
    if out is waiter:
        count("rejected", "queue_full")
        raise overloaded(ps, cause, predicted, deadline, "queue_full")
    if out is not None:
        count("rejected", "shed")
        out.future.set_exception(overloaded(ps, cause, predicted, deadline, "shed"))
    on_change()
    try:
        async with asyncio.timeout(deadline):
            reason = await waiter.future
    except TimeoutError:
        if waiter.ticket is None:
            count("rejected", "queue_timeout")
            raise overloaded(ps, cause, predicted, deadline, "queue_timeout") from None
        # The drain reserved for it just as the deadline struck: it is admitted (refusing it
        # here would leak the reservation and its prompt's place in the prefill backlog).
        reason = waiter.ticket.reason
    except BaseException:
        # Cancelled (the caller left) just as the dispatcher reserved for it: give it back.
        if waiter.ticket is not None:
            await asyncio.shield(release(waiter.ticket))
        raise
    finally:
        ps.queue.remove(waiter)
        on_change()
        if not waiter.future.done():
            waiter.future.cancel()
    ticket: Ticket = waiter.ticket
    ticket.decision = "queued"
    ticket.reason = reason
    count("queued", cause)
    return ticket


async def drain(ps: PoolState, attempt: Attempt, release: Release) -> None:
    """Admit waiters in order while they fit; called on every release and on a tick."""
    if not ps.queue or ps.drain_lock.locked():
        return
    async with ps.drain_lock:
        while True:
            head = ps.queue.head()
            if head is None:
                return
            if head.future.done():
                ps.queue.remove(head)
                continue
            try:
                ticket = await attempt(ps, head.ask)
            except GatewayError as exc:
                ps.queue.remove(head)
                if not head.future.done():
                    head.future.set_exception(exc)
                continue
            if ticket is None:
                return
            ps.queue.remove(head)
            ps.queue.charge(head.caller, head.tokens)
            if head.future.done():  # gave up while we reserved: hand it back
                await release(ticket)
                continue
            head.ticket = ticket
            head.future.set_result(ticket.reason)
