"""What a request costs: the work it brings to an engine replica, and what that work costs.

    estimate(prompt_tokens, ...)         -> RequestCost: KV blocks, prefill and decode work
    CostModel(profile, ...).cost(...)    the same, its per-token figures worked out once
    OutputLengthModel                    learned expected completion length (P90)
    read_trace(path)                     Azure CSV / Mooncake JSONL request traces

    work.py      the per-request work model (`RequestCost`, `CostModel`, `OutputLengthModel`)
    profiles.py  model and GPU data and the memory ledger the work is figured from
    pricing.py   money: GPU-hour spend split into input and output token prices
    traces.py    real traffic's prompt and output lengths, for the planner and the load tester
    errors.py    the cost stage's errors, counting (gateway/tokens/) and costing alike

The prompt's tokens come counted from gateway/tokens/; nothing here reads text.
"""

from __future__ import annotations

from gateway.cost.errors import (
    CostError,
    PromptTooLong,
    RequestCostError,
    TemplateError,
    TokenizerError,
)
from gateway.cost.traces import TraceError, TraceRequest, read_trace
from gateway.cost.work import CostModel, OutputLengthModel, RequestCost, estimate

__all__ = [
    "CostError",
    "CostModel",
    "OutputLengthModel",
    "PromptTooLong",
    "RequestCost",
    "RequestCostError",
    "TemplateError",
    "TokenizerError",
    "TraceError",
    "TraceRequest",
    "estimate",
    "read_trace",
]
