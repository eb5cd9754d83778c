"""Tokenizers that count a request's prompt tokens exactly as the engine will.

`load_tokenizer(spec)` (gateway/tokens/loading.py) makes an `HFTokenizer` from what the policy
names for a model. `chat_template=` replaces the tokenizer's own template with the one the model
is served with (`load_chat_template`): Qwen2.5 counted with the Qwen3 files needs Qwen2.5's
template, whose default system prompt Qwen3's lacks.

An exact count is the chat template rendered with the request's template arguments (vLLM's
defaults: `add_generation_prompt=True`, `continue_final_message=False`) and encoded by the Rust
tokenizer with `add_special_tokens=False`, which is what `apply_chat_template` and vLLM do.
Encoding is the expensive half, and chat requests repeat themselves (system prompts, few-shot
blocks, the whole history on every turn), so the rendered text is cut at the special tokens the
template puts between messages and each piece's count is cached. The cut is exact, not an
approximation: the Rust tokenizer itself splits the input at added tokens before normalising and
pre-tokenising, so no BPE merge ever crosses `<|im_start|>` or `<|im_end|>`.
"""

from __future__ import annotations

import functools
import re
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer as RustTokenizer

from gateway.cost.errors import TemplateError, TokenizerError
from gateway.tokens import rankbpe
from gateway.tokens.blocks import BlockChains, PromptWalk
from gateway.tokens.native import NativeTemplate, native_template
from gateway.tokens.pieces import PieceCache
from gateway.tokens.templates import (
    compile_template,
    continued_field,
    plain,
    prepare_messages,
    render,
    select_template,
    template_variables,
)
from gateway.tokens.turns import Learning, Resumed, Turns, first_characters, root_of

# Characters of rendered text whose piece counts are kept; 32M characters is ~8M tokens of
# history at a few tens of bytes of bookkeeping per piece plus the hash key.
DEFAULT_CACHE_CHARS = 32_000_000


@runtime_checkable
class Tokenizer(Protocol):
    """What the gateway, the cost model and the simulated engine need of a tokenizer."""

    name: str
    exact: bool

    def count_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> int: ...

    def count_text(self, text: str) -> int: ...

    def count_ids(self, ids: Sequence[int]) -> int: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def observe(self, chars: int, actual_tokens: int) -> float: ...


_NO_IDS: array[int] = array("I")  # an empty piece's


class HFTokenizer:
    """A Hugging Face fast tokenizer plus its chat template; counts are exact."""

    exact = True
    # The policy's `chat_template` this tokenizer was loaded with (None: the tokenizer's own).
    chat_template_spec: str | None = None

    def __init__(
        self,
        rust: RustTokenizer,
        chat_template: str | Mapping[str, str] | None,
        special_tokens: Mapping[str, str],
        name: str,
        cache_chars: int = DEFAULT_CACHE_CHARS,
        encoder: str = "auto",
        source: tuple[str, int, int] | None = None,
        renderer: str = "auto",
    ) -> None:
        self.name = name
        self._rust = rust
        self._special_tokens = dict(special_tokens)
        # What a native render sees when the caller sets no template argument (most
        # requests): built once, read only.
        self._no_kwargs_variables = template_variables(self._special_tokens, {})
        self._templates = chat_template
        # Compile each template once up front: compiling costs milliseconds, rendering microseconds.
        self._compiled = (
            {chat_template: compile_template(chat_template)} if isinstance(chat_template, str)
            else {src: compile_template(src) for src in (chat_template or {}).values()}
        )
        # The native render of each template that has one (native.py); `renderer: jinja`
        # renders every request with Jinja.
        self.renderer = renderer
        self._native: dict[str, NativeTemplate] = {} if renderer == "jinja" else {
            src: native for src, tpl in self._compiled.items()
            if (native := native_template(src, tpl)) is not None}
        self._splitter = _special_splitter(rust)
        self._post_tokens = rust.num_special_tokens_to_add(False)
        # The ids of the added tokens the splitter cuts at (the splitter checked each encodes
        # to exactly its own id).
        self._special_ids: dict[str, int] = {
            added.content: token_id for token_id, added in rust.get_added_tokens_decoder().items()}
        self.cache = PieceCache(cache_chars)
        self.chains = BlockChains()  # a prompt's block hashes per piece sequence (blocks.py)
        self.turns = Turns()  # where a conversation's walk stood after each message (turns.py)
        self._special_firsts = first_characters(list(self._special_ids))
        # The rank encoder (rankbpe.py), built in a thread of its own at the first encode or
        # when the gateway starts; until it is ready, or where it does not apply, the Hugging
        # Face encoder does the work.
        self.encoder = encoder
        splittable = {c for c in self._special_ids
                      if self._splitter is not None and self._splitter.fullmatch(c)}
        self.rank = rankbpe.RankSlot(
            name, rust, source,
            off="the policy asks for the Hugging Face encoder" if encoder == "huggingface"
            else None if splittable == set(self._special_ids)
            else "an added token is matched inside text (normalized or stripped), which the "
                 "rank encoder cannot do")

    @property
    def vocab_size(self) -> int:
        """Ids of the vocabulary proper, without the added (special) tokens."""
        return int(self._rust.get_vocab_size(with_added_tokens=False))

    @property
    def has_chat_template(self) -> bool:
        return bool(self._compiled)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the engine will encode for these messages."""
        if self._templates is None:
            raise TokenizerError(f"tokenizer {self.name!r} has no chat template")
        source = select_template(self._templates, tools is not None)
        if continue_final_message and continued_field(continue_final_message) not in source:
            # transformers' check: a field the template never reads cannot be continued.
            raise TemplateError(f"continue_final_message: this chat template does not read "
                                f"{continued_field(continue_final_message)!r}")
        native = self._native.get(source)
        if native is not None and messages and not continue_final_message:
            variables = template_variables(self._special_tokens, template_kwargs) \
                if template_kwargs else self._no_kwargs_variables
            text = native.render(messages, tools, variables, add_generation_prompt)
            if text is not None:
                if native.due():
                    self._canary(native, source, text, messages, tools, add_generation_prompt,
                                 template_kwargs)
                return text
        return render(self._compiled[source], messages, tools, self._special_tokens,
                      add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, **template_kwargs)

    def _canary(self, native: NativeTemplate, source: str, text: str,
                messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                add_generation_prompt: bool, template_kwargs: Mapping[str, Any]) -> None:
        # Copies: the request goes on while the canary's thread renders.
        native.check(text, functools.partial(
            render, self._compiled[source], prepare_messages(messages),
            plain(list(tools)) if tools is not None else None,
            self._special_tokens, add_generation_prompt, False, **plain(template_kwargs)))

    @property
    def native_render(self) -> bool:
        """Whether the template of a request without tools is rendered natively (native.py)."""
        if self._templates is None:
            return False
        try:
            native = self._native.get(select_template(self._templates, False))
        except TemplateError:
            return False
        return native is not None and native.on

    def count_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> int:
        return self.count_rendered(self.render_chat(messages, tools, **template_kwargs))

    def count_text(self, text: str) -> int:
        """A completions prompt: encoded with `add_special_tokens=True`, as vLLM does.

        The post-processor's additions (a BOS for Llama; nothing for Qwen) are a fixed number.
        """
        return self.count_rendered(text) + self._post_tokens

    def count_ids(self, ids: Sequence[int]) -> int:
        return len(ids)

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> array[int]:
        """The prompt's token ids, exactly as `count_chat` counts them (for block hashes)."""
        return self.rendered_ids(self.render_chat(messages, tools, **template_kwargs))

    def text_ids(self, text: str) -> list[int]:
        """A completions prompt's ids, special-token additions included (as `count_text`).
        Not cached: the post-processor's additions depend on the whole text's position."""
        return list(self._rust.encode_batch_fast([text], add_special_tokens=True)[0].ids)

    @property
    def walkable(self) -> bool:
        """Whether prompts are cut into pieces (at special tokens) for the block trie."""
        return self._splitter is not None

    def walk_chat(self, block_size: int, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None = None,
                  **template_kwargs: Any) -> PromptWalk:
        """Render, cut into pieces and follow the pieces the block trie knows (cheap: the
        counter runs it on the loop); `finish` encodes and hashes the rest. A natively
        rendered conversation starts where its seen messages left the walk (turns.py), and
        the new messages after them are cut and walked by `finish` too."""
        assert self._splitter is not None, "walkable tokenizers only"
        walk = self._walk_turns(block_size, messages, tools, template_kwargs)
        if walk is not None:
            return walk
        text = self.render_chat(messages, tools, **template_kwargs)
        return self.chains.walk(self._splitter.split(text), self._special_ids, block_size,
                                self.pieces_ids)

    def _walk_turns(self, block_size: int, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None,
                    template_kwargs: dict[str, Any]) -> PromptWalk | None:
        """`walk_chat` of a conversation the native render takes, or None (render_chat's)."""
        assert self._splitter is not None
        if self._templates is None or not messages:
            return None
        kwargs = template_kwargs
        add_generation_prompt = True
        if "add_generation_prompt" in kwargs or "continue_final_message" in kwargs:
            kwargs = dict(kwargs)
            add_generation_prompt = kwargs.pop("add_generation_prompt", True)
            if kwargs.pop("continue_final_message", False):
                return None
        source = select_template(self._templates, tools is not None)
        native = self._native.get(source)
        if native is None:
            return None
        variables = template_variables(self._special_tokens, kwargs) if kwargs \
            else self._no_kwargs_variables
        if not native.takes(variables):
            return None
        root = root_of(block_size, source, tools, kwargs)
        if root is None:
            return None
        start, chain, turn, settled = self.turns.find(root, messages, native.settled)
        ends: list[int] | None = [] if start < settled else None
        parts = native.render_parts(messages, tools, variables, add_generation_prompt, start,
                                    ends)
        if parts is None:
            return None
        if native.due():  # the canary renders the whole conversation
            text = native.render(messages, tools, variables, add_generation_prompt)
            if text is not None:
                self._canary(native, source, text, messages, tools, add_generation_prompt,
                             kwargs)
        learn = None if ends is None else Learning(
            self.turns, messages, start, settled, chain, turn, parts, ends,
            self._special_firsts, block_size)
        if turn is None:
            return self.chains.walk(self._splitter.split("".join(parts)), self._special_ids,
                                    block_size, self.pieces_ids, None, learn)
        if start < len(messages):  # new messages: their cut and walk wait for `finish`
            return Resumed(self.chains, turn, turn.carry + "".join(parts), self._splitter,
                           self._special_ids, block_size, self.pieces_ids, learn)
        return self.chains.walk(self._splitter.split(turn.carry + "".join(parts)),
                                self._special_ids, block_size, self.pieces_ids, turn.start(),
                                learn)

    def pieces_ids(self, pieces: list[str]) -> list[array[int]]:
        """Each text piece's ids through the piece cache; the missing ones encoded together."""
        found: list[array[int] | None] = [self.cache.get_ids(p) if p else _NO_IDS
                                          for p in pieces]
        missing = list(dict.fromkeys(p for p, ids in zip(pieces, found, strict=True)
                                     if ids is None))
        if missing:
            encoded = {}
            for piece, piece_ids in zip(missing, self._encode(missing), strict=True):
                encoded[piece] = ids = array("I", piece_ids)
                self.cache.put(piece, ids)
            found = [encoded[p] if ids is None else ids
                     for p, ids in zip(pieces, found, strict=True)]
        return found  # type: ignore[return-value]  # no None is left

    def rendered_ids(self, text: str) -> array[int]:
        """Ids of already-rendered text, through the piece cache (ids kept per piece)."""
        out: array[int] = array("I")
        if self._splitter is None:
            out.extend(self._rust.encode_batch_fast([text], add_special_tokens=False)[0].ids)
            return out
        pieces = self._splitter.split(text)
        found: list[array[int] | None] = [None] * len(pieces)
        missing: dict[str, list[int]] = {}
        for i in range(0, len(pieces), 2):
            piece = pieces[i]
            if piece:
                ids = self.cache.get_ids(piece)
                if ids is None:
                    missing.setdefault(piece, []).append(i)
                else:
                    found[i] = ids
        if missing:
            unique = list(missing)
            for piece, piece_ids in zip(unique, self._encode(unique), strict=True):
                ids = array("I", piece_ids)
                self.cache.put(piece, ids)
                for i in missing[piece]:
                    found[i] = ids
        special = self._special_ids
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(special[piece])
            else:
                ids = found[i]
                if ids is not None:
                    out.extend(ids)
        return out

    def count_rendered(self, text: str) -> int:
        """Tokens of already-rendered text, without special-token additions, through the cache."""
        known, misses = self.split_rendered(text)
        return known + self.encode_pieces(misses)

    def split_rendered(self, text: str) -> tuple[int, list[str]]:
        """Tokens known without encoding (special tokens, cached pieces) and the pieces left.

        Pure Python and cheap for cached text: `TokenCounter` runs it on the event loop and
        sends only the misses, which are Rust work that releases the GIL, to a worker thread.
        """
        if self._splitter is None:
            return 0, [text] if text else []
        pieces = self._splitter.split(text)
        # re.split with one capture group alternates text, special token, text, ...
        known = len(pieces) // 2
        misses: list[str] = []
        for piece in pieces[::2]:
            if not piece:
                continue
            cached = self.cache.get(piece)
            if cached is None:
                misses.append(piece)
            else:
                known += cached
        return known, misses

    def encode_pieces(self, pieces: list[str]) -> int:
        """Encode pieces (each once), cache their counts, return the total over all occurrences."""
        if not pieces:
            return 0
        unique = list(dict.fromkeys(pieces))
        counts = dict(zip(unique, self._count_batch(unique), strict=True))
        if self._splitter is not None:  # without a splitter the piece is the whole, unique text
            for piece, count in counts.items():
                self.cache.put(piece, count)
        return sum(counts[piece] for piece in pieces)

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._rust.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._rust.decode(list(ids), skip_special_tokens=False))

    def observe(self, chars: int, actual_tokens: int) -> float:
        """Exact counts need no learning, but a non-zero error means the template drifted."""
        return 0.0

    def _count_batch(self, texts: list[str]) -> list[int]:
        if self.rank.encoder is not None:
            return [len(ids) for ids in self.rank.encode(texts)]
        if self._splitter is not None:
            self.rank.start()
        # encode_batch_fast releases the GIL for the whole Rust call and skips offsets; the
        # single-text `encode` holds the GIL, which would stall the event loop thread. len() of
        # an Encoding avoids building a Python list of every id.
        return [len(e) for e in self._rust.encode_batch_fast(texts, add_special_tokens=False)]

    def _encode(self, texts: list[str]) -> list[Sequence[int]]:
        """Ids of pieces holding no added token (the splitter cut them out)."""
        if self._splitter is not None:
            self.rank.start()
        return self.rank.encode(texts)

    @property
    def rank_bpe(self) -> rankbpe.RankBPE | None:
        """The rank encoder while it counts; None while the Hugging Face encoder does."""
        return self.rank.encoder

    def wait_rank_bpe(self, timeout_s: float = 30.0) -> bool:
        """Start the rank encoder's build and wait for it; True when it is in use."""
        return self.rank.wait(timeout_s)


def _special_splitter(rust: RustTokenizer) -> re.Pattern[str] | None:
    """A regex matching the added tokens the Rust tokenizer splits the input at.

    Only tokens matched on the raw text with no whitespace stripping qualify: for those, the
    pieces between matches are encoded independently by the tokenizer too, so summing per-piece
    counts is exact. Longest first, as the tokenizer's leftmost-longest matcher does.
    """
    contents: list[str] = []
    for token_id, added in rust.get_added_tokens_decoder().items():
        if added.lstrip or added.rstrip or added.single_word or added.normalized:
            continue
        if rust.encode(added.content, add_special_tokens=False).ids != [token_id]:
            continue  # the tokenizer encodes special tokens as text (split_special_tokens)
        contents.append(added.content)
    if not contents:
        return None
    contents.sort(key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, contents)) + ")")
