"""An Anthropic Messages request as the chat request the engine renders from it.

vLLM serves `/v1/messages` by converting the body into a chat completion request and rendering
that with the model's chat template (vllm/entrypoints/anthropic/serving.py,
`to_chat_completion_request`, 0.32); the gateway counts the same chat request, so its count is
the engine's `usage.input_tokens` (plus what it reports as read from its cache). What vLLM does:

- the top-level `system` (a string, or text blocks joined with nothing between them) is the
  first message; Claude Code's `x-anthropic-billing-header` blocks are dropped (a per-request
  hash that would defeat prefix caching). A `system` message inside `messages` stays where it
  is, unless the template refuses a system message after the first (Qwen's `loop.first` guard:
  vLLM renders [system, user, system, user] once to find out): then its text joins the first;
- roles `ctx` and `msg` (newer Claude Code) are `user`;
- text blocks become text parts (one text part alone is a string content), `image` blocks
  image parts, `thinking` blocks the message's `reasoning`, `tool_use` blocks tool calls (the
  input as JSON arguments), a user's `tool_result` blocks `tool` messages after the user
  message (their text parts joined by newlines), an assistant's a text part
  "Tool result: ..."; a user message left with no content is dropped;
- tools become chat function tools: name, description (null when absent) and `input_schema` as
  `parameters` (with `"type": "object"` added where it has no type), `strict` when set;
- `output_config.effort` is the chat request's `reasoning_effort`, and `thinking: {"type":
  "disabled"}` sets it to "none" (vLLM tries "none" on the template once and takes "low" where
  the template ignores it; both render alike there, so the count is the same);
  `chat_template_kwargs` pass as they are.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.cost.errors import RequestCostError

_BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "ctx": "user",
          "msg": "user"}


@dataclass(frozen=True, slots=True)
class ChatForm:
    """The chat request vLLM renders for a Messages request."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    fields: dict[str, Any] = field(default_factory=dict)  # the template's request fields
    exact: bool = True  # False where the gateway does not convert as vLLM does


def chat_form(data: Mapping[str, Any], merge_inline_system: bool) -> ChatForm:
    """`data`, a Messages or count_tokens body that passed gateway/wire/anthropic.py's models, in
    the chat form vLLM renders. Raises RequestCostError for what the engine would refuse."""
    messages: list[dict[str, Any]] = []
    raw = data.get("messages") or []
    system = _system_text(data.get("system"))
    if merge_inline_system:
        system += "".join(_system_text(m.get("content")) for m in raw
                          if _role(m, 0) == "system")
    if system:
        messages.append({"role": "system", "content": system})
    exact = True
    for index, message in enumerate(raw):
        role = _role(message, index)
        content = message.get("content")
        if role == "system":
            text = _system_text(content)
            if text and not merge_inline_system:
                messages.append({"role": "system", "content": text})
            continue
        out: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            out["content"] = content
        else:
            exact = _blocks(content, role, out, messages) and exact
        if not (role == "user" and "content" not in out):
            messages.append(out)
    tools, tools_exact = _tools(data.get("tools"), raw)
    fields: dict[str, Any] = {}
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None:
        fields["chat_template_kwargs"] = kwargs
    config = data.get("output_config")
    if isinstance(config, Mapping) and config.get("effort") is not None:
        fields["reasoning_effort"] = config["effort"]
    thinking = data.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        fields["reasoning_effort"] = "none"
    return ChatForm(messages, tools, fields, exact and tools_exact)


def _role(message: Mapping[str, Any], index: int) -> str:
    role = _ROLES.get(message.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise RequestCostError(f"messages[{index}].role: must be 'user', 'assistant' or "
                               f"'system', got {message.get('role')!r}", "messages")
    return role


def _system_text(system: object) -> str:
    if isinstance(system, str):
        return "" if system.startswith(_BILLING_HEADER) else system
    if not isinstance(system, list):
        return ""
    return "".join(b["text"] for b in system
                   if isinstance(b, Mapping) and b.get("type") == "text"
                   and isinstance(b.get("text"), str) and b["text"]
                   and not b["text"].startswith(_BILLING_HEADER))


def _blocks(blocks: Sequence[Mapping[str, Any]], role: str, out: dict[str, Any],
            messages: list[dict[str, Any]]) -> bool:
    """A message's content blocks into `out`; tool results of a user message appended to
    `messages` first (they precede it, as in vLLM). False where a block's rendering is the
    engine's guess (a tool reference)."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    exact = True
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            if block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            if block.get("source"):
                parts.append({"type": "image_url",
                              "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking":
            if block.get("thinking") is not None:
                reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or "call_0", "type": "function",
                          "function": {"name": block.get("name") or "",
                                       "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            if role == "user":
                exact = _tool_result(block, messages) and exact
            else:
                text = str(block.get("content")) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {text}"})
        elif kind in ("redacted_thinking", "tool_reference"):
            pass
        elif kind in ("tool_addition", "tool_removal"):
            exact = False  # applied to the tools below, as far as the gateway follows
        else:
            raise RequestCostError(f"content block type {kind!r} is not supported", "messages")
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    if parts:
        out["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" \
            else parts
    return exact


def _tool_result(block: Mapping[str, Any], messages: list[dict[str, Any]]) -> bool:
    content = block.get("content")
    text = ""
    images: list[str] = []
    references = False
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(str(item.get("text", "")))
            elif kind == "image":
                images.append(_image_url(item.get("source") or {}))
            elif kind == "tool_reference":
                references = True
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if images:
        messages.append({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}} for url in images]})
    return not references  # a reference's tool message is the template's to render


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tools(tools: Sequence[Mapping[str, Any]] | None, messages: Sequence[Mapping[str, Any]]
           ) -> tuple[list[dict[str, Any]] | None, bool]:
    """Function tools as vLLM dumps them for the template (FunctionDefinition: name,
    description even when null, parameters, strict only when set)."""
    changes = any(isinstance(m.get("content"), list) and any(
        isinstance(b, Mapping) and b.get("type") in ("tool_addition", "tool_removal")
        for b in m["content"]) for m in messages)
    if tools is None:
        return None, not changes
    out: list[dict[str, Any]] = []
    for tool in tools:
        schema = dict(tool["input_schema"])
        if "type" not in schema:
            schema["type"] = "object"
        function: dict[str, Any] = {"name": tool["name"], "description": tool.get("description"),
                                    "parameters": schema}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out, not changes


# Per tokenizer: whether its template refuses a system message after the first (vLLM's
# `_detect_merge_inline_system`), found once.
_MERGE: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_PROBE = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
          {"role": "system", "content": "t"}, {"role": "user", "content": "t"}]


def merges_inline_system(tokenizer: object) -> bool:
    """Whether vLLM merges a Messages request's inline system messages into the first for this
    tokenizer's chat template: where rendering [system, user, system, user] fails (with or
    without tools), or there is no template to ask (a `none` tokenizer: vLLM's default)."""
    try:
        return _MERGE[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: asked each time
        return _probe(tokenizer)
    merge = _MERGE[tokenizer] = _probe(tokenizer)
    return merge


def _probe(tokenizer: object) -> bool:
    render = getattr(tokenizer, "render_chat", None)
    if render is None or not getattr(tokenizer, "has_chat_template", False):
        return True
    variants: tuple[list[Any] | None, ...] = (None, [])
    for tools in variants:
        try:
            render(_PROBE, tools, add_generation_prompt=False)
        except (RequestCostError, TypeError, ValueError):
            return True
    return False
