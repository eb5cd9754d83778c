"""Chat templates rendered exactly as `transformers` renders them, without importing it.

The engine (vLLM, SGLang) renders a request's messages with the model's Jinja chat template and
`transformers`' environment; a count is only exact if we render the same bytes. So the
environment below copies `transformers.utils.chat_template_utils._cached_compile_jinja_template`:
an `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `{% generation %}` tag, `raise_exception`, `strftime_now`, a `tojson` filter that
does not escape HTML or non-ASCII, and the sandboxed `dict`/`namespace` globals. The message
preparation copies `apply_chat_template`: keys whose value is None are dropped, reasoning fields are
aliased, and the tokenizer's special tokens are visible to the template.

`openai_messages` is the extra step vLLM applies to an OpenAI request before templating (content
parts joined, tool-call arguments parsed as JSON): call it on a request body's messages so the
count is the engine's. `request_template_kwargs` is the other half: the request fields vLLM
hands the template beside `chat_template_kwargs` (`add_generation_prompt`,
`continue_final_message`, `documents`, `reasoning_effort`).

`load_chat_template` reads a template a policy names apart from its tokenizer: one of the
models' own templates shipped in `chat_templates/` (provenance in its README), or a file.
"""

from __future__ import annotations

import json
import types
import weakref
from collections.abc import Mapping, Sequence
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.cost.errors import TemplateError

# The names a message's reasoning arrives under; transformers copies it under the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# The models' own templates shipped in gateway/tokens/chat_templates/ (README: where each text
# comes from). Llama 3.3 70B Instruct carries Llama 3.1's template unchanged.
BUILTIN_TEMPLATES = {
    "qwen2.5": "qwen2.5.jinja",
    "llama-3": "llama-3.jinja",
    "llama-3.1": "llama-3.1.jinja",
    "llama-3.3": "llama-3.1.jinja",
}

# transformers' marker for continue_final_message: appended to the final message, found in the
# rendered text, and everything from it on cut, so the template's end-of-turn is not counted.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant tokens for training masks.

    Counting never needs the mask, but templates that use the tag must still compile.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja reads this class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    # The template's `dict` builds plain dicts but exposes nothing else of the type.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Like transformers: namespaces refuse underscore names, a route to CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )


# Names Python resolves as attributes on a dict; any other name on a dict is a key lookup.
_DICT_ATTRS = frozenset(dir(dict))
# Public str methods the sandbox allows as they are; format/format_map it wraps, so not these.
_STR_METHODS = frozenset(a for a in dir(str) if not a.startswith("_")) - {"format", "format_map"}


_MISSING = object()


class _Sandbox(ImmutableSandboxedEnvironment):
    """The same sandbox, with the two lookups chat templates do all the time made cheap.

    `message.content` on a plain dict and `content.startswith` on a str go through attribute
    lookup, an AttributeError, and the mutability checks: ~2 us each, ~1 ms for a 70-message
    history. The fast paths return exactly what the sandbox would (a dict key that is not a dict
    attribute; a public str method the sandbox deems safe) and defer to it for everything else.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRS and attribute in obj:
            return obj[attribute]
        if kind is str and attribute in _STR_METHODS:
            return getattr(obj, attribute)
        if kind in _DATA_HOLDERS and not attribute.startswith("_"):
            # `ns.flag`, `loop.index0`: the sandbox allows any public attribute of these; only a
            # callable value (which it might wrap) takes the full path.
            value = getattr(obj, attribute, _MISSING)
            if value is not _MISSING and not callable(value):
                return value
        return super().getattr(obj, attribute)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any,
             *args: Any, **kwargs: Any) -> Any:
        # A public str method as `getattr` above hands it out (`content.split(...)`): the
        # sandbox finds it safe to call and its context calls it as it is (a builtin takes no
        # context; the loop's and block's variables the compiled code passes along are
        # dropped), ~2 us of checks a call. Anything else takes the full path.
        if type(__obj) is types.BuiltinMethodType and type(__obj.__self__) is str \
                and __obj.__name__ in _STR_METHODS:
            kwargs.pop("_loop_vars", None)
            kwargs.pop("_block_vars", None)
            return __obj(*args, **kwargs)
        return super().call(__context, __obj, *args, **kwargs)


_DATA_HOLDERS = frozenset({_TemplateNamespace, jinja2.runtime.LoopContext})


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and quotes for HTML; transformers' does not, and a
    # single escaped character changes the token count.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once; rendering the compiled template is the per-request cost."""
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile: {exc} (line {exc.lineno})") from None


# Each compiled template's globals as one plain dict, made once.
_GLOBALS: weakref.WeakKeyDictionary[jinja2.Template, dict[str, Any]] = \
    weakref.WeakKeyDictionary()


def _render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """`template.render(**variables)`, less the context's set-up: `render` copies the template's
    globals out of a ChainMap (Python code, a lookup per name) into a new dict on every call,
    ~20 us of a short chat's render here, and the context reads it once more for the names.
    Here that copy is made once and each render gets one dict merge; what runs and what it
    raises are the same (render only rewrites the traceback of what the template raised)."""
    flat = _GLOBALS.get(template)
    if flat is None:
        flat = _GLOBALS[template] = dict(template.globals)
    env = template.environment
    # The context as `new_context` makes it, given the flat globals where it would read the
    # ChainMap again (for the names of the globals: a set of the same keys).
    context = env.context_class(env, {**flat, **variables}, template.name, template.blocks,
                                globals=flat)
    return env.concat(template.root_render_func(context))


def select_template(templates: str | Mapping[str, str], has_tools: bool) -> str:
    """Pick the template transformers would: a named set prefers `tool_use` when tools are given."""
    if isinstance(templates, str):
        return templates
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise TemplateError(
        f"tokenizer has several chat templates and no 'default': {sorted(templates)}"
    )


def plain(value: Any) -> Any:
    """The value rebuilt out of JSON types, so the sandboxed template sees no foreign objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What `apply_chat_template` does to messages before rendering (transformers 5.x).

    Keys with None values are dropped (OpenAI clients send `content: null` beside tool calls,
    and templates handle a missing key better than a literal None), and reasoning is aliased.
    """
    prepared: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(
                f"messages[{index}]: must be an object, got {type(message).__name__}"
            )
        copy = {str(k): plain(v) for k, v in message.items() if v is not None}
        reasoning = next((copy[k] for k in _REASONING_FIELDS if copy.get(k) is not None), None)
        if reasoning is not None:
            copy = {"thinking": reasoning, **copy, "reasoning_content": reasoning}
        prepared.append(copy)
    return prepared


def template_variables(special_tokens: Mapping[str, str],
                       template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The variables a render sees beside messages, tools and add_generation_prompt."""
    # Caller kwargs override special tokens and `documents`, as in transformers (and vLLM,
    # which updates its own template arguments with the caller's).
    return {**special_tokens, "documents": None, **plain(template_kwargs)}


def render(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    continue_final_message: bool | str = False,
    **template_kwargs: Any,
) -> str:
    """Render one conversation to the text the engine will encode.

    `continue_final_message` (True, or the name of the field to continue) leaves the last
    message open, as `apply_chat_template` does: the template's end-of-turn after it is cut.
    """
    if not messages:
        raise TemplateError("messages: must not be empty")
    if continue_final_message and add_generation_prompt:
        # transformers refuses the pair (vLLM answers it 400); both would count a new turn.
        raise TemplateError("continue_final_message and add_generation_prompt are not "
                            "compatible: set add_generation_prompt to false")
    variables = template_variables(special_tokens, template_kwargs)
    prepared = prepare_messages(messages)
    final = _tag_final_message(prepared, continue_final_message) \
        if continue_final_message else None
    try:
        text = _render(template, {
            **variables,
            "messages": prepared,
            "tools": plain(list(tools)) if tools is not None else None,
            "add_generation_prompt": add_generation_prompt,
        })
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateError(f"chat template failed on these messages: {exc}") from None
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        # A template that indexes a missing field fails with a Python error; the request is bad.
        raise TemplateError(f"chat template failed on these messages: {exc}") from None
    return text if final is None else _cut_at_tag(text, final)


def continued_field(continue_final_message: bool | str) -> str:
    """The message field `continue_final_message` continues ("content" for True)."""
    return continue_final_message if isinstance(continue_final_message, str) else "content"


def _tag_final_message(messages: list[dict[str, Any]], continue_final_message: bool | str
                       ) -> str:
    """Mark the end of the final message as transformers does; return its text before the tag."""
    field = continued_field(continue_final_message)
    last = messages[-1]
    final = last.get(field)
    if final is None:
        raise TemplateError(f"continue_final_message: the final message has no {field!r} "
                            "to continue")
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in _REASONING_FIELDS if last.get(f) == final]
    if isinstance(final, list):
        for block in reversed(final):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                text = str(block["text"])
                block["text"] = text + _CONTINUE_TAG
                return text
        raise TemplateError("continue_final_message: the final message has no text to "
                            "continue")
    if not isinstance(final, str):
        raise TemplateError(f"continue_final_message: the final message's {field!r} must be "
                            "text")
    for f in fields:
        last[f] = final + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TemplateError("continue_final_message: the chat template drops part of the final "
                            "message, so it cannot be continued")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing spacing


def load_chat_template(spec: str) -> str:
    """The template text a policy names: a built-in name, or a file.

    A file is a Jinja template, or a JSON file holding a string `chat_template` (a
    `tokenizer_config.json` or `chat_template.json`). Raises TemplateError naming what it tried.
    """
    name = spec.strip()
    builtin = BUILTIN_TEMPLATES.get(name)
    if builtin is not None:
        return resources.files("gateway.tokens").joinpath("chat_templates", builtin) \
            .read_text(encoding="utf-8")
    path = Path(name).expanduser()
    if not path.is_file():
        raise TemplateError(f"chat template {spec!r}: not a built-in name "
                            f"({', '.join(sorted(BUILTIN_TEMPLATES))}) and not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"chat template {spec!r}: cannot read: {exc}") from None
    if path.suffix == ".json":
        try:
            found = json.loads(text).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            found = None
        if not isinstance(found, str):
            raise TemplateError(f"chat template {spec!r}: a JSON file needs a string "
                                "'chat_template'")
        return found
    return text


# vLLM's chat request fields that reach the template beside `chat_template_kwargs`
# (vllm/entrypoints/openai/chat_completion/protocol.py, ChatCompletionRequest.
# build_chat_params), with vLLM's defaults.
REQUEST_TEMPLATE_FIELDS: Mapping[str, Any] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "documents": None,
    "reasoning_effort": None,
}


_TEMPLATE_KEYS = frozenset({"chat_template_kwargs", *REQUEST_TEMPLATE_FIELDS})
_DEFAULT_TEMPLATE_KWARGS = {k: v for k, v in REQUEST_TEMPLATE_FIELDS.items() if v is not None}


def request_template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template arguments vLLM builds from a chat request body (fields already validated).

    vLLM merges its fields over the caller's `chat_template_kwargs` (vllm/renderers/params.py
    `merge_kwargs`): a field wins unless it is unset (None or "auto"), so a kwarg
    `add_generation_prompt` never beats the field's default. A `reasoning_effort` also sets
    `enable_thinking` (false for "none") unless the caller's kwargs set it.
    """
    if _TEMPLATE_KEYS.isdisjoint(body):  # most requests set none of them: vLLM's defaults
        return dict(_DEFAULT_TEMPLATE_KWARGS)
    user = body.get("chat_template_kwargs")
    kwargs: dict[str, Any] = dict(user) if isinstance(user, Mapping) else {}
    fields = {name: body.get(name, default) for name, default in REQUEST_TEMPLATE_FIELDS.items()}
    effort = fields["reasoning_effort"]
    if effort is not None and "enable_thinking" not in kwargs:
        fields["enable_thinking"] = effort != "none"
    kwargs.update({k: v for k, v in fields.items() if v is not None and not
                   (isinstance(v, str) and v == "auto")})
    return kwargs


def openai_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages of an OpenAI chat request as vLLM hands them to the template.

    vLLM turns null content into "", joins the text parts of list content with newlines (for
    string-content templates such as Qwen's) and parses each assistant tool call's JSON
    `arguments` into an object, which the template then re-serialises with `tojson`; counting
    the unparsed string would be off by the spacing difference.
    """
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if type(message) is dict and type(message.get("content")) is str \
                and "tool_calls" not in message:
            # Nothing to normalise (most messages): the request's own dict, which nothing
            # writes to from here on, rather than a copy (~2 us a message, run cold).
            out.append(message)
            continue
        # A dict by identity first: an ABC's isinstance per message costs more, run cold.
        if type(message) is not dict and not isinstance(message, Mapping):
            raise TemplateError(
                f"messages[{index}]: must be an object, got {type(message).__name__}"
            )
        msg = dict(message)
        content = msg.get("content")
        if content is None:
            # vLLM parses a missing or null content as no parts, joined: the empty string.
            msg["content"] = ""
        elif isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text"):
                    texts.append(str(part.get("text", "")))
                else:
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise TemplateError(
                        f"messages[{index}].content: part type {kind!r} is not supported "
                        "(text-only model)"
                    )
            msg["content"] = "\n".join(texts)
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and isinstance(calls, list):
            parsed_calls: list[Any] = []
            for call in calls:
                call = dict(call) if isinstance(call, Mapping) else call
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                    function = dict(function)
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        raise TemplateError(
                            f"messages[{index}].tool_calls: arguments must be a JSON object string"
                        ) from None
                    call["function"] = function
                parsed_calls.append(call)
            msg["tool_calls"] = parsed_calls
        out.append(msg)
    return out
