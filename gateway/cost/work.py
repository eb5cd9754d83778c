"""The per-request cost model: what one request will hold and do on an engine replica.

One immutable `RequestCost` per request, built by `estimate` from its prompt tokens, its
`max_tokens` and the model's profile. Admission reads the KV blocks; routing and the simulator
read the work. Three KV figures, because a scheduler can plan for three different futures:
  kv_blocks_prompt    what prefill allocates at once
  kv_blocks_reserved  prompt + expected output (the learned P90): what to budget in the common case
  kv_blocks_max       prompt + max output: what the request may grow to in the worst case
KV bytes per token follow the design documents (2 x layers x kv_heads x head_dim x dtype bytes;
327,680 B for the 70B GQA model in BF16); the per-GPU share divides the KV heads over TP ranks
and replicates them when TP exceeds the KV heads, as vLLM does.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict
from typing import Any

from gateway.cost.errors import RequestCostError
from gateway.cost.profiles import ModelProfile, blocks_for
from gateway.records import record

DEFAULT_BLOCK_SIZE = 16  # vLLM's default KV block size in tokens


@record
class RequestCost:
    """What one request costs a replica: tokens, KV cache and work. A `record`: one is built
    for every request, and a frozen dataclass's 16 guarded field sets cost ~2 us of it."""

    model: str
    prompt_tokens: int
    max_output_tokens: int
    expected_output_tokens: int
    tp: int
    block_size: int
    kv_bytes_per_token: int  # whole model, all layers, K and V
    kv_bytes_per_token_per_gpu: int  # one TP rank's share
    kv_blocks_prompt: int
    kv_blocks_reserved: int  # prompt + expected output
    kv_blocks_max: int  # prompt + max output
    prefill_tokens: int
    prefill_flops: float
    decode_tokens: int  # expected output tokens
    decode_flops: float
    decode_kv_read_bytes: float  # KV this request's decode steps read, whole model

    @property
    def kv_bytes_reserved_per_gpu(self) -> int:
        return self.kv_blocks_reserved * self.block_size * self.kv_bytes_per_token_per_gpu

    @property
    def kv_bytes_max_per_gpu(self) -> int:
        return self.kv_blocks_max * self.block_size * self.kv_bytes_per_token_per_gpu

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for `/gateway/estimate` and logs."""
        out = asdict(self)
        out["kv_bytes_reserved_per_gpu"] = self.kv_bytes_reserved_per_gpu
        out["kv_bytes_max_per_gpu"] = self.kv_bytes_max_per_gpu
        return out


class OutputLengthModel:
    """Completion lengths a model has produced lately, summarised as a quantile (P90 default).

    A ring of the last `window` completed requests rather than an all-time reservoir, so the
    estimate follows a change in traffic within a few hundred requests. Until `min_samples`
    completions were seen, the policy's default stands in.
    """

    def __init__(
        self,
        default: int,
        quantile: float = 0.9,
        window: int = 512,
        min_samples: int = 20,
    ) -> None:
        if default <= 0:
            raise ValueError(f"default: must be a positive integer, got {default}")
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile: must be in (0, 1], got {quantile}")
        if window <= 0 or min_samples <= 0:
            raise ValueError("window and min_samples: must be positive")
        self.default = default
        self.quantile = quantile
        self.min_samples = min(min_samples, window)
        self._ring: list[int] = []
        self._window = window
        self._next = 0
        self._cached: int | None = None
        self._lock = threading.Lock()

    def observe(self, completion_tokens: int) -> None:
        if completion_tokens < 0:
            return
        with self._lock:
            if len(self._ring) < self._window:
                self._ring.append(completion_tokens)
            else:
                self._ring[self._next] = completion_tokens
                self._next = (self._next + 1) % self._window
            self._cached = None  # recomputed on the next read, not on every completion

    @property
    def samples(self) -> int:
        return len(self._ring)

    def expected(self) -> int:
        with self._lock:
            if len(self._ring) < self.min_samples:
                return self.default
            if self._cached is None:
                ordered = sorted(self._ring)
                # Nearest-rank quantile: an observed length, never an interpolated one.
                rank = max(1, math.ceil(self.quantile * len(ordered)))
                self._cached = max(1, ordered[rank - 1])
            return self._cached


class CostModel:
    """What requests cost one model on one pool's replicas, its per-token KV figures worked
    out once: `cost` is then arithmetic on the request's own numbers and the profile's FLOPs.
    The request path keeps one per model and pool (in the pipeline probe the estimate fell
    58-61 -> 24-27 us run cold against `estimate`, which works them out on every call)."""

    __slots__ = ("block_size", "context", "default_max_tokens", "expected_output",
                 "kv_bytes_per_token", "kv_bytes_per_token_per_gpu", "name", "profile", "tp")

    def __init__(self, model_profile: ModelProfile, block_size: int = DEFAULT_BLOCK_SIZE,
                 tp: int = 1, default_max_tokens: int = 1024,
                 expected_output: int | OutputLengthModel | None = None,
                 kv_dtype: str = "bf16", max_model_len: int | None = None) -> None:
        if block_size <= 0 or tp <= 0:
            raise ValueError(f"block_size and tp: must be positive, got {block_size} and {tp}")
        p = self.profile = model_profile
        self.name = p.name
        self.block_size = block_size
        self.tp = tp
        self.default_max_tokens = default_max_tokens
        self.expected_output = expected_output
        self.context = max_model_len or p.max_position_embeddings
        self.kv_bytes_per_token = p.kv_bytes_per_token(kv_dtype)
        self.kv_bytes_per_token_per_gpu = p.kv_bytes_per_token_per_gpu(tp, kv_dtype)

    def cost(self, prompt_tokens: int, max_tokens: int | None,
             allow_prefill_only: bool = False) -> RequestCost:
        """Cost of one request; `estimate` says what the arguments mean."""
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens: must not be negative, got {prompt_tokens}")
        prefill_only = max_tokens == 0 and allow_prefill_only  # an embedding: nothing decoded
        if max_tokens is not None and max_tokens < 1 and not prefill_only:
            err = RequestCostError(f"max_tokens: must be at least 1, got {max_tokens}")
            err.param = "max_tokens"
            raise err
        context = self.context
        if prompt_tokens >= context:
            err = RequestCostError(
                f"prompt has {prompt_tokens} tokens; the model's context is {context} tokens"
            )
            err.param = "messages"
            raise err
        room = context - prompt_tokens
        max_output = min(max_tokens if max_tokens is not None else self.default_max_tokens,
                         room)
        wanted = self.expected_output
        if isinstance(wanted, OutputLengthModel):
            expected = wanted.expected()
        elif wanted is None:
            expected = max_output
        else:
            expected = wanted
        expected = max(0, min(expected, max_output))
        kv_token, bs, flops = self.kv_bytes_per_token, self.block_size, self.profile.prefill_flops
        # Decode step i (0-based) computes one token attending to prompt + i earlier ones:
        # the same sum as a prefill of `expected` tokens on top of a `prompt_tokens` context.
        return RequestCost(
            model=self.name,
            prompt_tokens=prompt_tokens,
            max_output_tokens=max_output,
            expected_output_tokens=expected,
            tp=self.tp,
            block_size=bs,
            kv_bytes_per_token=kv_token,
            kv_bytes_per_token_per_gpu=self.kv_bytes_per_token_per_gpu,
            kv_blocks_prompt=blocks_for(prompt_tokens, bs),
            kv_blocks_reserved=blocks_for(prompt_tokens + expected, bs),
            kv_blocks_max=blocks_for(prompt_tokens + max_output, bs),
            prefill_tokens=prompt_tokens,
            prefill_flops=flops(prompt_tokens) if prompt_tokens else 0.0,
            decode_tokens=expected,
            decode_flops=flops(expected, context=prompt_tokens) if expected else 0.0,
            decode_kv_read_bytes=kv_token * (expected * prompt_tokens
                                             + expected * (expected - 1) / 2),
        )


def estimate(
    prompt_tokens: int,
    max_tokens: int | None,
    model_profile: ModelProfile,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tp: int = 1,
    default_max_tokens: int = 1024,
    expected_output: int | OutputLengthModel | None = None,
    kv_dtype: str = "bf16",
    max_model_len: int | None = None,
    allow_prefill_only: bool = False,
) -> RequestCost:
    """Cost of one request.

    `max_tokens` is the request's `max_tokens` / `max_completion_tokens`, None when absent; then
    the pool's `default_max_tokens` applies, capped like vLLM caps it by what is left of the
    context window. The expected output is the learned quantile (or a fixed number), never more
    than the maximum. Callers that estimate many requests of one model on one pool keep a
    `CostModel` instead.
    """
    return CostModel(model_profile, block_size, tp, default_max_tokens, expected_output,
                     kv_dtype, max_model_len).cost(prompt_tokens, max_tokens, allow_prefill_only)
