"""What to send and when: request lengths, arrival times, and prompts of an exact token length.

Lengths come from a trace (the Azure CSV or the Mooncake JSONL, read by `gateway.cost.traces`)
or from a synthetic spec; arrival times from a process at a rate (Poisson, gamma with a given
coefficient of variation, constant) or from the trace's own timestamps, optionally compressed.

Prompts are made of words that are each exactly one token of the target's tokenizer, with a
leading space: a byte-level BPE pre-tokenizer splits text at those spaces, so no merge crosses
two words and N words are N tokens. The chat template's own tokens are measured once and
subtracted. Requests that share Mooncake `hash_ids` share the text of those 512-token blocks,
so a real engine's prefix cache sees the same token ids a real replay would.

The multi-turn synthetic (`--multiturn`) is built the same way: N conversations of K turns,
each turn's prompt a shared system prompt, then the whole history so far (its own blocks,
growing by `turn` tokens a turn: the last answer, a tool's result, the next question), then a
few unique words; turns of one conversation `think` seconds apart, conversations starting at
`start` a second (Poisson), so it replays like a trace, at its own times. Each request carries
its conversation as `user`, which session affinity reads.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gateway.cost.traces import TraceError, TraceRequest, read_trace
from gateway.tokens.loading import load_tokenizer
from gateway.tokens.tokenizer import HFTokenizer, Tokenizer
from loadtest.client import RequestSpec, chat_request, completion_request

Endpoint = Literal["chat", "completions"]
ARRIVALS = ("poisson", "gamma:CV", "constant", "trace")
HASH_BLOCK_TOKENS = 512      # Mooncake's hash_ids each stand for 512 prompt tokens
# A salt moves every seed this far: past any request index or hash id a trace holds, so no
# salted prompt or prefix block falls on an unsalted one.
SALT_STRIDE = 7_777_777_777
SYSTEM_HASH_IDS = 10**12      # the multi-turn system prompt's hash ids start here
VOCAB_WORDS = 2048           # one-token words to draw from; the most frequent ones
_WORD = re.compile(r" [a-z]{3,9}")
_DEFAULT_PROMPT_TOKENS = 512
_DEFAULT_OUTPUT_TOKENS = 128


class WorkloadError(ValueError):
    """A workload that cannot be built: a bad spec, trace or tokenizer; the message says which."""


# --- lengths ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dist:
    """A length distribution: `fixed` N, `uniform` LO..HI, or `lognormal` from its P50 and P99."""

    kind: Literal["fixed", "uniform", "lognormal"]
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        # P99 = P50 * exp(2.326 sigma) fixes sigma; mu = ln(P50).
        sigma = math.log(self.b / self.a) / 2.3263478740408408
        return max(1, round(rng.lognormvariate(math.log(self.a), sigma)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{int(self.a)}:{int(self.b)}"


def parse_dist(text: str, where: str) -> Dist:
    parts = text.strip().split(":")
    try:
        numbers = [int(p) for p in (parts if parts[0].isdigit() else parts[1:])]
    except ValueError:
        numbers = []
    kind = "fixed" if parts[0].isdigit() else parts[0]
    expected = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if kind not in expected or len(numbers) != expected[kind] or min(numbers, default=0) < 1:
        raise WorkloadError(
            f"--synthetic {where}={text!r}: expected a positive N, uniform:LO:HI or "
            "lognormal:P50:P99 (token counts)")
    if kind == "uniform" and numbers[0] > numbers[1]:
        raise WorkloadError(f"--synthetic {where}={text!r}: LO must not exceed HI")
    if kind == "lognormal" and numbers[1] <= numbers[0]:
        raise WorkloadError(f"--synthetic {where}={text!r}: P99 must exceed P50")
    return Dist(kind, float(numbers[0]), float(numbers[1]) if len(numbers) > 1 else 0.0)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Synthetic:
    prompt: Dist
    output: Dist

    def describe(self) -> str:
        return f"in={self.prompt.describe()},out={self.output.describe()}"


def parse_synthetic(spec: str) -> Synthetic:
    """`in=DIST,out=DIST`, each DIST `N`, `uniform:LO:HI` or `lognormal:P50:P99`."""
    fields: dict[str, Dist] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ("in", "out"):
            raise WorkloadError(
                f"--synthetic {spec!r}: expected in=DIST,out=DIST (DIST: N, uniform:LO:HI or "
                "lognormal:P50:P99), e.g. in=512,out=lognormal:150:600")
        fields[key] = parse_dist(value, key)
    return Synthetic(fields.get("in", Dist("fixed", _DEFAULT_PROMPT_TOKENS)),
                     fields.get("out", Dist("fixed", _DEFAULT_OUTPUT_TOKENS)))


@dataclass(frozen=True, slots=True)
class Item:
    """One request to make: its lengths, its prefix blocks and (trace replay) its arrival."""

    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()
    arrival_s: float = 0.0
    session: str | None = None  # the conversation it belongs to (sent as `user`)


def potential_hit_rate(items: Sequence[Item]) -> float | None:
    """Share of prompt tokens in 512-token blocks that repeat an earlier request's prefix,
    with an unbounded cache: what any prefix cache could serve of this request sequence."""
    seen: set[int] = set()
    hit = total = 0
    for item in items:
        total += item.prompt_tokens
        parent = 0
        leading = True
        for h in item.block_hashes[: item.prompt_tokens // HASH_BLOCK_TOKENS]:
            parent = hash((parent, h))
            if leading and parent in seen:
                hit += HASH_BLOCK_TOKENS
            else:
                leading = False
                seen.add(parent)
    return hit / total if total else None


@dataclass(frozen=True, slots=True)
class MultiTurn:
    """`--multiturn` conversations=N,turns=K,system=TOKENS,turn=TOKENS,out=TOKENS,think=S,
    start=CONVERSATIONS_PER_S (turn and system in whole 512-token blocks, rounded up)."""

    conversations: int = 32
    turns: int = 12
    system: int = 2048
    turn: int = 1024
    out: int = 128
    think_s: float = 3.0
    start_rate: float = 1.0
    tail: int = 32  # unique words at the end of every prompt: no two prompts are equal

    def describe(self) -> str:
        return (f"multiturn:conversations={self.conversations},turns={self.turns},"
                f"system={self.system},turn={self.turn},out={self.out},think={self.think_s:g},"
                f"start={self.start_rate:g}")


def parse_multiturn(spec: str) -> MultiTurn:
    names = {"conversations": int, "turns": int, "system": int, "turn": int, "out": int,
             "think": float, "start": float}
    given: dict[str, float] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        try:
            number = names[key](value) if sep and key in names else None
        except ValueError:
            number = None
        if number is None or not number > 0 or not math.isfinite(number):
            raise WorkloadError(
                f"--multiturn {spec!r}: expected positive conversations=N,turns=K,"
                "system=TOKENS,turn=TOKENS,out=TOKENS,think=SECONDS,start=PER_SECOND, e.g. "
                "conversations=32,turns=12,system=2048,turn=1024,out=128,think=3,start=1")
        given[key] = number
    d = MultiTurn()
    return MultiTurn(int(given.get("conversations", d.conversations)),
                     int(given.get("turns", d.turns)), int(given.get("system", d.system)),
                     int(given.get("turn", d.turn)), int(given.get("out", d.out)),
                     float(given.get("think", d.think_s)),
                     float(given.get("start", d.start_rate)))


def multiturn_items(mt: MultiTurn, seed: int = 0) -> list[Item]:
    """Every turn of every conversation, in arrival order. Hash ids: the system prompt's are
    shared by all conversations, each conversation's history blocks are its own."""
    system = [SYSTEM_HASH_IDS + i for i in range(-(-mt.system // HASH_BLOCK_TOKENS))]
    per_turn = max(1, -(-mt.turn // HASH_BLOCK_TOKENS))
    rng = random.Random(seed * 7_919 + 19)
    out: list[Item] = []
    start = 0.0
    for c in range(mt.conversations):
        if c:
            start += rng.expovariate(mt.start_rate)
        own = [(c + 1) * 1_000_000 + j for j in range(per_turn * mt.turns)]
        for k in range(mt.turns):
            ids = (*system, *own[: per_turn * (k + 1)])
            out.append(Item(len(ids) * HASH_BLOCK_TOKENS + mt.tail, mt.out, ids,
                            start + k * mt.think_s, f"conversation-{seed}-{c}"))
    out.sort(key=lambda i: i.arrival_s)
    return out


def spread_buckets(requests: Sequence[TraceRequest]) -> list[float]:
    """Arrival times with each run of equal timestamps spread evenly up to the next timestamp.

    Mooncake's timestamps are quantised to ~3 s buckets: replayed verbatim, each bucket would be
    one burst. Azure's are already distinct, so this leaves them unchanged.
    """
    times = [r.arrival_s for r in requests]
    out = list(times)
    i = 0
    while i < len(times):
        j = i
        while j + 1 < len(times) and times[j + 1] == times[i]:
            j += 1
        if j > i and j + 1 < len(times):
            step = (times[j + 1] - times[i]) / (j - i + 1)
            for k in range(i, j + 1):
                out[k] = times[i] + (k - i) * step
        i = j + 1
    return out


def trace_items(path: str, start: int = 0) -> list[Item]:
    try:
        requests = read_trace(path)
    except TraceError as exc:
        raise WorkloadError(str(exc)) from None
    requests = requests[start:]
    times = spread_buckets(requests)
    base = times[0] if times else 0.0
    return [Item(max(1, r.prompt_tokens), max(1, r.output_tokens), r.block_hashes, t - base)
            for r, t in zip(requests, times, strict=True)]


# --- arrivals -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    kind: Literal["poisson", "gamma", "constant", "trace"]
    cv: float = 1.0

    def describe(self) -> str:
        return f"gamma:{self.cv:g}" if self.kind == "gamma" else self.kind


def parse_arrival(text: str) -> Arrival:
    kind, _, arg = text.partition(":")
    if kind in ("poisson", "constant", "trace") and not arg:
        return Arrival(kind)  # type: ignore[arg-type]
    if kind == "gamma":
        try:
            cv = float(arg)
        except ValueError:
            cv = -1.0
        if cv > 0 and math.isfinite(cv):
            return Arrival("gamma", cv)
        raise WorkloadError(f"--arrival {text!r}: gamma needs a positive coefficient of "
                            "variation, e.g. gamma:2 (burstier than Poisson) or gamma:0.5")
    raise WorkloadError(f"--arrival {text!r}: expected one of {', '.join(ARRIVALS)}")


def arrival_times(arrival: Arrival, rate: float | None, count: int, duration_s: float,
                  rng: random.Random, trace_times: Sequence[float] | None = None,
                  compress: float = 1.0) -> list[float]:
    """Send times (seconds from the start), at most `count`, all within `duration_s`."""
    out: list[float] = []
    if arrival.kind == "trace":
        if trace_times is None:
            raise WorkloadError("--arrival trace needs --trace")
        for t in trace_times[:count]:
            t = t / compress
            if t > duration_s:
                break
            out.append(t)
        return out
    if rate is None or rate <= 0:
        raise WorkloadError(f"--arrival {arrival.describe()} needs a positive --rate")
    t = 0.0
    # Gamma with shape k = 1/CV^2 and mean 1/rate; CV 1 is Poisson, CV 0 would be constant.
    shape = 1.0 / (arrival.cv * arrival.cv)
    for i in range(count):
        if i:
            if arrival.kind == "constant":
                t += 1.0 / rate
            elif arrival.kind == "poisson":
                t += rng.expovariate(rate)
            else:
                t += rng.gammavariate(shape, 1.0 / (rate * shape))
        if t > duration_s:
            break
        out.append(t)
    return out


# --- prompts ------------------------------------------------------------------------------------


def one_token_words(tok: HFTokenizer, limit: int = VOCAB_WORDS) -> list[tuple[int, str]]:
    """(id, " word") for the lowest-id (most frequent) words that are one token each."""
    rust = tok._rust  # the Rust tokenizer: its vocabulary is the only way to list candidates
    words: list[tuple[int, str]] = []
    for token_id in sorted(rust.get_vocab().values()):
        text = rust.decode([token_id])
        if _WORD.fullmatch(text) and rust.encode(text, add_special_tokens=False).ids == [
                token_id]:
            words.append((token_id, text))
            if len(words) >= limit:
                break
    if len(words) < 64:
        raise WorkloadError(f"tokenizer {tok.name!r}: found only {len(words)} one-token words; "
                            "cannot build prompts of an exact length with it")
    return words


@dataclass
class PromptBuilder:
    """Builds request bodies whose prompts tokenize to the requested length.

    With a tokenizer that is not exact (`none`), lengths are right on average only.
    """

    tokenizer: Tokenizer
    model: str
    endpoint: Endpoint = "chat"
    token_ids: bool = False          # completions: send the prompt as token ids
    force_output: bool = True        # ignore_eos + min_tokens, so the output length is the trace's
    send_hash_ids: bool = False      # also send `prefix_hash_ids` (the simulator's field)
    seed: int = 0
    # Varies the prompt text, not the lengths: a sweep gives each step its own, so an engine's
    # prefix cache does not serve a step the prompts an earlier step sent.
    salt: int = 0
    _words: list[tuple[int, str]] = field(default_factory=list)
    _overhead: int = 0
    _blocks: dict[int, tuple[list[int], str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.token_ids and self.endpoint != "completions":
            raise WorkloadError("--token-ids needs --endpoint completions (chat takes text)")
        if isinstance(self.tokenizer, HFTokenizer):
            self._words = one_token_words(self.tokenizer)
            if self.endpoint == "chat":
                self._overhead = self.tokenizer.count_chat([{"role": "user", "content": ""}])
            elif not self.token_ids:
                self._overhead = self.tokenizer.count_text("")
        else:
            # An estimate only: 4 characters a token, the ratio CharRatioEstimator assumes.
            self._words = [(0, w) for w in (" abc", " xyz", " def", " uvw")]
            self._overhead = 8 if self.endpoint == "chat" else 0

    @property
    def overhead(self) -> int:
        """Tokens the template adds around the user's text (chat) or the special tokens."""
        return self._overhead

    def _block(self, hash_id: int) -> tuple[list[int], str]:
        """The words of a shared 512-token prefix block: a pure function of its hash id."""
        key = hash_id * 1_000_003 + self.seed + self.salt * SALT_STRIDE
        found = self._blocks.get(key)
        if found is None:
            rng = random.Random(key)
            picks = rng.choices(self._words, k=HASH_BLOCK_TOKENS)
            found = ([i for i, _ in picks], "".join(w for _, w in picks))
            if len(self._blocks) < 4096:  # bounded: 4096 blocks is ~12 MB of text
                self._blocks[key] = found
        return found

    def content(self, index: int, tokens: int, hashes: Sequence[int] = ()
                ) -> tuple[list[int], str]:
        """Ids and text of `tokens` one-token words: shared blocks first, then unique words."""
        ids: list[int] = []
        parts: list[str] = []
        for h in hashes:
            if len(ids) + HASH_BLOCK_TOKENS > tokens:
                break
            block_ids, block_text = self._block(h)
            ids.extend(block_ids)
            parts.append(block_text)
        rest = tokens - len(ids)
        if rest > 0:
            # Seeded by the request index, so two runs with one seed send the same prompts.
            rng = random.Random(index * 7_919 + self.seed * 104_729 + 1
                                + self.salt * SALT_STRIDE)
            picks = rng.choices(self._words, k=rest)
            ids.extend(i for i, _ in picks)
            parts.append("".join(w for _, w in picks))
        return ids, "".join(parts)

    def build(self, index: int, item: Item) -> tuple[RequestSpec, int]:
        """The request and the prompt tokens it will count as."""
        words = max(1, item.prompt_tokens - self._overhead)
        ids, text = self.content(index, words, item.block_hashes)
        extra: dict[str, Any] = {}
        if self.force_output:
            extra["ignore_eos"] = True
            extra["min_tokens"] = item.output_tokens
        if self.send_hash_ids and item.block_hashes:
            extra["prefix_hash_ids"] = list(item.block_hashes)
        if item.session is not None:
            extra["user"] = item.session
        if self.endpoint == "chat":
            spec = chat_request(self.model, text, item.output_tokens, extra=extra)
        elif self.token_ids:
            spec = completion_request(self.model, "", item.output_tokens, extra={
                **extra, "prompt": ids})
        else:
            spec = completion_request(self.model, text, item.output_tokens, extra=extra)
        return spec, words + self._overhead

    def exact_count(self, spec: RequestSpec) -> int | None:
        """The prompt's token count measured by the tokenizer (a self-check, not the hot path)."""
        import orjson

        body = orjson.loads(spec.body)
        if not self.tokenizer.exact:
            return None
        if self.endpoint == "chat":
            return self.tokenizer.count_chat(body["messages"])
        if isinstance(body["prompt"], list):
            return len(body["prompt"])
        return self.tokenizer.count_text(body["prompt"])


def load_prompt_tokenizer(spec: str) -> Tokenizer:
    # The Hugging Face encoder: the load generator counts a prompt's overhead once and never on
    # its timed path, and the gateway's rank encoder would start its build in a thread at the
    # first count, holding the GIL for ~0.4 s inside the first step of a run (a sweep's first
    # request measured 423 ms to its first token against 39 ms, and failed its SLO).
    try:
        return load_tokenizer(spec, encoder="huggingface")
    except Exception as exc:  # TokenizerError and the loaders' own: one message either way
        raise WorkloadError(f"--tokenizer {spec!r}: {exc}") from None


# --- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """Lengths (from a trace or a synthetic spec) and how to draw the i-th request's."""

    source: str                       # the trace path or the synthetic spec, for reports
    trace: list[Item] | None          # a trace's requests, or the multi-turn synthetic's
    synthetic: Synthetic | None
    seed: int = 0
    max_model_len: int | None = None  # clip prompt + output to this many tokens

    def item(self, index: int) -> Item:
        if self.trace is not None:
            item = self.trace[index % len(self.trace)]
        else:
            assert self.synthetic is not None
            rng = random.Random(self.seed * 1_000_003 + index)
            item = Item(self.synthetic.prompt.sample(rng), self.synthetic.output.sample(rng))
        return self._clip(item)

    def _clip(self, item: Item) -> Item:
        limit = self.max_model_len
        if limit is None or item.prompt_tokens + item.output_tokens <= limit:
            return item
        output = min(item.output_tokens, max(1, limit // 2))
        prompt = max(1, limit - output)
        return Item(prompt, output, item.block_hashes[: prompt // HASH_BLOCK_TOKENS],
                    item.arrival_s, item.session)

    def items(self, count: int) -> Iterator[Item]:
        return (self.item(i) for i in range(count))

    def trace_times(self) -> list[float] | None:
        return [i.arrival_s for i in self.trace] if self.trace is not None else None

    def potential_hit_rate(self, count: int | None = None) -> float | None:
        """`potential_hit_rate` of the first `count` requests (all of a trace's by default);
        None for a synthetic workload (no prefixes to share)."""
        if self.trace is None:
            return None
        n = len(self.trace) if count is None else count
        return potential_hit_rate([self.item(i) for i in range(n)])


def make_workload(trace: str | None, synthetic: str | None, seed: int = 0,
                  max_model_len: int | None = None, trace_start: int = 0,
                  multiturn: str | None = None) -> Workload:
    if multiturn is not None:
        if trace is not None or synthetic is not None:
            raise WorkloadError("give one of --trace, --synthetic or --multiturn")
        mt = parse_multiturn(multiturn)
        return Workload(mt.describe(), multiturn_items(mt, seed), None, seed, max_model_len)
    if (trace is None) == (synthetic is None):
        raise WorkloadError("give exactly one of --trace FILE, --synthetic SPEC or "
                            "--multiturn SPEC")
    if trace is not None:
        if not Path(trace).is_file():
            raise WorkloadError(f"{trace}: no such trace file")
        items = trace_items(trace, trace_start)
        if not items:
            raise WorkloadError(f"{trace}: no requests after the first {trace_start}")
        return Workload(trace, items, None, seed, max_model_len)
    assert synthetic is not None
    return Workload(synthetic, None, parse_synthetic(synthetic), seed, max_model_len)
