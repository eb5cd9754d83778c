"""The stages before any state changes, the same for serving and for previewing:

    identify   key -> tenant, priority, the caller's queue deadline     gateway/tenancy/auth.py
    read       the body, bounded in size and time                       the transport's Client
    parse      JSON shape limits, then the fields the gateway needs     gateway/wire/openai.py
    count      prompt tokens, with the model's tokenizer and template   gateway/pipeline/prompts.py
    route      model + prompt length -> pool                            gateway/routing/router.py
    estimate   KV blocks and token work                                 gateway/cost/work.py
"""

from __future__ import annotations

from typing import Any

from gateway.cost import PromptTooLong, RequestCostError
from gateway.errors import InvalidRequest
from gateway.pipeline.context import RequestContext, Shared
from gateway.pipeline.inbound import Headers
from gateway.pipeline.prepared import Caller, Prepared, Work, is_embedding
from gateway.pipeline.prompts import Prompt, count_prompt
from gateway.policy import ModelSpec
from gateway.routing.affinity import Held
from gateway.routing.router import Route
from gateway.wire.openai import (
    Endpoint,
    ParsedRequest,
    ResponsesRequest,
    client_deadline,
    endpoint_of,
    parse_request,
)


async def prepare(sh: Shared, ctx: RequestContext) -> None:
    """identify -> read -> parse -> count -> route -> estimate, into `ctx.prepared`."""
    inbound, client, rt = ctx.inbound, ctx.client, sh.rt
    caller = identify(sh, inbound.headers)
    server = rt.policy.server
    body = await client.read_body(server.max_body_bytes, server.body_timeout_s)
    read_at = sh.loop_time()
    if ctx.watch:
        client.watch()
    t = sh.lap(ctx, "read", inbound.started)
    endpoint, data, parsed = parse(sh, body, inbound.endpoint)
    model = rt.router.model(parsed.model)
    rt.tenants.check_model(caller.tenant, model.name)
    t = sh.lap(ctx, "parse", t)
    held = await _held(sh, parsed)
    prompt = await count(sh, model, data, parsed, caller, held.tokens if held else 0)
    t = sh.lap(ctx, "count", t)
    route = rt.router.route(model, prompt.tokens, parsed.output_limit)
    if held is not None and held.pool != route.pool and held.pool in rt.policy.pools:
        route = Route(model, held.pool)  # the conversation lives there
    work = estimate(sh, model, route, prompt, parsed)
    sh.lap(ctx, "route", t)
    user = data.get("user")
    session = inbound.headers.get(b"x-session-id")  # else the body's `user`
    ctx.prepared = Prepared(caller, endpoint, model, data, parsed, prompt, route, work, held,
                            read_at, session.decode("latin-1") if session
                            else user if isinstance(user, str) and user else None)


def identify(sh: Shared, headers: Headers) -> Caller:
    tenants = sh.rt.tenants
    tenant = tenants.identify(headers.get(b"authorization"))
    return Caller(tenant, tenants.priority(tenant, headers.get(b"x-priority")),
                  client_deadline(headers))


def parse(sh: Shared, body: bytes, endpoint: Endpoint | None
          ) -> tuple[Endpoint, dict[str, Any], ParsedRequest]:
    server = sh.rt.policy.server
    if endpoint is None:  # /gateway/estimate: the body says which
        endpoint = endpoint_of(body)
    data, parsed = parse_request(body, endpoint, server.max_json_depth, server.max_json_items)
    return endpoint, data, parsed


async def count(sh: Shared, model: ModelSpec, data: dict[str, Any], parsed: ParsedRequest,
                caller: Caller, prior_tokens: int = 0) -> Prompt:
    try:
        # Long prompts take turns by tenant (gateway/tokens/counter.py).
        return await count_prompt(sh.rt.counters[model.name], model, data, parsed,
                                  caller.tenant.name, prior_tokens, sh.hash_block[model.name])
    except RequestCostError as exc:
        raise InvalidRequest(str(exc), param=exc.param,
                             code="prompt_too_long" if isinstance(exc, PromptTooLong)
                             else "invalid_value") from None


def estimate(sh: Shared, model: ModelSpec, route: Route, prompt: Prompt,
             parsed: ParsedRequest) -> Work:
    try:
        cost = sh.cost_model(model, route.pool).cost(
            prompt.tokens, parsed.output_limit, allow_prefill_only=is_embedding(parsed))
    except RequestCostError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from None
    return Work(cost, prompt.prompts * (parsed.n or 1))


async def _held(sh: Shared, parsed: ParsedRequest) -> Held | None:
    """Where a Responses API conversation this request continues is stored, and its cost."""
    if isinstance(parsed, ResponsesRequest) and parsed.previous_response_id:
        return await sh.rt.affinity.recall(parsed.previous_response_id)
    return None
