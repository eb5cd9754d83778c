"""Tokenize -> estimate: what a request will cost the pool that takes it.

Shared by the completion endpoints and `/gateway/estimate`, so "why was this rejected?" is
answered with the very numbers admission used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.cost import PromptTooLong, RequestCost, RequestCostError, estimate, openai_messages
from gateway.errors import InvalidRequest
from gateway.policy import ModelSpec
from gateway.profiles import ModelProfile, get_model
from gateway.protocol import ChatCompletionRequest, ParsedRequest
from gateway.routing import Route
from gateway.runtime import Runtime

_FALLBACK_PROFILE = "llama-3-8b"  # models without an architecture: blocks are nominal


@dataclass(frozen=True, slots=True)
class Costed:
    route: Route
    prompt_tokens: int
    cost: RequestCost
    sequences: int  # prompts x n: the engine runs each as its own sequence
    exact: bool

    @property
    def blocks(self) -> int:
        return self.cost.kv_blocks_reserved * self.sequences

    @property
    def tokens(self) -> int:
        return (self.cost.prompt_tokens + self.cost.expected_output_tokens) * self.sequences


async def count_prompt(rt: Runtime, model: ModelSpec, data: dict[str, Any],
                       parsed: ParsedRequest) -> tuple[int, int, bool, int]:
    """(prompt tokens of the longest prompt, prompts, exact?, characters)."""
    counter = rt.counters[model.name]
    try:
        if isinstance(parsed, ChatCompletionRequest):
            kwargs = data.get("chat_template_kwargs")
            # vLLM's normalisation first (null content, text parts, tool-call arguments), so
            # the count is the engine's count.
            tc = await counter.measure_chat(openai_messages(data["messages"]), data.get("tools"),
                                            **(kwargs if isinstance(kwargs, dict) else {}))
            return tc.tokens, 1, tc.exact, tc.chars
        counts = await counter.measure_prompt(data["prompt"])
    except RequestCostError as exc:
        raise InvalidRequest(str(exc), param=exc.param,
                             code="prompt_too_long" if isinstance(exc, PromptTooLong)
                             else "invalid_value") from None
    return (max(c.tokens for c in counts), len(counts), all(c.exact for c in counts),
            sum(c.chars for c in counts))


def profile_of(model: ModelSpec) -> ModelProfile:
    return model.architecture.resolve() if model.architecture else get_model(_FALLBACK_PROFILE)


async def cost_request(rt: Runtime, model: ModelSpec, data: dict[str, Any],
                       parsed: ParsedRequest) -> tuple[Costed, int]:
    """Count, route and estimate; returns the costed request and the prompt's characters."""
    prompt_tokens, prompts, exact, chars = await count_prompt(rt, model, data, parsed)
    route = rt.router.route(model, prompt_tokens, parsed.output_limit)
    pool = rt.policy.pools[route.pool]
    try:
        cost = estimate(
            prompt_tokens, parsed.output_limit, profile_of(model), block_size=pool.block_size,
            tp=pool.tp, default_max_tokens=pool.max_tokens_default or rt.policy.defaults.max_tokens,
            expected_output=rt.output_lengths[model.name], kv_dtype=model.kv_cache_dtype,
            max_model_len=pool.max_model_len)
    except RequestCostError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from None
    sequences = prompts * (parsed.n or 1)
    return Costed(route, prompt_tokens, cost, sequences, exact), chars
