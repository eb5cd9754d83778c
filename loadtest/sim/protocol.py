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

from gateway.cost.templates import request_template_kwargs

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                                   "param": param, "code": status}})


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


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
    # engine's count and the gateway's agree (gateway.cost.templates.request_template_kwargs).
    _bool_field(body, "add_generation_prompt")
    _bool_field(body, "continue_final_message")
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise bad_request("Cannot set both `continue_final_message` and "
                          "`add_generation_prompt` to True.")
    kwargs = request_template_kwargs(body)
    max_tokens = _int_field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    return _common(body, "chat", max_tokens, messages=messages, tools=tools,
                   template_kwargs=kwargs)


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
