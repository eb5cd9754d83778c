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

from typing import cast
from urllib.parse import parse_qs

from starlette.types import Receive, Scope, Send

from gateway.api.openai import AsgiClient, PipelineEndpoint, inbound
from gateway.wire.openai import ENDPOINTS, Endpoint


class EstimateEndpoint(PipelineEndpoint):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pipeline = self.pipeline()
        # `?endpoint=responses` (or chat, completions, embeddings) when the body alone does
        # not say which API it is for; otherwise it is told from the body.
        asked = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("endpoint")
        request = inbound(scope, cast(Endpoint, asked[0])
                          if asked and asked[0] in ENDPOINTS else None)
        client = AsgiClient(receive, send, request.headers, request.request_id)
        await client.answer_json(pipeline.preview(request, client), "estimate")
