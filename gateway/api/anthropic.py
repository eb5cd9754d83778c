"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API.

`/v1/messages` is a completion endpoint like chat: the same pipeline (gateway/pipeline/)
counts it with the model's chat template as the chat request vLLM converts it to
(gateway/tokens/anthropic.py), routes, admits, queues or refuses it, forwards it to the engine's
own `/v1/messages` and meters the usage of its answer or of its stream's `message_start` and
`message_delta` events (gateway/upstream/sse.py). Only the caller's view differs: every error
is in Anthropic's shape (gateway/wire/anthropic.py), the gateway's own and the engines' alike, with
the gateway's statuses and retry headers.

`count_tokens` is answered by the gateway's own count, not passed to an engine: it is the very
number admission, routing and the tenant's quota read for the same body, so what a caller is
told is what it will be admitted and charged on; it costs no engine a request and is answered
while the pool is saturated (when an agent most needs to know whether to compact its context);
and it is the count vLLM's own count_tokens gives (the same template and tokenizer; for a model
whose policy names no tokenizer it is the gateway's estimate, as Anthropic calls its own count).
It takes no admission, quota or gate: it is identified (a key may only count on the models it
may use) and bounded like any body.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Receive, Scope, Send

from gateway.api.errors import http_error
from gateway.api.openai import AsgiClient, CompletionsEndpoint, PipelineEndpoint, inbound
from gateway.errors import GatewayError
from gateway.pipeline import Gate
from gateway.pipeline.context import Shared
from gateway.pipeline.inbound import Inbound
from gateway.pipeline.prepare import count, identify
from gateway.runtime import Runtime
from gateway.wire.anthropic import CountTokensRequest, error_body, error_type
from gateway.wire.openai import parse_request

_JSON = (b"content-type", b"application/json")


class AnthropicClient(AsgiClient):
    """The caller of a Messages API request: errors answered in Anthropic's shape."""

    __slots__ = ()

    async def reply_error(self, err: GatewayError, response_started: bool) -> int:
        answer = http_error(err)  # the status and the headers clients act on (Retry-After)
        if not self.gone and not response_started:
            body = error_body(err.message, error_type(answer.status))
            await self.send({"type": "http.response.start", "status": answer.status,
                             "headers": [_JSON, self.rid, (b"content-length", b"%d" % len(body)),
                                         *answer.headers]})
            await self.send({"type": "http.response.body", "body": body, "more_body": False})
        return answer.status


class MessagesEndpoint(CompletionsEndpoint):
    """POST /v1/messages: the proxy's pipeline, errors in Anthropic's shape."""

    client_class = AnthropicClient

    def __init__(self, runtime: Callable[[], Runtime], gate: Gate | None = None) -> None:
        super().__init__("messages", runtime, gate)


class CountTokensEndpoint(PipelineEndpoint):
    """POST /v1/messages/count_tokens: `{"input_tokens": N}`, counted here."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pipeline = self.pipeline()
        request = inbound(scope, "messages")
        client = AnthropicClient(receive, send, request.headers, request.request_id)
        await client.answer_json(_input_tokens(pipeline.shared, request, client),
                                 "count_tokens")


async def _input_tokens(sh: Shared, request: Inbound, client: AnthropicClient
                        ) -> dict[str, int]:
    return {"input_tokens": await count_tokens(sh, request, client)}


async def count_tokens(sh: Shared, request: Inbound, client: AnthropicClient) -> int:
    """identify -> read -> parse -> count, as the pipeline's `prepare` runs them for
    `/v1/messages`; nothing routed, estimated or taken."""
    rt = sh.rt
    caller = identify(sh, request.headers)
    server = rt.policy.server
    body = await client.read_body(server.max_body_bytes, server.body_timeout_s)
    data, parsed = parse_request(body, "messages", server.max_json_depth,
                                 server.max_json_items, model=CountTokensRequest)
    model = rt.router.model(parsed.model)
    rt.tenants.check_model(caller.tenant, model.name)
    return (await count(sh, model, data, parsed, caller)).tokens
