"""`POST /gateway/estimate`: what a request would cost and what admission would do, now.

Takes the body of a chat or completions request (the endpoint is told by the presence of
`messages`), tokenizes and costs it exactly as the real path does, and returns the cost, the
pool it would be routed to and the decision it would get right now with its reason, without
forwarding or reserving anything. It answers an SRE's "why was this request rejected?".
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission.controller import Ask
from gateway.api.errors import http_error
from gateway.costing import cost_request
from gateway.errors import BodyTooLarge, GatewayError
from gateway.protocol import Endpoint, parse_request
from gateway.runtime import runtime_of


async def estimate_endpoint(request: Request) -> Response:
    rt = runtime_of(request)
    assert rt is not None, "lifespan has not run"
    body = await request.body()
    if len(body) > rt.policy.server.max_body_bytes:
        return _error(BodyTooLarge(f"The request body exceeds the limit of "
                                   f"{rt.policy.server.max_body_bytes} bytes."))
    try:
        try:
            probe = orjson.loads(body)
        except orjson.JSONDecodeError:
            probe = None  # parse_request answers it with the standard 400
        endpoint: Endpoint = "completions" if isinstance(probe, dict) \
            and "prompt" in probe and "messages" not in probe else "chat"
        data, parsed = parse_request(body, endpoint)
        model = rt.router.model(parsed.model)
        costed, _ = await cost_request(rt, model, data, parsed)
    except GatewayError as err:
        return _error(err)
    ask = Ask(costed.route.pool, costed.blocks, costed.tokens, overflow=costed.route.overflow,
              prompt_tokens=costed.prompt_tokens)
    decision = rt.admission.preview(ask)
    out = {
        "model": model.name,
        "endpoint": endpoint,
        "pool": costed.route.pool,
        "overflow": costed.route.overflow,
        "prompt_tokens": costed.prompt_tokens,
        "exact": costed.exact,
        "sequences": costed.sequences,
        "reserve_blocks": costed.blocks,
        "reserve_tokens": costed.tokens,
        "cost": costed.cost.to_dict(),
        "decision": decision,
    }
    return Response(orjson.dumps(out), media_type="application/json")


def _error(err: GatewayError) -> Response:
    answer = http_error(err)
    return Response(answer.body, status_code=answer.status, media_type="application/json",
                    headers={k.decode(): v.decode() for k, v in answer.headers})
