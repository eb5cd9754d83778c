"""Byte-level BPE by merge rank (tiktoken's encoder) where it is the Hugging Face encoding.

Counting is the gateway's largest per-request cost for long prompts, and the Hugging Face
encoder is slow at it: it builds an `Encoding` (token strings, offsets, masks) for every call.
tiktoken's encoder only splits, looks up and merges, and returns ids: on this machine 7-11x
faster for the benchmark's prompts (a 16K-token message 77 -> 7 ms on a loaded machine, a
30-token one 126 -> 17 us). Vocabularies made the tiktoken way (Qwen's, Llama 3's: one merge
per token, token id = merge rank) encode to the same ids under both algorithms, so the gateway
uses it for those and keeps the Hugging Face encoder for everything else.

`build(data)` decides from the tokenizer.json whether the two encodings are the same, and says
why not when they are not:
- the model is BPE without dropout, byte fallback, subword prefix or word suffix;
- every one of the 256 bytes is a token and every other token is one merge's result, the merges
  in id order (so "merge first" and "lowest rank first" are one rule);
- the normalizer is none or NFC (applied here with `unicodedata`);
- the pre-tokenizer is a regex Split (Isolated) then ByteLevel without its own regex or prefix
  space, or ByteLevel alone with GPT-2's regex;
- a probe text of many scripts and whitespace shapes encodes to the same ids both ways.
The caller must cut the added tokens out first (the tokenizer's splitter does): the Hugging Face
encoder matches them anywhere in the text, this one does not.

What the checks cannot prove, that tiktoken never merges a pair the merges list lacks, was
measured instead: 31.9M tokens of source code and documentation cut at the special tokens,
plus 40,000 random strings of letters, digits, CJK, emoji, combining marks and odd whitespace:
no difference with Qwen's files. `RankSlot` also re-encodes one encoded piece in
`CANARY_EVERY` with the Hugging Face encoder, in a thread of its own, and stops using this one
at the first difference (the pieces encoded before it noticed keep the ids they got).

tiktoken merges a pre-token in time quadratic in its bytes (a linear scan per merge); the
Hugging Face encoder is linear. A pre-token lies within a run of letters, digits, punctuation
or whitespace (plus one leading character and trailing newlines), so texts with such a run of
`MAX_RUN_BYTES` or more go to the Hugging Face encoder: at 2,048 bytes tiktoken's worst case
(one repeated letter) still costs less per byte than the Hugging Face encoder's usual. Code,
minified JSON and base64 pass (their runs are short); one 2,048-byte word, or a paragraph of
CJK text with no ASCII between (its characters are of unknown class here), does not.
"""

from __future__ import annotations

import logging
import threading
import unicodedata
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import orjson

from gateway.tokens.memory import trim
from gateway.tokens.threads import below_the_loop

log = logging.getLogger("gateway.tokens")

# One encoded piece in this many is encoded again by the Hugging Face encoder when the rank
# encoder did it: a difference switches that tokenizer back for good.
CANARY_EVERY = 256

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MAX_RUN_BYTES = 2048

# A pre-token of these regexes lies within a run of letters, of digits, of punctuation or of
# whitespace (plus one leading character and trailing newlines). One table per class maps its
# ASCII bytes, every non-ASCII byte (a character of any class) and the ASCII control bytes (to
# be safe) to 1, the rest to 0: a run of MAX_RUN_BYTES ones in any translation is a pre-token
# that may be that long. The guard decides only which encoder does the work, never the ids.
_ASCII_CLASSES = (
    bytes(range(0x41, 0x5B)) + bytes(range(0x61, 0x7B)),  # letters
    bytes(range(0x30, 0x3A)),  # digits
    bytes(b for b in range(0x21, 0x7F) if not chr(b).isalnum()),  # punctuation and symbols
    b" \t\n\r\x0b\x0c",  # whitespace
)
_ANY_CLASS = bytes(b for b in range(256) if b >= 0x80 or b < 0x09 or 0x0E <= b < 0x20
                   or b == 0x7F)
_TABLES = tuple(bytes(1 if b in members or b in _ANY_CLASS else 0 for b in range(256))
                for members in _ASCII_CLASSES)
_LONG_RUN = b"\x01" * MAX_RUN_BYTES
# First the cheap test prose passes: ASCII whitespace to 1, every other byte to 0, and no run of
# either as long; only a text that fails it (code, JSON, base64, CJK) pays for the four above.
_SPACES = bytes(1 if b in b" \t\n\r\x0b\x0c" else 0 for b in range(256))
_LONG_GAP = b"\x00" * MAX_RUN_BYTES

PROBE = (
    "Hello, world! It's 2026-12-01; we'll see: x=3.14159, y = [1, 22, 333, 4444].\n"
    "  indented\tline\r\n\r\n\n   trailing   \n"
    "def f(a, b):\n    return a ** b  # comment\n\n"
    "I'M HERE, you're THERE, they'VE gone. don't\n"
    "¿Qué tal? Ça va, naïve café, straße, ÆØÅ æøå, Ελληνικά, кириллица, עברית, العربية.\n"
    "中文测试\uff0c这是一个句子\u3002日本語のテキスト\u3001カタカナ\u3002한국어 문장입니다.\n"
    "emoji 😀🎉👍🏽 ❤️‍🔥 🇨🇳 and ①②③ ½ ² Ⅳ\u00a0nbsp\u3000ideographic\u2028line\u2029para\n"
    "e\u0301 combining, A\u030a ring, decomposed\u0308 marks; ﬁ ligature; ǅ title.\n"
    "<html><body class=\"x\">&amp;&lt;</body></html> {\"json\": [true, null, -1e-9]}\n"
    "https://example.com/path?q=1&r=two#frag    ----====****____....!!!???\n"
)


def _byte_decoder() -> dict[int, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(chars, printable, strict=True))


class OrdinaryEncoder(Protocol):
    """What the rank encoder uses of a `tiktoken.Encoding`: its public `encode_ordinary`."""

    def encode_ordinary(self, text: str) -> list[int]: ...


class RankBPE:
    """tiktoken's encoder over a Hugging Face vocabulary shown to encode the same."""

    def __init__(self, encoding: OrdinaryEncoder, nfc: bool) -> None:
        self._encoding = encoding
        self._nfc = nfc

    def fits(self, text: str) -> bool:
        """Whether `text` is within the quadratic guard (and is encodable UTF-8)."""
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: the Hugging Face encoder decides
            return False
        if len(raw) < MAX_RUN_BYTES:
            return True
        spaces = raw.translate(_SPACES)
        if _LONG_RUN not in spaces and _LONG_GAP not in spaces:
            return True
        return all(_LONG_RUN not in raw.translate(table) for table in _TABLES)

    def encode(self, text: str) -> list[int]:
        """Ids of text holding no added token; releases the GIL for the Rust work."""
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        return self._encoding.encode_ordinary(text)


# Rank encoders built in this process, by tokenizer.json (path, size, mtime): tokenizers loaded
# from one file share one, built once.
_BUILT: dict[tuple[str, int, int], tuple[RankBPE | None, str]] = {}
_BUILD_LOCK = threading.Lock()
# Where the canary's samples are encoded again (its thread starts at the first sample).
_CANARY = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank-bpe-canary",
                             initializer=below_the_loop)


class RankSlot:
    """One tokenizer's rank encoder: built in a thread of its own on `start()`, used by
    `encode` while it is there, dropped at the canary's first difference.

    `rust` is the Hugging Face tokenizer (the reference and the fallback); `source` the
    tokenizer.json's (path, size, mtime), None when it is not known; `off` why the rank encoder
    is not to be used at all (None: build it when asked).
    """

    def __init__(self, name: str, rust: Any, source: tuple[str, int, int] | None,
                 off: str | None = None) -> None:
        self.name = name
        self._rust = rust
        self._source = source
        self.encoder: RankBPE | None = None
        self.reason = off or "not built yet"
        self.done = threading.Event()
        self.mismatches = 0
        self._encoded = 0
        self._started = off is not None
        self._lock = threading.Lock()
        if off is not None:
            self.done.set()

    def start(self) -> None:
        """Build the rank encoder in its own thread, once (the gateway calls this at start)."""
        if self._started:
            return
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._build, name=f"rank-bpe-{self.name}", daemon=True).start()

    def wait(self, timeout_s: float) -> bool:
        """Start the build and wait for it; True when the rank encoder is in use."""
        self.start()
        self.done.wait(timeout_s)
        return self.encoder is not None

    def encode(self, texts: list[str]) -> list[Sequence[int]]:
        """Ids of texts holding no added token: the rank encoder's where it is ready and the
        text within its guard, the Hugging Face encoder's for the rest (one batch)."""
        rank = self.encoder
        if rank is None:
            return [e.ids for e in self._rust.encode_batch_fast(texts, add_special_tokens=False)]
        out: list[Sequence[int] | None] = []
        slow: list[int] = []
        for i, text in enumerate(texts):
            if rank.fits(text):
                out.append(rank.encode(text))
            else:
                out.append(None)
                slow.append(i)
        if slow:
            for i, enc in zip(slow, self._rust.encode_batch_fast(
                    [texts[i] for i in slow], add_special_tokens=False), strict=True):
                out[i] = enc.ids
        before = self._encoded
        self._encoded += len(texts)  # threads may lose an increment: it only moves a sample
        if before // CANARY_EVERY != self._encoded // CANARY_EVERY:
            # In a thread of its own: a short prompt is counted on the event loop, and the
            # Hugging Face encoder's time for an 8,192-character piece (~3 ms) would stall it.
            _CANARY.submit(self._canary, texts[0], out[0])
        return out  # type: ignore[return-value]  # every None was filled

    def _canary(self, text: str, got: Sequence[int] | None) -> None:
        want = self._rust.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if list(got or ()) != list(want):
            self.mismatches += 1
            self.encoder = None
            self.reason = "a piece encoded differently from the Hugging Face encoder"
            if self._source is not None:  # nor for a tokenizer loaded from this file later
                with _BUILD_LOCK:
                    _BUILT[self._source] = None, self.reason
            log.error("tokenizer %s: the rank encoder gave %d ids where the Hugging Face "
                      "encoder gives %d for a %d-character piece; the Hugging Face encoder "
                      "does all the work from now on", self.name, len(got or ()), len(want),
                      len(text))

    def _build(self) -> None:
        # Below the loop, like the counting threads: the Hugging Face encoder's thread pool,
        # made at its first use (often the probe here), takes the priority of its maker.
        below_the_loop()
        with _BUILD_LOCK:  # one build at a time; the same file's is built once
            found = _BUILT.get(self._source) if self._source is not None else None
            if found is None:
                try:
                    # The file itself where it is known: serialising the loaded tokenizer
                    # back (`to_str`) costs another ~0.2 s with the GIL held.
                    raw = Path(self._source[0]).read_bytes() if self._source is not None \
                        else self._rust.to_str()
                    found = build(orjson.loads(raw), self._rust)
                except Exception as exc:  # any failure leaves the Hugging Face encoder
                    found = None, f"{type(exc).__name__}: {exc}"
                trim()  # the parsed tokenizer.json is garbage now: ~60 MB of RSS otherwise
                if self._source is not None:
                    _BUILT[self._source] = found
        self.encoder, self.reason = found
        self.done.set()
        if self.encoder is None:
            log.info("tokenizer %s: the Hugging Face encoder does the counting (%s)",
                     self.name, self.reason)
        else:
            log.info("tokenizer %s: counting with the rank encoder (tiktoken's core, the same "
                     "ids)", self.name)


def build(data: Mapping[str, Any], reference: Any) -> tuple[RankBPE | None, str]:
    """The rank encoder for this tokenizer.json, or None and why; `reference` is the Rust
    tokenizer, which must encode `PROBE` to the same ids."""
    try:
        import tiktoken
    except ImportError:  # pragma: no cover - a dependency, but the gateway works without it
        return None, "tiktoken is not installed"
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        return None, f"model type {model.get('type')!r}, not BPE"
    if model.get("dropout") or model.get("byte_fallback") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "BPE with dropout, byte fallback, a subword prefix or a word suffix"
    nfc, why = _normalizer(data.get("normalizer"))
    if why:
        return None, why
    pattern, why = _pattern(data.get("pre_tokenizer"))
    if pattern is None:
        return None, why
    ranks, why = _ranks(model.get("vocab") or {}, model.get("merges") or [])
    if ranks is None:
        return None, why
    try:
        encoding = tiktoken.Encoding("gateway-rank-bpe", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens={})
    except ValueError as exc:  # a regex construct tiktoken's engine does not take
        return None, f"tiktoken cannot compile the pre-tokenizer regex: {exc}"
    encoder = RankBPE(encoding, nfc)
    expected = list(reference.encode_batch_fast([PROBE], add_special_tokens=False)[0].ids)
    if encoder.encode(PROBE) != expected:
        return None, "the probe text encodes differently"
    return encoder, ""


def _normalizer(spec: Any) -> tuple[bool, str]:
    if spec is None:
        return False, ""
    if spec.get("type") == "Sequence":
        steps = spec.get("normalizers") or []
        if not steps:
            return False, ""
        if len(steps) == 1:
            return _normalizer(steps[0])
    if spec.get("type") == "NFC":
        return True, ""
    return False, f"normalizer {spec.get('type')!r}"


def _pattern(spec: Any) -> tuple[str | None, str]:
    if not isinstance(spec, Mapping):
        return None, "no pre-tokenizer"
    if spec.get("type") == "ByteLevel":
        if spec.get("add_prefix_space") or spec.get("use_regex") is False:
            return None, "ByteLevel with a prefix space or without a regex"
        return GPT2_PATTERN, ""
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None, f"pre-tokenizer {spec.get('type')!r}"
    split, level = steps
    regex = (split.get("pattern") or {}).get("Regex")
    if split.get("type") != "Split" or not isinstance(regex, str) \
            or split.get("behavior") != "Isolated" or split.get("invert"):
        return None, "the first pre-tokenizer step is not an isolating regex Split"
    if level.get("type") != "ByteLevel" or level.get("add_prefix_space") \
            or level.get("use_regex") is not False:
        return None, "the second pre-tokenizer step is not ByteLevel without its own regex"
    return regex, ""


def _ranks(vocab: Mapping[str, int], merges: Sequence[Any]) -> tuple[dict[bytes, int] | None,
                                                                      str]:
    decoder = _byte_decoder()
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        try:
            ranks[token.translate(decoder).encode("latin-1")] = token_id
        except UnicodeEncodeError:
            return None, f"token {token!r} is not in the byte-level alphabet"
    if sum(1 for key in ranks if len(key) == 1) != 256:
        return None, "not every byte is a token"
    last = -1
    made = 0
    for merge in merges:
        left, right = merge if isinstance(merge, list) else str(merge).split(" ", 1)
        made_id = vocab.get(left + right)
        if made_id is None or made_id <= last:
            return None, "the merges are not in token-id order"
        last = made_id
        made += 1
    if made + 256 != len(ranks):
        return None, "some tokens are neither bytes nor one merge's result"
    return ranks, ""
