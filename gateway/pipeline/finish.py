"""How every request ends, whatever ended it:

    refuse     an error in OpenAI's shape, unless the answer had started    the transport's Client
    release    the reservation and the quota                                gateway/admission/,
                                                                            gateway/tenancy/quotas.py
    observe    metrics, access log, the latency guard                       gateway/observe/
"""

from __future__ import annotations

from gateway.errors import GatewayError, UpstreamError
from gateway.observe.accesslog import log_record, log_rejection
from gateway.observe.record import charge_of
from gateway.pipeline.context import RequestContext, Shared
from gateway.pipeline.eager import finish


async def refuse(sh: Shared, ctx: RequestContext, err: GatewayError) -> None:
    record, inbound = ctx.record, ctx.inbound
    ctx.refused = True
    if record is not None and record.relay.backend is not None \
            and isinstance(err, UpstreamError) and err.backend is None:
        err.backend = record.relay.backend.name
    status = await ctx.client.reply_error(
        err, record is not None and record.relay.response_started)
    if record is not None:
        record.status = status
        record.error = err.message
    else:
        sh.rt.metrics.request_done("", "", status)
        log_rejection(inbound.request_id, inbound.endpoint or "", status, err.message)


async def release(sh: Shared, ctx: RequestContext) -> None:
    """Give back what `quota` and `admit` took. Finished whatever cancels the request: a
    second cancellation must not leak a reservation or a quota (gateway/pipeline/eager.py)."""
    rt = sh.rt
    if ctx.ticket is not None:
        await finish(rt.admission.release(ctx.ticket))
    if ctx.quota is not None:
        await finish(rt.quotas.settle(ctx.quota, charge_of(ctx.record, ctx.quota.taken,
                                                           ctx.client.gone)))


def observe(sh: Shared, ctx: RequestContext) -> None:
    rt, record, gone = sh.rt, ctx.record, ctx.client.gone
    if record is None:
        if gone and not ctx.refused:  # left before it went upstream: counted all the same
            rt.metrics.request_done("", "", 499)
            log_rejection(ctx.inbound.request_id, ctx.inbound.endpoint or "", 499,
                          "The caller closed the connection before its request was sent on.")
        return
    relay = record.relay
    now = sh.loop_time()
    if not record.status:
        record.status = relay.status
    if gone:
        record.status = 499  # nginx's "client closed request"
    if relay.finished is None:
        relay.finished = now
    duration, ttft, tpot, _ = rt.metrics.pool_children(record.pool)
    rt.metrics.request_done(record.pool, record.model, record.status)
    duration.observe(relay.finished - record.arrival)
    if record.status == 200 and relay.first_byte is not None:
        ttft.observe(relay.first_byte - record.arrival)
        tokens = relay.completion_tokens
        if tokens is None and record.stream:
            tokens = max(0, relay.sse_events - 2)  # minus the role frame and [DONE]
        tpot_s = None
        if record.stream and tokens and tokens > 1:
            tpot_s = (relay.finished - relay.first_byte) / (tokens - 1)
            tpot.observe(tpot_s)
        # The guard watches the engines' latency, without our own queueing in it: otherwise
        # queueing would read as slowness and shrink the limit that causes it.
        rt.admission.observe_latency(record.pool, relay.first_byte - ctx.forward_start, tpot_s,
                                     admitted_s_ago=now - ctx.forward_start)
    log_record(record, gone)
