"""The OpenAI wire shapes the gateway reads and writes: request bodies and error bodies.

The errors themselves are gateway/errors.py's; this module only knows the body they render to
(`{"error": {"message", "type", "param", "code"}}`). Request bodies are validated only as far
as the gateway needs them (model, messages or prompt, stream, token limits); unknown OpenAI
fields pass through untouched, as vLLM's models allow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from gateway.errors import InvalidRequest, RateWindow
from gateway.records import record
from gateway.tokens.templates import request_template_kwargs
from gateway.wire.anthropic import CountTokensRequest, MessagesRequest
from gateway.wire.pooling import ClassifyRequest, PoolingRequest, RerankRequest, ScoreRequest
from gateway.wire.prefill import PrefillOnly


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}})


# OpenAI's error `type` for each status (the SDKs pick their exception by the status alone;
# callers that read the body match on these): one vocabulary for the gateway's own errors and
# the engines' answers re-rendered at the proxy. docs/errors.md lists what is sent.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status: any other 4xx is the request's fault
    (invalid_request_error), anything else the server's (server_error)."""
    hit = _ERROR_TYPES.get(status)
    if hit is not None:
        return hit
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def sse_error_frame(message: str, type_: str = "server_error",
                    code: str | None = "upstream_error") -> bytes:
    """An error as an SSE event, for failures after a stream has started (vLLM does the same)."""
    return b"data: " + error_body(message, type_, None, code) + b"\n\ndata: [DONE]\n\n"


# The official SDKs honour a server's delay only up to a cap: openai-python now sleeps what
# retry-after-ms (else retry-after) says up to 120 s and does not retry past it; openai-node
# and earlier openai-python releases honour up to 60 s and past it fall back to their own
# 0.5-8 s backoff, i.e. retry straight into the same refusal. The smaller cap is the line
# past which a retry cannot help soon.
SDK_RETRY_AFTER_CAP_S = 60.0
# The most Retry-After and retry-after-ms ever say: the same minute. A longer wait is told
# x-should-retry: false, so the SDKs stop at once whatever the delay says; a client that
# honours Retry-After alone asks again within a minute and gets a fresh answer (one cheap
# refusal a minute) rather than sleeping on a prediction the pool's load will have overtaken
# (waits are predicted from a drain that moves in seconds) or, for a day's quota, for hours
# (the message and x-ratelimit-reset-tokens still say when it refills). And whatever a cause
# computes, no header carries a number no client can use (issue 43: 233077826149338).
RETRY_AFTER_MAX_S = SDK_RETRY_AFTER_CAP_S


def retry_headers(retry_after_s: float) -> list[tuple[bytes, bytes]]:
    """Retry-After (whole seconds, 1 to `RETRY_AFTER_MAX_S`, for every HTTP client),
    retry-after-ms (the fraction the cause knows, to the same ceiling; the SDKs read it first)
    and x-should-retry (the SDKs obey it over their own rules): false where the wait is past
    what an SDK would sleep, so that it does not retry into the same refusal on its own
    backoff. A wait that is not a number (a bug where it was computed) says the ceiling."""
    wait = RETRY_AFTER_MAX_S if math.isnan(retry_after_s) else max(0.0, retry_after_s)
    told = min(wait, RETRY_AFTER_MAX_S)
    return [(b"retry-after", b"%d" % max(1, math.ceil(told))),
            (b"retry-after-ms", b"%d" % max(1, round(told * 1000))),
            (b"x-should-retry", b"false" if wait > SDK_RETRY_AFTER_CAP_S else b"true")]


def rate_limit_headers(window: RateWindow) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* for tokens, from the tightest bucket's state."""
    return [(b"x-ratelimit-limit-tokens", b"%d" % window.limit),
            (b"x-ratelimit-remaining-tokens", b"%d" % max(0, window.remaining)),
            (b"x-ratelimit-reset-tokens", f"{window.reset_s:.3f}s".encode())]


def answer_headers(request_id: str, pool: str, decision: str, queue_s: float,
                   prompt_tokens: int, cached_tokens: int,
                   window: RateWindow | None) -> list[tuple[bytes, bytes]]:
    """What the gateway adds to the engine's answer: where it went and how it was decided;
    x-gateway-cached-tokens is the prompt's predicted prefix-cache hit at the backend chosen."""
    out = [(b"x-request-id", request_id.encode()),
           (b"x-gateway-pool", pool.encode()),
           (b"x-gateway-decision", decision.encode()),
           (b"x-gateway-queue-ms", b"%d" % int(queue_s * 1000)),
           (b"x-gateway-prompt-tokens", b"%d" % prompt_tokens),
           (b"x-gateway-cached-tokens", b"%d" % cached_tokens)]
    if window is not None:
        out += rate_limit_headers(window)
    return out


def set_header(headers: list[tuple[bytes, bytes]], name: bytes, value: bytes) -> None:
    """Replace `name`'s value in place (the answer's headers, before they are sent)."""
    for i, (key, _) in enumerate(headers):
        if key == name:
            headers[i] = (name, value)


# --- request bodies -------------------------------------------------------------------------

class _Passthrough(BaseModel):
    # Unknown fields are the engine's business (vLLM extensions, new OpenAI fields).
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Passthrough):
    role: StrictStr
    content: Any = None


class StreamOptions(_Passthrough):
    include_usage: StrictBool | None = None


NonNegativeTokens = Annotated[StrictInt, Field(ge=0)]


class _Common(_Passthrough):
    model: StrictStr
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: NonNegativeTokens | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    """The rules a chat body is held to, and the words of its errors. Bodies that pass are
    read as a `ChatRequest` (below), checked by hand against the same rules."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: NonNegativeTokens | None = None
    tools: list[Any] | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


class EmbeddingsRequest(PrefillOnly, _Passthrough):
    model: StrictStr
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]



class ResponsesRequest(_Passthrough):
    """The Responses API's create body, as far as the gateway reads it."""

    model: StrictStr
    input: StrictStr | Annotated[list[Any], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: NonNegativeTokens | None = None
    stream: StrictBool | None = False
    tools: list[Any] | None = None
    previous_response_id: StrictStr | None = None

    stream_options: ClassVar[None] = None  # its stream always ends with the usage
    include_usage: ClassVar[bool] = False
    n: ClassVar[None] = None

    @property
    def output_limit(self) -> int | None:
        return self.max_output_tokens


@record
class ChatRequest:
    """A chat body, as far as the gateway reads it past the prompt (the prompt is read from
    the body itself). Held to `ChatCompletionRequest`'s rules by `_chat_request`: chat is the
    hot endpoint, and pydantic's validation of even one message costs ~100 us run cold, as
    the gateway runs it between requests at low load (docs/benchmarks-proxy.md, twelfth
    round), where checking the same fields in Python costs ~45."""

    model: str
    stream: bool | None
    include_usage: bool
    max_tokens: int | None
    max_completion_tokens: int | None
    n: int | None
    tools: list[Any] | None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


_BOOL_OR_NONE = frozenset({bool, type(None)})


def _chat_request(data: dict[str, Any]) -> ChatRequest | None:
    """`data` read as a ChatRequest where it plainly passes `ChatCompletionRequest`'s rules;
    None where it may not (then the model judges it, and words the error). It never accepts
    what the model refuses: tests/test_chat_request.py draws bodies to hold it to that.
    Types are told exactly: orjson makes only exact str, int, bool, list and dict."""
    get = data.get
    model, stream, tools, messages = get("model"), get("stream", False), get("tools"), \
        get("messages")
    if type(model) is not str or type(stream) not in _BOOL_OR_NONE \
            or (tools is not None and type(tools) is not list) \
            or type(messages) is not list or not messages:
        return None
    options = get("stream_options")
    include = None
    if options is not None:
        if type(options) is not dict:
            return None
        include = options.get("include_usage")
        if type(include) not in _BOOL_OR_NONE:
            return None
    max_tokens, max_completion, n = get("max_tokens"), get("max_completion_tokens"), get("n")
    if (max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0)) \
            or (max_completion is not None
                and (type(max_completion) is not int or max_completion < 0)) \
            or (n is not None and (type(n) is not int or not 1 <= n <= 128)):
        return None
    for message in messages:
        if type(message) is not dict or type(message.get("role")) is not str:
            return None
    return ChatRequest(model, stream, bool(include), max_tokens, max_completion, n, tools)


def _chat_of(req: ChatCompletionRequest) -> ChatRequest:
    return ChatRequest(req.model, req.stream, req.include_usage, req.max_tokens,
                       req.max_completion_tokens, req.n, req.tools)


Endpoint = Literal["chat", "completions", "responses", "embeddings", "rerank", "score",
                   "classify", "messages"]
_MODELS: dict[str, type[BaseModel]] = {}  # filled below, once the classes exist
# Arguments of the chat-template render that the gateway passes itself: a caller's
# `chat_template_kwargs` setting one would clash with it (a TypeError, before: a 500).
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "template", "self",
                                       "special_tokens"})
ParsedRequest = (ChatRequest | CompletionRequest | ResponsesRequest | EmbeddingsRequest
                 | PoolingRequest | MessagesRequest | CountTokensRequest)
_MODELS.update(messages=MessagesRequest)  # Anthropic's Messages API (gateway/wire/anthropic.py)
_MODELS.update(chat=ChatCompletionRequest, completions=CompletionRequest,
               responses=ResponsesRequest, embeddings=EmbeddingsRequest,
               rerank=RerankRequest, score=ScoreRequest, classify=ClassifyRequest)
# Prefill work only, metered by the prompt alone: their usage has no output tokens.
PREFILL_ENDPOINTS: frozenset[str] = frozenset({"embeddings", "rerank", "score", "classify"})


def parse_request(raw: bytes, endpoint: Endpoint, max_depth: int = 32,
                  max_items: int = 200_000, model: type[BaseModel] | None = None
                  ) -> tuple[dict[str, Any], ParsedRequest]:
    """Decode and validate a body; return the raw dict (to forward) and the typed view.
    `model`: validated by it rather than by the endpoint's (Anthropic's count_tokens body is a
    Messages body without `max_tokens`)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        text = str(exc)
        if "recursion" in text.lower():
            text = f"nested deeper than {max_depth} levels"
        raise InvalidRequest(f"The request body is not valid JSON: {text}",
                             code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    check_shape(data, max_depth, max_items)
    if endpoint == "chat":
        chat = _chat_request(data)
        if chat is not None:
            return data, chat
    try:
        parsed = (model or _MODELS[endpoint]).model_validate(data)
    except ValidationError as exc:
        raise _schema_error(exc) from None
    if isinstance(parsed, ChatCompletionRequest):
        return data, _chat_of(parsed)
    return data, parsed  # type: ignore[return-value]


def check_shape(data: object, max_depth: int, max_items: int) -> None:
    """Refuse absurd JSON before anything walks it recursively (pydantic, templates).

    Containers are told by exact type: orjson makes only dicts and lists, and a type identity
    test costs a fraction of `isinstance` against `dict | list` (a union built at every call).
    """
    stack: list[tuple[Any, int]] = [(data, 1)] if type(data) in _CONTAINERS else []
    items = 0
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise InvalidRequest(f"The request body's JSON is nested deeper than {max_depth} "
                                 "levels.", code="invalid_json")
        items += len(value)
        if items > max_items:
            raise InvalidRequest(f"The request body's JSON has more than {max_items} values.",
                                 code="invalid_json")
        for child in value.values() if type(value) is dict else value:
            if type(child) in _CONTAINERS:
                stack.append((child, depth + 1))


_CONTAINERS = frozenset({dict, list})


def _schema_error(exc: ValidationError) -> InvalidRequest:
    err = exc.errors(include_url=False)[0]
    param = loc_path(err["loc"])
    if err["type"] == "missing":
        message = f"'{param}' is a required property"
    else:
        message = f"Invalid value for '{param}': {err['msg']}"
        if "input" in err and not isinstance(err["input"], dict | list):
            message += f" (got {str(err['input'])[:80]!r})"
    return InvalidRequest(message, param=param, code="invalid_value")


def loc_path(loc: tuple[int | str, ...]) -> str:
    """('pools', 'long', 'backends', 1, 'url') -> 'pools.long.backends[1].url'.

    Pydantic puts the name of a union member in the location (e.g. 'str', 'list[int]'); those
    are not keys the user wrote, so they are dropped.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "function-after",
                         "function-before", "function-wrap", "tagged-union"})


# --- what the gateway reads of a request beyond its schema ---------------------------------

def client_deadline(headers: Mapping[bytes, bytes]) -> float | None:
    """A caller's own limit on queueing: x-gateway-max-queue-ms, or half the SDK's timeout.

    The official SDKs send their timeout as x-stainless-timeout (seconds); waiting longer than
    half of it in the queue leaves too little time to generate.
    """
    deadline = None
    ms = _seconds(headers.get(b"x-gateway-max-queue-ms"))
    if ms is not None:
        deadline = max(0.0, ms / 1000)
    sdk = _seconds(headers.get(b"x-stainless-timeout"))
    if sdk is not None:
        half = max(0.0, sdk / 2)
        deadline = half if deadline is None else min(deadline, half)
    return deadline


def _seconds(raw: bytes | None) -> float | None:
    """A number of a header, or None for anything that is not a finite number ('abc', 'nan',
    'inf' alike: none of them states a deadline)."""
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def template_kwargs(data: Mapping[str, Any]) -> dict[str, Any]:
    """The chat template's arguments as vLLM builds them from this body: the caller's
    `chat_template_kwargs` (refused where they would set what we set) under the request's
    own `add_generation_prompt`, `continue_final_message`, `documents` and `reasoning_effort`
    (gateway.tokens.templates.request_template_kwargs says how vLLM merges them)."""
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise InvalidRequest("'chat_template_kwargs' must be an object.",
                                 param="chat_template_kwargs", code="invalid_value")
        clash = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if clash:
            raise InvalidRequest(f"'chat_template_kwargs' may not set {', '.join(clash)}: the "
                                 "request's own fields set them.", param="chat_template_kwargs",
                                 code="invalid_value")
    # vLLM's request model types these fields; a wrong type is its 400, and ours before a 500.
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in data and not isinstance(data[name], bool):
            raise InvalidRequest(f"'{name}' must be a boolean.", param=name,
                                 code="invalid_value")
    effort = data.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise InvalidRequest("'reasoning_effort' must be a string.", param="reasoning_effort",
                             code="invalid_value")
    documents = data.get("documents")
    if documents is not None and not (isinstance(documents, list)
                                      and all(isinstance(d, dict) for d in documents)):
        raise InvalidRequest("'documents' must be a list of objects.", param="documents",
                             code="invalid_value")
    merged = request_template_kwargs(data)
    if merged.get("continue_final_message") and merged.get("add_generation_prompt"):
        # vLLM's validator (and transformers, for a default add_generation_prompt).
        raise InvalidRequest("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.",
                             param="continue_final_message", code="invalid_value")
    return merged


def endpoint_of(body: bytes) -> Endpoint:
    """Which endpoint's body `/gateway/estimate` was given (`?endpoint=` says it outright):
    `messages` is a chat; `prompt` a completion; `input` a Responses request when a field
    only that API has is set or its items are objects, else an embedding; `query` a rerank;
    a score's sides a score (a classification says so with `?endpoint=classify`)."""
    try:
        probe = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "chat"  # parse_request answers it with the standard 400
    if not isinstance(probe, dict) or "messages" in probe:
        return "chat"
    if "prompt" in probe:
        return "completions"
    if "query" in probe:
        return "rerank"
    if _SCORE_FIELDS.intersection(probe):
        return "score"
    if "input" in probe:
        items = probe["input"]
        if _RESPONSES_ONLY.intersection(probe) or (
                isinstance(items, list) and any(isinstance(i, dict) for i in items)):
            return "responses"
        return "embeddings"
    return "chat"


_RESPONSES_ONLY = frozenset({"instructions", "max_output_tokens", "previous_response_id",
                             "reasoning", "tools", "tool_choice", "store", "background",
                             "stream", "text", "truncation"})
_SCORE_FIELDS = frozenset({"text_1", "data_1", "queries"})
ENDPOINTS: frozenset[str] = frozenset({"chat", "completions", "responses", "embeddings",
                                       "rerank", "score", "classify", "messages"})


def responses_messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], bool]:
    """A Responses API input as the chat messages vLLM renders with the chat template
    (vllm/entrypoints/openai/serving_responses.py, `_construct_input_messages`): the
    instructions first as a system message, a string input as one user message, input items
    as messages. Function calls become assistant tool calls and their outputs tool messages,
    as vLLM's newer releases convert them; `exact` is False once such an item is met, since
    releases differ there."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages, True
    exact = True
    for item in req.input:
        if not isinstance(item, dict):
            raise InvalidRequest("'input' items must be objects.", param="input",
                                 code="invalid_value")
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            content = item.get("content")
            if isinstance(content, list):  # output_text is text the template renders alike
                content = [{**p, "type": "text"} if isinstance(p, dict) and p.get("type") in
                           ("input_text", "output_text") else p for p in content]
            messages.append({"role": item.get("role", "user"), "content": content})
        elif kind == "function_call":
            exact = False
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": item.get("call_id", ""), "type": "function",
                "function": {"name": item.get("name", ""),
                             "arguments": item.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            exact = False
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": str(item.get("output", ""))})
        else:
            exact = False  # reasoning and tool items: the engine decides what they render to
    return messages, exact
