"""The forward stage: the request to the engine admission chose, its answer to the caller, and
what that answer teaches (the stored response's place, output lengths, the prefix index, the
accountant), whatever ended it.

    forward    to the engine, the answer relayed as it comes      gateway/upstream/
    learn      what the answer teaches                            gateway/routing/affinity.py, ...
"""

from __future__ import annotations

import asyncio

import orjson

from gateway.observe.record import usage_of
from gateway.pipeline.context import RequestContext, Shared
from gateway.pipeline.prepared import Prepared, Sent, profile_of
from gateway.routing.affinity import Held
from gateway.upstream.forward import STAGE_CLOCK, Relay, Upstream
from gateway.wire.openai import answer_headers


async def forward(sh: Shared, ctx: RequestContext) -> None:
    rt, p, ticket, relay = sh.rt, ctx.p, ctx.ticket, ctx.relay
    assert ticket is not None
    body, strip_usage = upstream_body(p)
    quota = ctx.quota
    headers = answer_headers(ctx.inbound.request_id, p.route.pool, ticket.decision,
                             ticket.queue_s, p.prompt.tokens, ticket.cached_tokens,
                             quota.window if quota is not None else None)
    up = ctx.upstream = Upstream(ctx.inbound.request_id, p.endpoint, p.route.pool, body,
                                 bool(p.parsed.stream), headers, strip_usage,
                                 rt.admission.on_first_byte, ticket)
    # `up` holds them until sent (the body until an engine answers, the headers until the
    # answer starts): this frame lives as long as the stream and must not keep them.
    del body, headers
    ctx.forward_start = asyncio.get_running_loop().time()
    forward_at = STAGE_CLOCK()
    if not up.stream:
        # The engine's usage comes only with a whole answer: read it even if the caller
        # leaves (bounded), or the caller could cut to dodge its quota.
        ctx.client.linger(rt.policy.upstream.disconnect_drain_s)
    else:
        rt.admission.watch(ticket, relay, ctx.forward_start,
                           p.work.cost.expected_output_tokens)
    # What the request's end reads, and no more, for as long as the answer streams.
    ctx.sent, ctx.prepared = Sent.of(p), None
    del p
    inflight = rt.metrics.pool_children(up.pool)[3]
    inflight.inc()
    try:
        await rt.forwarder.forward(up, relay, ctx.client.send, ticket.backend)
    finally:
        inflight.dec()
        await learn(sh, ctx)
    if ctx.timed and sh.timed and relay.headers_at is not None:
        sh.stage["upstream_headers"](relay.headers_at - forward_at)


def upstream_body(p: Prepared) -> tuple[bytes, bool]:
    """The body the engine gets: the pool's model name, and a usage frame asked for."""
    data, parsed = p.data, p.parsed
    strip_usage = False
    if p.endpoint in ("chat", "completions") and parsed.stream and not parsed.include_usage:
        # Ask the engine for its usage frame so tokens are counted as the engine counts them;
        # the caller, who did not ask, never sees it.
        data["stream_options"] = {**(data.get("stream_options") or {}), "include_usage": True}
        strip_usage = True
    # Always what the gateway read, never the caller's bytes: JSON with a key twice reads
    # last-wins here and first-wins in some engines, and the engine must run what was
    # counted and admitted.
    data["model"] = p.model.upstream_name
    return orjson.dumps(data), strip_usage


async def learn(sh: Shared, ctx: RequestContext) -> None:
    """What the engine's answer teaches, whatever ended it."""
    rt, sent, up, relay, ticket = sh.rt, ctx.sent, ctx.upstream, ctx.relay, ctx.ticket
    assert sent is not None and up is not None and ticket is not None
    if relay.response_id is not None and relay.backend is not None and sent.store:
        # Where it is stored, and what its conversation now costs the next turn.
        tokens = (relay.prompt_tokens or sent.prompt_tokens) + (relay.completion_tokens or 0)
        await rt.affinity.remember(relay.response_id, Held(up.pool, relay.backend.name, tokens))
    _lengths(sh, sent, relay)
    rt.admission.prefix.observed(ticket, relay.prompt_tokens, relay.cached_tokens)
    used = usage_of(sent.endpoint, up.stream, sent.prompt_tokens, relay)
    if used is not None:
        rt.accountant.record(up.pool, sent.tenant, *used, profile_of(sent.model),
                             rt.backends.pools_inflight(up.pool))


def _lengths(sh: Shared, sent: Sent, relay: Relay) -> None:
    """Output lengths learned from completed requests, and the char ratio of `none`
    tokenizers."""
    if relay.status != 200:
        return
    rt = sh.rt
    if relay.completion_tokens is not None:
        rt.output_lengths[sent.model.name].observe(relay.completion_tokens)
    if not sent.exact and relay.prompt_tokens and sent.chars:
        error = rt.counters[sent.model.name].tokenizer.observe(sent.chars, relay.prompt_tokens)
        rt.metrics.child(rt.metrics.token_estimate_error, sent.model.name).observe(abs(error))
