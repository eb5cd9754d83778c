"""Tokens and what they cost in money, by pool and tenant.

Tokens are counted from the engines' own `usage` (the gateway asks every stream for its usage
frame), split into `input` (prompt tokens computed), `cached` (prompt tokens served from the
engine's prefix cache) and `output`. A stream cut short by its caller is counted as far as it
went: the prompt, and one output token per streamed event.

A pool's spend per hour is its backends x GPUs per backend x price per GPU-hour (the policy's
`cost`). Over a sliding window, that spend is split between input and output tokens (by the
policy's `input_share`, or by the estimated GPU time of prefill against decode of the requests
in the window), giving a price per million input and output tokens; each request's tenant is
charged its tokens at those prices. The rule is `gateway/cost/pricing.py`'s, which `gateway plan`
and `loadtest` price by too.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.cost.pricing import (
    DECODE_EFFICIENCY,
    ESTIMATED_SHARE,
    PREFILL_EFFICIENCY,
    gpu_spend,
    input_share,
    per_token,
)
from gateway.cost.profiles import ModelProfile, roofline_gpu
from gateway.observe.metrics import GatewayMetrics
from gateway.policy.model import Policy


@dataclass
class _Slice:
    at: float
    input: int = 0
    cached: int = 0
    output: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class PoolPrices:
    """A pool's spend per hour, the tokens of its window, and the prices they gave."""

    per_hour: float
    window_s: float
    input_share: float | None
    currency: str
    slices: deque[_Slice] = field(default_factory=deque)
    price_input: float | None = None  # per token, last computed
    price_output: float | None = None
    span_s: float = 0.0  # the stretch of time the last prices were computed over
    share_used: float | None = None


class Accountant:
    def __init__(self, policy: Policy, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.pools: dict[str, PoolPrices] = {}
        # Each pool's roofline figures; none on CPUs: their spend splits by `input_share`, or
        # in half (gateway/cost/pricing.py input_share, with no GPU-seconds to go by).
        self._gpu: dict[str, tuple[float, float, float] | None] = {}
        for name, pool in policy.pools.items():
            gpu = roofline_gpu(pool.gpu)
            self._gpu[name] = None if gpu is None else (
                gpu.peak_flops("bf16"), gpu.hbm_tb_s * 1e12, float(pool.tp))
            if pool.cost is None:
                continue
            gpus = pool.cost.gpus_per_backend or pool.tp
            per_hour = len(pool.backends) * gpus * pool.cost.price_per_gpu_hour()
            self.pools[name] = PoolPrices(per_hour, pool.cost.window_s, pool.cost.input_share,
                                          pool.cost.currency)
            metrics.cost_per_hour.labels(name).set(per_hour)

    def record(self, pool: str, tenant: str, prompt_tokens: int, cached_tokens: int,
               output_tokens: int, profile: ModelProfile, concurrency: int) -> None:
        """One finished request: count its tokens and charge its tenant."""
        fresh = max(0, prompt_tokens - cached_tokens)
        tokens, child = self.metrics.tokens, self.metrics.child
        if fresh:
            child(tokens, pool, tenant, "input").inc(fresh)
        if cached_tokens:
            child(tokens, pool, tenant, "cached").inc(cached_tokens)
        if output_tokens:
            child(tokens, pool, tenant, "output").inc(output_tokens)
        pc = self.pools.get(pool)
        if pc is None:
            return
        s = self._slice(pc)
        s.input += fresh
        s.cached += cached_tokens
        s.output += output_tokens
        roofline = self._gpu[pool]
        if roofline is not None:
            peak, hbm, tp = roofline
            # GPU-seconds of this request, as the roofline puts them: prefill compute-bound,
            # decode memory-bound with the weights' reads shared by the batch it ran in.
            s.prefill_s += profile.prefill_flops(fresh, context=cached_tokens) / (
                peak * tp * PREFILL_EFFICIENCY)
            weights_per_step = profile.weight_bytes() / max(1, concurrency)
            kv_read = profile.kv_bytes_per_token() * output_tokens * (prompt_tokens
                                                                       + output_tokens / 2)
            s.decode_s += (weights_per_step * output_tokens + kv_read) / (
                hbm * tp * DECODE_EFFICIENCY)
        if pc.price_input is None or pc.price_output is None:
            self.update()  # the first requests after start-up are charged too
        if pc.price_input is not None and pc.price_output is not None:
            spend = fresh * pc.price_input + output_tokens * pc.price_output
            self.metrics.tenant_cost.labels(tenant, pool).inc(spend)

    def _slice(self, pc: PoolPrices) -> _Slice:
        now = self.clock()
        if not pc.slices or now - pc.slices[-1].at >= 10.0:
            pc.slices.append(_Slice(now))
        while pc.slices and now - pc.slices[0].at > pc.window_s:
            pc.slices.popleft()
        return pc.slices[-1]

    def update(self) -> None:
        """Recompute each pool's price per token over its window; export them."""
        for name, pc in self.pools.items():
            self._slice(pc)
            inp = sum(s.input for s in pc.slices)
            out = sum(s.output for s in pc.slices)
            if not pc.slices or (inp == 0 and out == 0):
                continue
            # The GPUs cost money busy or idle: the spend of the whole stretch is charged to
            # the tokens served in it, so low utilisation shows as a high price per token.
            span = min(pc.window_s, max(1.0, self.clock() - pc.slices[0].at))
            spend = gpu_spend(pc.per_hour, span)
            share = input_share(pc.input_share, sum(s.prefill_s for s in pc.slices),
                                sum(s.decode_s for s in pc.slices), inp, out)
            pc.span_s, pc.share_used = span, share
            pc.price_input, pc.price_output = per_token(spend, share, inp, out)
            if pc.price_input is not None:
                self.metrics.cost_per_million.labels(name, "input").set(pc.price_input * 1e6)
            if pc.price_output is not None:
                self.metrics.cost_per_million.labels(name, "output").set(pc.price_output * 1e6)

    def snapshot(self, pool: str) -> dict[str, object] | None:
        pc = self.pools.get(pool)
        if pc is None:
            return None
        return {"currency": pc.currency, "per_hour": pc.per_hour, "window_s": pc.window_s,
                "per_million_input": None if pc.price_input is None else pc.price_input * 1e6,
                "per_million_output": None if pc.price_output is None
                else pc.price_output * 1e6,
                "span_s": pc.span_s, "input_share": pc.share_used,
                "input_share_source": "policy" if pc.input_share is not None
                else ESTIMATED_SHARE}
