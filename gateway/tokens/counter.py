"""Token counting off the event loop, with the character limit checked first.

A 16K-token prompt takes ~15 ms to encode; on the event loop that would stall every stream the
gateway is relaying. So encoding runs in a small thread pool: the Rust encoder releases the GIL
(`encode_batch_fast`) and threads share one piece cache, which a process pool would split per
worker and pay to pickle every request into (benchmarks/tokenize_bench.py measured both; it
is in git history).
The template render and cache lookups (a 16K-token history of 17 messages: ~0.2 ms hot and
~0.5 cold with gateway/tokens/native.py's render, ~0.6 / ~1.0 ms with Jinja's) are Python and
hold the GIL in the worker; the loop can wait for it up to the interpreter's switch interval
(5 ms by default), so the server should lower it (`sys.setswitchinterval(0.001)`). Rendering
on the loop instead was measured too: requests arriving together then render back to back in
one loop iteration, which is worse, except for short prompts (`inline_chars`), whose whole
count costs less than the hop to a worker and back.

The character limit is checked on the loop before anything is queued: it is O(characters) with no
rendering, and a prompt over it must cost the gateway nothing more than that.

Long prompts (from `LONG_PROMPT_CHARS` characters) take a lane of their own: one more thread,
where each caller has at most one prompt at a time, so callers take turns and a 2 MB prompt
(seconds of encoding) waits behind its own caller's work, never in front of everyone's short
chats. After each long prompt that thread gives the encoder's scratch memory back to the
system (glibc keeps a freed arena per thread otherwise: +220 MB of RSS after one 1.7 MB
prompt, measured here, and it stayed).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gateway.cost.errors import PromptTooLong, RequestCostError
from gateway.prefix.hashing import block_hashes
from gateway.records import record
from gateway.tokens.estimator import CharRatioEstimator, chat_chars
from gateway.tokens.memory import trim
from gateway.tokens.threads import below_the_loop
from gateway.tokens.tokenizer import HFTokenizer, Tokenizer

T = TypeVar("T")

# A prompt of 2M characters is ~500K tokens, beyond any served context window; the policy lowers it.
DEFAULT_MAX_PROMPT_CHARS = 2_000_000
# From here a prompt is long: ~8K tokens, some 10 ms of encoding and up.
LONG_PROMPT_CHARS = 32_768
# Below this a prompt is counted on the event loop: the hop to a worker and back costs more
# than the count. Measured here (new text each time, 2 cores): 30 characters inline 74 us
# against 135 us through a worker, 300: 236 against 285, 1,000: 799 against 665; and on a busy
# loop the worker's answer also waits its turn behind the streams' events.
DEFAULT_INLINE_PROMPT_CHARS = 512
# With the rank encoder (rankbpe.py) counting, prompts up to this many times the inline limit
# are counted on the loop: it is 7-11x faster. Measured here (a new 2,000-token message, 7,000
# characters, 10 streams, docs/benchmarks-proxy.md): count stage 1.50 ms on the loop against
# 1.98 through the worker, +3.42 against +3.89 ms added TTFT; ~1 ms of loop time each.
RANK_INLINE_FACTOR = 16
# Up to here a chat prompt is rendered and cut on the loop when its blocks are hashed, so a
# history seen before costs no thread hop (gateway/tokens/blocks.py). Measured here for one new
# message of this size: 0.06 ms on the loop, against the tens of milliseconds of encoding
# that go to a worker; a history of many messages adds the template's render (~2-3 us each
# rendered natively, ~18 with Jinja: gateway/tokens/native.py).
WALK_ON_LOOP_CHARS = 131_072


@record
class TokenCount:
    """A prompt's measure: tokens (exact or estimated) and characters (for learning the ratio);
    with `block_size` asked, the chained hashes of its full blocks of token ids (exact
    tokenizers only; gateway/prefix/hashing.py), computed in the same job as the count."""

    tokens: int
    chars: int
    exact: bool
    hashes: Sequence[int] = ()


CompletionPrompt = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


class TokenCounter:
    """Async front of a `Tokenizer`: character limit, then a worker thread for the count."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        workers: int | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars
        self.inline_chars = DEFAULT_INLINE_PROMPT_CHARS
        self._own_executor = executor is None
        if workers is None:
            # Leave a core to the event loop: a worker that shares its core competes with it for
            # the CPU as well as the GIL (benchmarks/tokenize_bench.py, in git history: 1 vs 2
            # threads on 2 CPUs).
            workers = max(1, min(4, (os.cpu_count() or 2) - 1))
        self._executor = executor or ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"tokenize-{tokenizer.name}",
            initializer=below_the_loop)
        self._long = ThreadPoolExecutor(max_workers=1,
                                        thread_name_prefix=f"tokenize-long-{tokenizer.name}",
                                        initializer=below_the_loop)
        # caller -> (its turn in the long lane, how many of its prompts hold or await it)
        self._turns: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def warm(self, timeout_s: float = 30.0) -> None:
        """What a serving process wants ready before traffic: the rank encoder, built and
        waited for. A server calls this before it serves (start-up and reload run it in a
        thread) because the build holds the GIL for stretches of a tenth of a second (the
        tokenizer.json's parse, tiktoken's core being made)."""
        if isinstance(self.tokenizer, HFTokenizer):
            self.tokenizer.wait_rank_bpe(timeout_s)

    def check_chars(self, chars: int, param: str = "messages") -> None:
        if chars > self.max_prompt_chars:
            raise PromptTooLong(chars, self.max_prompt_chars, param)

    async def _off_loop(self, chars: int, caller: str, fn: Any, *args: Any,
                        may_inline: bool = True, **kwargs: Any) -> Any:
        if not self.tokenizer.exact:
            return fn(*args, **kwargs)  # an estimate is arithmetic: no thread hop needed
        loop = asyncio.get_running_loop()
        inline = self.inline_chars
        if getattr(self.tokenizer, "rank_bpe", None) is not None:
            inline *= RANK_INLINE_FACTOR
        if may_inline and chars < inline:
            return fn(*args, **kwargs)
        job = functools.partial(fn, *args, **kwargs)
        if chars < LONG_PROMPT_CHARS:
            return await loop.run_in_executor(self._executor, job)
        turn, users = self._turns.setdefault(caller, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with turn:
                return await loop.run_in_executor(self._long, _then_trim, job)
        finally:
            users[0] -= 1
            if not users[0]:
                del self._turns[caller]

    async def measure_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        caller: str = "",
        block_size: int | None = None,
    ) -> TokenCount:
        """Tokens and characters of a chat request; raises PromptTooLong or TemplateError.
        `caller`: whose turn a long prompt takes in the long lane; `block_size`: hash the
        prompt's blocks too (prefix routing)."""
        chars = chat_chars(messages, tools)
        self.check_chars(chars)
        tok = self.tokenizer
        if isinstance(tok, CharRatioEstimator):  # the estimate is of the characters just counted
            return TokenCount(tok.estimate_chars(chars), chars, False)
        if block_size and isinstance(tok, HFTokenizer):
            if tok.walkable and chars <= WALK_ON_LOOP_CHARS:
                # Render and follow the pieces seen before on the loop (a 16K-token history
                # seen last turn: ~0.1 ms, under the hop to a worker); only what is new, if
                # it is long, goes off the loop to be encoded and hashed.
                walk = tok.walk_chat(block_size, messages, tools, **(template_kwargs or {}))
                tokens, hashes = await self._off_loop(walk.left_chars, caller, walk.finish)
                return TokenCount(tokens, chars, True, hashes)
            # Ids instead of a count, through the same piece cache, and hashed in the same
            # job: a long prompt is hashed off the loop with its count.
            tokens, hashes = await self._off_loop(chars, caller, _chat_hashes, tok, messages,
                                                  tools, template_kwargs or {}, block_size)
            return TokenCount(tokens, chars, True, hashes)
        tokens = await self._off_loop(chars, caller, tok.count_chat, messages, tools,
                                      **(template_kwargs or {}))
        return TokenCount(int(tokens), chars, tok.exact)

    async def count_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> int:
        return (await self.measure_chat(messages, tools, template_kwargs)).tokens

    async def count_text(self, text: str) -> int:
        self.check_chars(len(text), "prompt")
        return int(await self._off_loop(len(text), "", self.tokenizer.count_text, text))

    async def measure_prompt(self, prompt: CompletionPrompt, *, caller: str = "",
                             block_size: int | None = None) -> list[TokenCount]:
        """A completions `prompt`: one count per sequence it holds (vLLM serves a list as a batch).

        Strings are encoded with the tokenizer's special-token additions; token ids are counted.
        `block_size`: a single prompt's block hashes too (a batch's are not used for routing).
        """
        sequences = _completion_sequences(prompt)
        chars = sum(len(s) for s in sequences if isinstance(s, str))
        self.check_chars(chars, "prompt")
        if block_size and len(sequences) == 1:
            only = sequences[0]
            if isinstance(only, list):
                return [TokenCount(len(only), 0, True, block_hashes(only, block_size))]
            tok = self.tokenizer
            if isinstance(tok, HFTokenizer):
                tokens, hashes = await self._off_loop(chars, caller, _text_hashes, tok, only,
                                                      block_size)
                return [TokenCount(tokens, len(only), True, hashes)]
        texts = [s for s in sequences if isinstance(s, str)]
        counts: list[int] = []
        if texts:
            counts = await self._off_loop(chars, caller, _count_texts, self.tokenizer, texts)
        text_counts = iter(counts)
        return [
            TokenCount(next(text_counts), len(s), self.tokenizer.exact) if isinstance(s, str)
            else TokenCount(len(s), 0, True)
            for s in sequences
        ]

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._long.shutdown(wait=False, cancel_futures=True)


def _then_trim(job: Any) -> Any:
    try:
        return job()
    finally:
        trim()


def _chat_hashes(tok: HFTokenizer, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any],
                 block_size: int) -> tuple[int, list[int]]:
    ids = tok.chat_ids(messages, tools, **kwargs)
    return len(ids), block_hashes(ids, block_size)


def _text_hashes(tok: HFTokenizer, text: str, block_size: int) -> tuple[int, list[int]]:
    ids = tok.text_ids(text)
    return len(ids), block_hashes(ids, block_size)


def _count_texts(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
    return [tokenizer.count_text(t) for t in texts]


def _completion_sequences(prompt: object) -> list[str | list[int]]:
    """Normalise the four shapes OpenAI allows for `prompt`; anything else is a 400."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, Sequence) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [str(p) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [[int(p) for p in prompt]]
        if all(isinstance(p, Sequence) and not isinstance(p, str) and p
               and all(isinstance(i, int) and not isinstance(i, bool) for i in p)
               for p in prompt):
            return [[int(i) for i in p] for p in prompt]
    err = RequestCostError(
        "prompt: must be a string, a list of strings, a list of token ids, "
        "or a list of lists of token ids"
    )
    err.param = "prompt"
    raise err
