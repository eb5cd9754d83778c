"""What a request asks its engine to prefill, counted per endpoint: the count stage's work.

Chat messages go through vLLM's normalisation and the model's chat template; a Responses
input becomes the chat messages vLLM builds from it (gateway/wire/openai.py `responses_messages`),
with the conversation a `previous_response_id` continues counted from what it cost; a
completion's prompt and an embedding's or a classification's input are encoded as they are;
a rerank's or a score's pairs are each one prompt of their two inputs (an estimate). An
Anthropic Messages request is counted as the chat request vLLM converts it to
(gateway/tokens/anthropic.py). Images on a vision model are counted apart, by the model's rule
(gateway/tokens/images.py), and make the count an estimate; a text-only model refuses them with
a clear 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gateway.errors import InvalidRequest
from gateway.policy import ModelSpec
from gateway.records import record
from gateway.tokens import TokenCounter, openai_messages
from gateway.tokens.anthropic import chat_form, merges_inline_system
from gateway.tokens.images import IMAGE_PART_TYPES, VisionRule, image_size, split_images
from gateway.wire.anthropic import CountTokensRequest, MessagesRequest
from gateway.wire.openai import (
    ChatRequest,
    EmbeddingsRequest,
    ParsedRequest,
    ResponsesRequest,
    responses_messages,
    template_kwargs,
)
from gateway.wire.pooling import ClassifyRequest, RerankRequest, ScoreInput, ScoreRequest


@record
class Prompt:
    tokens: int  # of the longest prompt
    prompts: int
    exact: bool
    chars: int
    # Chained hashes of its full blocks (gateway/prefix/hashing.py), for prefix routing: only
    # for one exactly tokenized text prompt (no images, no stored conversation prepended by
    # the engine, not an embedding), when `block_size` was asked; else empty.
    hashes: Sequence[int] = ()
    hash_block: int = 0  # the block size they were hashed at


async def count_prompt(counter: TokenCounter, model: ModelSpec, data: dict[str, Any],
                       parsed: ParsedRequest, who: str, prior_tokens: int = 0,
                       block_size: int | None = None) -> Prompt:
    """Raises the cost stage's RequestCostError for what the caller got wrong."""
    p = await _count(counter, model, data, parsed, who, prior_tokens, block_size)
    if p.hashes and block_size and p.hash_block != block_size:  # (a chat's says it already)
        return replace(p, hash_block=block_size)
    return p


async def _count(counter: TokenCounter, model: ModelSpec, data: dict[str, Any],
                 parsed: ParsedRequest, who: str, prior_tokens: int,
                 block_size: int | None) -> Prompt:
    if isinstance(parsed, ChatRequest):
        return await _chat(counter, model, data["messages"], data.get("tools"),
                           template_kwargs(data), who, exact=True, block_size=block_size)
    if isinstance(parsed, ResponsesRequest):
        messages, exact = responses_messages(parsed)
        reasoning = data.get("reasoning")
        # The Responses API's reasoning.effort reaches the template as chat's reasoning_effort.
        fields = {"reasoning_effort": reasoning["effort"]} \
            if isinstance(reasoning, dict) and reasoning.get("effort") is not None else {}
        p = await _chat(counter, model, messages, _chat_tools(parsed.tools),
                        template_kwargs(fields), who, exact,
                        block_size=None if prior_tokens else block_size)
        # The conversation it continues is prepended by the engine: counted as it cost then.
        return Prompt(p.tokens + prior_tokens, 1, p.exact and not prior_tokens, p.chars,
                      p.hashes)
    if isinstance(parsed, MessagesRequest | CountTokensRequest):
        # Anthropic's Messages API: the chat request vLLM makes of it (gateway/tokens/anthropic.py).
        form = chat_form(data, merges_inline_system(counter.tokenizer))
        return await _chat(counter, model, form.messages, form.tools,
                           template_kwargs(form.fields), who, form.exact, block_size=block_size)
    if isinstance(parsed, RerankRequest | ScoreRequest):
        return await _pairs(counter, model, parsed.pairs(), who)
    if isinstance(parsed, ClassifyRequest):
        parsed.check()
        if parsed.input is None:
            # vLLM's ClassificationChatRequest: no generation prompt unless asked.
            return await _chat(counter, model, data["messages"], None,
                               template_kwargs({"add_generation_prompt": False, **data}), who,
                               exact=True)
    embedding = isinstance(parsed, EmbeddingsRequest | ClassifyRequest)
    prompt = data["input"] if embedding else data["prompt"]
    counts = await counter.measure_prompt(prompt, caller=who,
                                          block_size=None if embedding else block_size)
    return Prompt(max(c.tokens for c in counts), len(counts), all(c.exact for c in counts),
                  sum(c.chars for c in counts), counts[0].hashes if len(counts) == 1 else ())


async def _chat(counter: TokenCounter, model: ModelSpec, messages: Sequence[Any],
                tools: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any],
                who: str, exact: bool, block_size: int | None = None) -> Prompt:
    images: list[str] = []
    if model.vision is not None:
        messages, images = split_images(messages)
    # vLLM's normalisation first (null content, text parts, tool-call arguments), so the
    # count is the engine's count.
    tc = await counter.measure_chat(openai_messages(messages), tools, kwargs, caller=who,
                                    block_size=None if images else block_size)
    hash_block = (block_size or 0) if tc.hashes else 0
    if not images or model.vision is None:
        return Prompt(tc.tokens, 1, tc.exact and exact, tc.chars, tc.hashes, hash_block)
    v = model.vision
    rule = VisionRule(v.tokens_per_image, v.patch_px, v.max_tokens_per_image)
    return Prompt(tc.tokens + sum(rule.tokens(image_size(url)) for url in images), 1, False,
                  tc.chars)


async def _pairs(counter: TokenCounter, model: ModelSpec,
                 pairs: Sequence[tuple[ScoreInput, ScoreInput]], who: str) -> Prompt:
    """A rerank's or a score's pairs, each one prompt of its two inputs' tokens: each text
    encoded once, however many pairs it is in (a query against N documents is N + 1 texts).
    An estimate: the model's pair format (a cross-encoder's separators, a reranker's score
    template) adds tokens of its own."""
    texts: dict[str, int] = {}
    extra: dict[int, int] = {}  # id(input) -> its images' tokens
    for pair in pairs:
        for item in pair:
            text, images = _score_input(model, item)
            texts.setdefault(text, 0)
            extra[id(item)] = images
    counts = await counter.measure_prompt(list(texts), caller=who) if texts else []
    for text, count in zip(texts, counts, strict=True):
        texts[text] = count.tokens
    sizes = [texts[_score_text(a)] + texts[_score_text(b)] + extra[id(a)] + extra[id(b)]
             for a, b in pairs]
    return Prompt(max(sizes), len(sizes), False, sum(len(t) for t in texts))


def _score_text(item: ScoreInput) -> str:
    if isinstance(item, str):
        return item
    return "\n".join(str(p.get("text", "")) for p in item.content if p.get("type") == "text")


def _score_input(model: ModelSpec, item: ScoreInput) -> tuple[str, int]:
    """The text of a score input and its images' tokens (by the model's rule; a text-only
    model refuses them, as vLLM does). Other parts (video, image embeddings) are not counted
    here: refused with a clear 400 rather than admitted at a cost nobody knows."""
    if isinstance(item, str):
        return item, 0
    images = 0
    for part in item.content:
        kind = part.get("type")
        if kind == "text":
            continue
        if kind in IMAGE_PART_TYPES and model.vision is not None:
            v = model.vision
            rule = VisionRule(v.tokens_per_image, v.patch_px, v.max_tokens_per_image)
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, Mapping) else ref
            images += rule.tokens(image_size(url) if isinstance(url, str) else None)
            continue
        raise InvalidRequest(
            f"A score input's content part of type {kind!r} is not supported here: the "
            "gateway counts text parts, and image parts for a vision model.",
            param="content", code="invalid_value")
    return _score_text(item), images


def _chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses API tools (flat: type, name, parameters) in the chat shape templates read."""
    if not tools:
        return None
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "function":
            out.append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters") if k in t}})
    return out or None
