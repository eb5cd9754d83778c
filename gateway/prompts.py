"""What a request asks its engine to prefill, counted per endpoint: the count stage's work.

Chat messages go through vLLM's normalisation and the model's chat template; a Responses
input becomes the chat messages vLLM builds from it (gateway/protocol.py `responses_messages`),
with the conversation a `previous_response_id` continues counted from what it cost; a
completion's prompt and an embedding's input are encoded as they are. Images on a vision
model are counted apart, by the model's rule (gateway/cost/images.py), and make the count an
estimate; a text-only model refuses them with a clear 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gateway.cost import TokenCounter, openai_messages
from gateway.cost.images import VisionRule, image_size, split_images
from gateway.policy import ModelSpec
from gateway.protocol import (
    ChatRequest,
    EmbeddingsRequest,
    ParsedRequest,
    ResponsesRequest,
    responses_messages,
    template_kwargs,
)
from gateway.records import record


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
    embedding = isinstance(parsed, EmbeddingsRequest)
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
