"""The stages that take something the request must give back, and the preview's decision:

    quota      the tenant's token buckets                                 gateway/tenancy/quotas.py
    admit      admit now, queue, or refuse; the backend                   gateway/admission/
    decide     (the preview) what admission would decide now, taking nothing

What `quota` and `admit` take, `release` (gateway/pipeline/finish.py) gives back, whatever
ended the request.
"""

from __future__ import annotations

from gateway.observe.record import Record
from gateway.pipeline.context import RequestContext, Shared
from gateway.upstream.forward import STAGE_CLOCK


async def quota(sh: Shared, ctx: RequestContext) -> None:
    p = ctx.p
    t = STAGE_CLOCK()
    ctx.quota = await sh.rt.quotas.take(p.caller.tenant, p.work.quota_tokens, p.route.pool)
    sh.lap(ctx, "quota", t)


async def admit(sh: Shared, ctx: RequestContext) -> None:
    p, rt = ctx.p, sh.rt
    t = STAGE_CLOCK()
    ticket = ctx.ticket = await rt.admission.admit(p.ask(sh.loop_time()))
    if ctx.timed and sh.timed:
        sh.stage["queue"](ticket.queue_s)
        sh.lap(ctx, "admission", t + ticket.queue_s)
    ctx.record = Record(ctx.inbound.request_id, p.endpoint, p.model.name, p.route.pool,
                        p.caller.tenant.name, bool(p.parsed.stream), ctx.inbound.arrival,
                        p.prompt.tokens, ctx.relay)


async def decide(sh: Shared, ctx: RequestContext) -> None:
    """What `serve` would do with this request now, up to the admission decision."""
    p = ctx.p
    ctx.preview = {
        "model": p.model.name,
        "endpoint": p.endpoint,
        "tenant": p.caller.tenant.name,
        "priority": p.caller.priority,
        "deadline_s": p.caller.deadline_s,
        "pool": p.route.pool,
        "overflow": p.route.overflow,
        "prompt_tokens": p.prompt.tokens,
        "prompt_blocks_hashed": len(p.prompt.hashes),
        "exact": p.prompt.exact,
        "sequences": p.work.sequences,
        "reserve_blocks": p.work.blocks_at(p.route.kv_block),
        "reserve_tokens": p.work.tokens,
        "cost": p.work.cost.to_dict(),
        "decision": sh.rt.admission.preview(p.ask(sh.loop_time())),
    }
