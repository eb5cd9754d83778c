"""Anthropic's Messages API wire shapes: the request bodies and the error shape.

`POST /v1/messages` and `POST /v1/messages/count_tokens` (served by vLLM since 0.10 as
vllm/entrypoints/anthropic/) are read only as far as the gateway needs them: the model, the
messages, `max_tokens`, `stream`; unknown fields pass through to the engine, as on the OpenAI
endpoints (gateway/wire/openai.py). Types are checked as vLLM's request models check them, so
what the engine would refuse with a 400 the gateway refuses first, before counting.

Errors on these endpoints are Anthropic's `{"type": "error", "error": {"type", "message"}}`,
with the gateway's own statuses (a 503 stays a 503, with its Retry-After: the SDKs retry both
it and Anthropic's 529 alike) and Anthropic's `type` for each.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from gateway.wire.prefill import PrefillOnly


class _Passthrough(BaseModel):
    # Unknown fields are the engine's business (vLLM's extensions, new Anthropic fields).
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Passthrough):
    type: StrictStr


class Message(_Passthrough):
    role: StrictStr
    content: StrictStr | list[ContentBlock]


class Tool(_Passthrough):
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class _Prompt(_Passthrough):
    """What the prompt is made of: the same fields in both bodies."""

    model: StrictStr
    messages: list[Message]
    system: StrictStr | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(PrefillOnly, _Prompt):
    """`POST /v1/messages/count_tokens`: what a Messages request's prompt would cost."""



class MessagesRequest(_Prompt):
    """`POST /v1/messages`, as far as the gateway reads it."""

    max_tokens: Annotated[StrictInt, Field(ge=1)]  # required, and positive, as vLLM's
    stream: StrictBool | None = False

    stream_options: ClassVar[None] = None  # its stream always carries the usage
    include_usage: ClassVar[bool] = False
    n: ClassVar[None] = None

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


# Anthropic's error `type` for each status (docs.anthropic.com, "Errors"); the gateway keeps its
# own statuses (docs/errors.md) and names them in Anthropic's words.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                502: "api_error", 503: "overloaded_error", 504: "timeout_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status: any other 4xx is the request's fault,
    anything else the server's (api_error)."""
    hit = _ERROR_TYPES.get(status)
    if hit is not None:
        return hit
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(message: str, type_: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": type_, "message": message}})


def error_event(message: str, type_: str = "api_error") -> bytes:
    """An error as an SSE event, for a failure after a stream has started (Anthropic's and
    vLLM's `event: error`)."""
    return b"event: error\ndata: " + error_body(message, type_) + b"\n\n"


def reshaped_error(status: int, openai_body: bytes) -> bytes:
    """An error body in OpenAI's shape (gateway/wire/openai.py `error_body`, as the gateway renders
    its own errors and the engines') in Anthropic's, its message kept."""
    try:
        data = orjson.loads(openai_body)
    except orjson.JSONDecodeError:
        data = None
    inner = data.get("error") if isinstance(data, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else None
    return error_body(message if isinstance(message, str)
                      else openai_body[:1000].decode("utf-8", "replace"), error_type(status))
