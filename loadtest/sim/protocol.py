"""Reading OpenAI request bodies and writing errors, the way vLLM's OpenAI server does.

Only the fields that change what the engine does are read; unknown fields pass, as vLLM's
request models allow. Errors use vLLM's body, OpenAI's shape with vLLM's type names and the HTTP
status as `code`:

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

Messages follow vLLM (pydantic validation errors for malformed fields, `SamplingParams` checks,
the context-length check of `OpenAIServing._validate_input`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from gateway.tokens.templates import request_template_kwargs
from loadtest.sim.multimodal import ImageError, ImageKeys, split_images

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class ApiError(Exception):
    """An error answer; `kind` overrides the body's `type` (vLLM's Responses API answers some
    errors with OpenAI's `invalid_request_error`)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.kind)


def error_body(status: int, message: str, param: str | None = None,
               kind: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message,
                                   "type": kind or ERROR_TYPES.get(status, "Error"),
                                   "param": param, "code": status}})


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def check_model(model: str | None, served_model_name: str) -> None:
    """vLLM's `_check_model`: a request may name the served model, or none."""
    if model is not None and model != served_model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")


def _validation_error(kind: str, loc: str, msg: str, value: object = None) -> ApiError:
    # vLLM answers request-model validation failures with str() of FastAPI's error list.
    detail: dict[str, object] = {"type": kind, "loc": ("body", loc), "msg": msg}
    if value is not None:
        detail["input"] = value
    return bad_request(f"1 validation error:\n  {detail!r}", loc)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Literal["chat", "completion"]
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    prefix_hash_ids: list[int] | None = None
    # Chat image parts, taken out of `messages` (loadtest.sim.multimodal): each costs
    # the engine's image tokens.
    images: ImageKeys = ()


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _validation_error("json_invalid", "body", f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _validation_error("model_attributes_type", "body", "Input should be a valid "
                                "dictionary or object to extract fields from")
    return body


def parse_chat(body: Mapping[str, Any]) -> ParsedRequest:
    if "messages" not in body:
        raise _validation_error("missing", "messages", "Field required")
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise _validation_error("list_type", "messages", "Input should be a valid list")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise _validation_error("list_type", "tools", "Input should be a valid list")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _validation_error("dict_type", "chat_template_kwargs",
                                "Input should be a valid dictionary")
    # The request fields vLLM passes to the template too, merged as vLLM merges them, so the
    # engine's count and the gateway's agree (gateway.tokens.templates.request_template_kwargs).
    _bool_field(body, "add_generation_prompt")
    _bool_field(body, "continue_final_message")
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise bad_request("Cannot set both `continue_final_message` and "
                          "`add_generation_prompt` to True.")
    kwargs = request_template_kwargs(body)
    max_tokens = _int_field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    try:
        messages, images = split_images(messages)
    except ImageError as exc:
        raise bad_request(str(exc), exc.param) from None
    return _common(body, "chat", max_tokens, messages=messages, tools=tools,
                   template_kwargs=kwargs, images=images)


def parse_completion(body: Mapping[str, Any]) -> ParsedRequest:
    if "prompt" not in body:
        raise _validation_error("missing", "prompt", "Field required")
    prompt = body["prompt"]
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = prompt
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("batched prompts (a list of several prompts) are not supported by "
                          "the simulator; send one request per prompt", "prompt")
    else:
        raise bad_request("prompt: must be a string, a list of token ids, or a list holding "
                          "one of those", "prompt")
    return _common(body, "completion", _int_field(body, "max_tokens"), prompt_text=text,
                   prompt_ids=ids)


def _common(body: Mapping[str, Any], kind: Literal["chat", "completion"], max_tokens: int | None,
            **fields: Any) -> ParsedRequest:
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    min_tokens = _int_field(body, "min_tokens") or 0
    if min_tokens < 0:
        raise bad_request(f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
                          "min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                          f"got {min_tokens}.", "min_tokens")
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request("n: only n=1 is supported by the simulator", "n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _validation_error("string_type", "model", "Input should be a valid string")
    return ParsedRequest(kind=kind, model=model, stream=stream, include_usage=include_usage,
                         max_tokens=max_tokens, min_tokens=min_tokens,
                         ignore_eos=_bool_field(body, "ignore_eos"),
                         prefix_hash_ids=_prefix_hash_ids(body), **fields)


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool):
        raise _validation_error("int_type", name, "Input should be a valid integer", value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)  # pydantic's lax mode accepts 5.0
        raise _validation_error("int_from_float", name,
                                "Input should be a valid integer, got a number with a "
                                "fractional part", value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        raise _validation_error("int_parsing", name,
                                "Input should be a valid integer, unable to parse string as an "
                                "integer", value)
    raise _validation_error("int_type", name, "Input should be a valid integer", value)


def _bool_field(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _validation_error("bool_type", name, "Input should be a valid boolean", value)
    return value


def _prefix_hash_ids(body: Mapping[str, Any]) -> list[int] | None:
    """`prefix_hash_ids` at the top level or inside `vllm_xargs` (vLLM's extension dict)."""
    value = body.get("prefix_hash_ids")
    xargs = body.get("vllm_xargs")
    if value is None and isinstance(xargs, dict):
        value = xargs.get("prefix_hash_ids")
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise bad_request("prefix_hash_ids: must be a list of integers", "prefix_hash_ids")
    return value


def context_length_error(max_model_len: int, prompt_tokens: int,
                         max_tokens: int | None) -> ApiError | None:
    """vLLM's check: the prompt must leave room, and prompt + max_tokens must fit."""
    if prompt_tokens >= max_model_len:
        return bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_tokens} input tokens. Please reduce the length of the input "
            "messages.", "messages")
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        return bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens}).",
            "max_tokens")
    return None


# -- the other endpoints' request models (vLLM's ResponsesRequest, EmbeddingRequest,
# TokenizeRequest, DetokenizeRequest): the fields that change what the engine does, checked as
# pydantic would; the rest pass.

def _value_error(msg: str) -> ApiError:
    """A model validator's ValueError, in vLLM's validation-error text."""
    detail = {"type": "value_error", "loc": ("body",), "msg": f"Value error, {msg}"}
    return bad_request(f"1 validation error:\n  {detail!r}")


def _str_field(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _validation_error("string_type", name, "Input should be a valid string", value)
    return value


def _dict_field(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise _validation_error("dict_type", name, "Input should be a valid dictionary", value)
    return value


def _float_field(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _validation_error("float_type", name, "Input should be a valid number", value)
    return float(value)


def _dict_list(body: Mapping[str, Any], name: str) -> list[dict[str, Any]] | None:
    value = body.get(name)
    if value is not None and not (isinstance(value, list)
                                  and all(isinstance(v, dict) for v in value)):
        raise _validation_error("list_type", name, "Input should be a valid list")
    return value


def _model(body: Mapping[str, Any]) -> str | None:
    return _str_field(body, "model")


def _token_ids(value: object) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


@dataclass(frozen=True, slots=True)
class ResponsesParsed:
    """A `POST /v1/responses` body (vLLM's ResponsesRequest)."""

    model: str | None
    input: str | list[dict[str, Any]]
    instructions: str | None
    max_output_tokens: int | None
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    tools: list[dict[str, Any]]
    reasoning: dict[str, Any] | None
    request_id: str | None
    ignore_eos: bool
    truncation: str
    prefix_hash_ids: list[int] | None
    # Fields the Response object echoes (ResponsesResponse.from_request), as sent or defaulted.
    echo: dict[str, Any] = field(default_factory=dict)


def parse_responses(body: Mapping[str, Any]) -> ResponsesParsed:
    if "input" not in body:
        raise _validation_error("missing", "input", "Field required")
    value = body["input"]
    if not isinstance(value, str) and not (isinstance(value, list)
                                           and all(isinstance(i, dict) for i in value)):
        raise _validation_error("union_type", "input",
                                "Input should be a valid string or a list of input items")
    background = _bool_field(body, "background")
    store = body.get("store", True)
    if store is not None and not isinstance(store, bool):
        raise _validation_error("bool_type", "store", "Input should be a valid boolean", store)
    if background and not store:
        raise _value_error("background can only be used when `store` is true")
    if body.get("prompt") is not None:
        raise bad_request("prompt template is not supported", "prompt")
    max_output_tokens = _int_field(body, "max_output_tokens")
    if max_output_tokens is not None and max_output_tokens < 1:
        # vLLM passes it on to SamplingParams, whose check this is.
        raise bad_request(f"max_tokens must be at least 1, got {max_output_tokens}.",
                          "max_output_tokens")
    tools = _dict_list(body, "tools") or []
    for index, tool in enumerate(tools):
        if not isinstance(tool.get("type"), str):
            raise _validation_error("missing", f"tools.{index}.type", "Field required")
        if tool["type"] == "function" and not isinstance(tool.get("name"), str):
            raise _validation_error("missing", f"tools.{index}.function.name", "Field required")
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise _validation_error("literal_error", "truncation",
                                "Input should be 'auto' or 'disabled'", truncation)
    include = body.get("include")
    top_logprobs = _int_field(body, "top_logprobs")
    logprobs = isinstance(include, list) and "message.output_text.logprobs" in include
    parallel = body.get("parallel_tool_calls", True)
    echo = {
        "metadata": _dict_field(body, "metadata"),
        "temperature": _float_field(body, "temperature"),
        "top_p": _float_field(body, "top_p"),
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": True if parallel is None else bool(parallel),
        "max_tool_calls": _int_field(body, "max_tool_calls"),
        "service_tier": _str_field(body, "service_tier") or "auto",
        "text": _dict_field(body, "text"),
        "user": _str_field(body, "user"),
        "top_logprobs": (top_logprobs or 0) if logprobs else None,
    }
    return ResponsesParsed(
        model=_model(body), input=value, instructions=_str_field(body, "instructions"),
        max_output_tokens=max_output_tokens, stream=_bool_field(body, "stream"),
        store=bool(store), background=background,
        previous_response_id=_str_field(body, "previous_response_id"), tools=tools,
        reasoning=_dict_field(body, "reasoning"), request_id=_str_field(body, "request_id"),
        ignore_eos=_bool_field(body, "ignore_eos"), truncation=truncation,
        prefix_hash_ids=_prefix_hash_ids(body), echo=echo)


EMBED_DTYPES = ("float32", "float16", "bfloat16")
ENDIANNESS = ("native", "little", "big")


@dataclass(frozen=True, slots=True)
class EmbeddingsParsed:
    """A `POST /v1/embeddings` body: vLLM's EmbeddingCompletionRequest (`input`) or
    EmbeddingChatRequest (`messages`)."""

    model: str | None
    prompts: list[str | list[int]]  # one engine request each; empty for a chat request
    messages: list[dict[str, Any]] | None
    encoding_format: str
    embed_dtype: str
    endianness: str
    dimensions: int | None
    add_special_tokens: bool
    truncate_prompt_tokens: int | None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    images: ImageKeys = ()


def parse_embeddings(body: Mapping[str, Any]) -> EmbeddingsParsed:
    messages: list[dict[str, Any]] | None = None
    prompts: list[str | list[int]] = []
    images: ImageKeys = ()
    kwargs: dict[str, Any] = {}
    if "messages" in body:
        messages = _dict_list(body, "messages")
        if not messages:
            raise _validation_error("list_type", "messages", "Input should be a valid list")
        try:
            messages, images = split_images(messages)
        except ImageError as exc:
            raise bad_request(str(exc), exc.param) from None
        kwargs = dict(_dict_field(body, "chat_template_kwargs") or {})
        kwargs["add_generation_prompt"] = _bool_field(body, "add_generation_prompt")
        special_default = False
    elif "input" not in body:
        raise _validation_error("missing", "input", "Field required")
    else:
        value = body["input"]
        if isinstance(value, str):
            prompts = [value]
        elif _token_ids(value):
            prompts = [list(value)]
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            prompts = list(value)
        elif isinstance(value, list) and value and all(_token_ids(v) for v in value):
            prompts = [list(v) for v in value]
        else:
            raise bad_request("input: must be a string, a list of strings, a list of token ids, "
                              "or a list of lists of token ids (none of them empty)", "input")
        special_default = True
    encoding = body.get("encoding_format") or "float"
    if encoding in ("bytes", "bytes_only"):
        raise bad_request(f"encoding_format {encoding!r} is not supported by the simulator; "
                          "use 'float' or 'base64'", "encoding_format")
    if encoding not in ("float", "base64"):
        raise _validation_error("literal_error", "encoding_format",
                                "Input should be 'float', 'base64', 'bytes' or 'bytes_only'",
                                encoding)
    dtype = body.get("embed_dtype") or "float32"
    if dtype not in EMBED_DTYPES:
        raise bad_request(f"embed_dtype {dtype!r} is not supported by the simulator; use one "
                          f"of {', '.join(EMBED_DTYPES)}", "embed_dtype")
    endianness = body.get("endianness") or "native"
    if endianness not in ENDIANNESS:
        raise _validation_error("literal_error", "endianness",
                                "Input should be 'native', 'little' or 'big'", endianness)
    special = body.get("add_special_tokens", special_default)
    truncate = _int_field(body, "truncate_prompt_tokens")
    if truncate is not None and truncate < -1:
        raise _validation_error("greater_than_equal", "truncate_prompt_tokens",
                                "Input should be greater than or equal to -1", truncate)
    return EmbeddingsParsed(
        model=_model(body), prompts=prompts, messages=messages, encoding_format=encoding,
        embed_dtype=dtype, endianness=endianness, dimensions=_int_field(body, "dimensions"),
        add_special_tokens=bool(special), truncate_prompt_tokens=truncate,
        template_kwargs=kwargs, images=images)


@dataclass(frozen=True, slots=True)
class TokenizeParsed:
    """A `POST /tokenize` body: TokenizeCompletionRequest or TokenizeChatRequest."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    add_special_tokens: bool
    return_token_strs: bool
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_tokenize(body: Mapping[str, Any]) -> TokenizeParsed:
    if "messages" in body:
        messages = _dict_list(body, "messages")
        if messages is None:
            raise _validation_error("list_type", "messages", "Input should be a valid list")
        generation = body.get("add_generation_prompt", True)
        continue_final = _bool_field(body, "continue_final_message")
        if continue_final and generation:
            raise bad_request("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.")
        kwargs = dict(_dict_field(body, "chat_template_kwargs") or {})
        kwargs["add_generation_prompt"] = bool(generation)
        return TokenizeParsed(
            model=_model(body), prompt=None, messages=messages, tools=_dict_list(body, "tools"),
            add_special_tokens=bool(body.get("add_special_tokens", False)),
            return_token_strs=bool(body.get("return_token_strs")), template_kwargs=kwargs)
    if "prompt" not in body:
        raise _validation_error("missing", "prompt", "Field required")
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise _validation_error("string_type", "prompt", "Input should be a valid string", prompt)
    return TokenizeParsed(model=_model(body), prompt=prompt, messages=None, tools=None,
                          add_special_tokens=bool(body.get("add_special_tokens", True)),
                          return_token_strs=bool(body.get("return_token_strs")))


def parse_detokenize(body: Mapping[str, Any]) -> tuple[str | None, list[int]]:
    """(model, tokens) of a `POST /detokenize` body."""
    if "tokens" not in body:
        raise _validation_error("missing", "tokens", "Field required")
    tokens = body["tokens"]
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _validation_error("list_type", "tokens", "Input should be a valid list")
    for index, token in enumerate(tokens):
        if token < 0:
            raise _validation_error("greater_than_equal", f"tokens.{index}",
                                    "Input should be greater than or equal to 0", token)
    return _model(body), list(tokens)
