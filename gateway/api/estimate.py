"""`POST /gateway/estimate`: what a request would cost and what admission would do, now.

Takes the body of a chat or completions request (the endpoint is told by the presence of
`messages`) and runs the request pipeline (gateway/pipeline/) up to the admission decision:
the caller is identified as the completion endpoints identify it (401/403 alike), the body
and JSON-shape limits apply before it is read and parsed, the prompt is counted, routed and
estimated by the same stages, and admission previews the decision for the same tenant,
priority and deadline, without forwarding or reserving anything. It answers an SRE's "why
was this request rejected?".
"""

from __future__ import annotations

import logging
from typing import cast
from urllib.parse import parse_qs

import orjson
from starlette.types import Receive, Scope, Send

from gateway.api.openai import AsgiClient, PipelineEndpoint, inbound
from gateway.errors import GatewayError, InternalError
from gateway.wire.openai import ENDPOINTS, Endpoint

log = logging.getLogger("gateway.api")


class EstimateEndpoint(PipelineEndpoint):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pipeline = self.pipeline()
        # `?endpoint=responses` (or chat, completions, embeddings) when the body alone does
        # not say which API it is for; otherwise it is told from the body.
        asked = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("endpoint")
        request = inbound(scope, cast(Endpoint, asked[0])
                          if asked and asked[0] in ENDPOINTS else None)
        client = AsgiClient(receive, send, request.headers, request.request_id)
        try:
            out = await pipeline.preview(request, client)
        except GatewayError as err:
            await client.reply_error(err, response_started=False)
            return
        except Exception:
            log.exception("unexpected error in estimate %s", request.request_id)
            await client.reply_error(InternalError(
                f"Internal gateway error (request id {request.request_id})."), False)
            return
        body = orjson.dumps(out)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), client.rid,
                                (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
