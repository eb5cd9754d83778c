"""Tokenizers and chat templates, and the per-request cost model.

    load_tokenizer(spec) -> Tokenizer    exact counts (chat template + Rust tokenizer) or `none`
    TokenCounter(tokenizer)              the same counts off the event loop, with a character limit
    estimate(prompt_tokens, ...)         -> RequestCost: KV blocks, prefill and decode work
    CostModel(profile, ...).cost(...)    the same, its per-token figures worked out once
    OutputLengthModel                    learned expected completion length (P90)
    read_trace(path)                     Azure CSV / Mooncake JSONL request traces
"""

from __future__ import annotations

from gateway.cost.counter import TokenCount, TokenCounter
from gateway.cost.errors import (
    CostError,
    PromptTooLong,
    RequestCostError,
    TemplateError,
    TokenizerError,
)
from gateway.cost.estimator import CharRatioEstimator, chat_chars
from gateway.cost.loading import load_tokenizer
from gateway.cost.templates import openai_messages
from gateway.cost.tokenizer import HFTokenizer, Tokenizer
from gateway.cost.traces import TraceError, TraceRequest, read_trace
from gateway.cost.work import CostModel, OutputLengthModel, RequestCost, estimate

__all__ = [
    "CharRatioEstimator",
    "CostError",
    "CostModel",
    "HFTokenizer",
    "OutputLengthModel",
    "PromptTooLong",
    "RequestCost",
    "RequestCostError",
    "TemplateError",
    "TokenCount",
    "TokenCounter",
    "Tokenizer",
    "TokenizerError",
    "TraceError",
    "TraceRequest",
    "chat_chars",
    "estimate",
    "load_tokenizer",
    "openai_messages",
    "read_trace",
]
