"""Model and GPU data, and the memory ledger built on it.

One table each, shared by the capacity planner (`gateway plan`), the per-request cost model and
the simulated engine (`loadtest sim`), so that all three agree on what a token costs. Profiles are
data, not code paths: adding a GPU or a model is one row.

The ledger follows the design documents in ../shared/seeds:
  KV bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes   (327,680 B for 70B GQA BF16)
  weights per GPU    = params x dtype bytes / TP                          (140 GB / 8 = 17.5 GB)
  KV budget per GPU  = GPU memory x gpu_memory_utilization - weights per GPU - runtime reserve
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 10**9
GiB = 2**30

DTYPE_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


class ProfileError(ValueError):
    """A bad architecture, dtype or GPU name: the message names the field and the rule."""


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    params: float  # total parameters
    max_position_embeddings: int

    def validate(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ProfileError(
                    f"architecture.{field}: must be a positive integer, got {value!r}")
        if self.params <= 0:
            raise ProfileError(f"architecture.params: must be positive, got {self.params!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ProfileError(
                "architecture.num_attention_heads: must be divisible by num_kv_heads "
                f"(GQA groups), got {self.num_attention_heads} and {self.num_kv_heads}"
            )

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """KV cache bytes one token holds across the whole model (all layers, K and V)."""
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(kv_dtype))

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads each TP rank holds: split across ranks, replicated when TP > kv_heads."""
        return max(1, math.ceil(self.num_kv_heads / tp))

    def kv_bytes_per_token_per_gpu(self, tp: int, kv_dtype: str = "bf16") -> int:
        return int(2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim
                   * dtype_bytes(kv_dtype))

    def weight_bytes(self, dtype: str = "bf16") -> float:
        return self.params * dtype_bytes(dtype)

    def weight_bytes_per_gpu(self, tp: int, dtype: str = "bf16") -> float:
        return self.weight_bytes(dtype) / tp

    def prefill_flops(self, tokens: int, context: int = 0) -> float:
        """Forward FLOPs for `tokens` new tokens attending to `context` earlier ones.

        2 x params per token for the dense matmuls, plus attention: QK^T and AV each cost
        2 x heads x head_dim per (query, key) pair per layer, with a causal mask over the chunk.
        """
        dense = 2.0 * self.params * tokens
        pairs = tokens * context + tokens * (tokens + 1) / 2
        attn = 4.0 * self.num_layers * self.num_attention_heads * self.head_dim * pairs
        return dense + attn


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    memory_bytes: int
    bf16_tflops: float  # peak dense
    fp8_tflops: float | None  # None: no FP8 tensor cores
    hbm_tb_s: float
    interconnect_gb_s: float  # NVLink, per GPU, one direction

    def peak_flops(self, dtype: str) -> float:
        if dtype == "fp8":
            if self.fp8_tflops is None:
                raise ProfileError(f"dtype: {self.name} has no FP8 tensor cores; use bf16")
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12


# Published architectures (config.json of each model).
MODELS: dict[str, ModelProfile] = {
    m.name: m
    for m in (
        # The design documents' model: 70B dense, GQA 64/8, exactly 70e9 params (140 GB BF16).
        ModelProfile("generic-70b-gqa", 80, 8192, 64, 8, 128, 28672, 128256, 70.0e9, 131072),
        ModelProfile("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70.55e9, 8192),
        ModelProfile("llama-3.3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70.55e9, 131072),
        ModelProfile("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, 72.71e9, 32768),
        ModelProfile("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9, 8192),
        ModelProfile("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 7.62e9, 32768),
    )
}

# Datasheet figures: dense (not sparse) tensor-core peaks, HBM bandwidth, usable memory as the
# driver reports it (H100 80GB = 81,559 MiB).
GPUS: dict[str, GpuProfile] = {
    g.name: g
    for g in (
        GpuProfile("h100-sxm-80gb", 81559 * 2**20, 989.4, 1978.9, 3.35, 450.0),
        GpuProfile("h200-141gb", 143771 * 2**20, 989.4, 1978.9, 4.8, 450.0),
        GpuProfile("a100-sxm-80gb", 81920 * 2**20, 312.0, None, 2.039, 300.0),
    )
}


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ProfileError(
            f"dtype: unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}"
        ) from None


def get_model(name: str) -> ModelProfile:
    try:
        return MODELS[name]
    except KeyError:
        raise ProfileError(
            f"model: unknown model profile {name!r}; expected one of {', '.join(MODELS)}"
        ) from None


# A pool's `gpu: cpu`: its engines run on CPUs (vLLM's CPU build). A CPU has no roofline here
# (no datasheet peak that a batch's step time follows): no planned KV capacity, no planned
# prefill or in-flight limits; the engines report their capacity, `loadtest calibrate` learns
# the limits.
CPU = "cpu"
NO_ROOFLINE = (f"gpu: {CPU} has no roofline (an engine on a CPU): its KV capacity comes from "
               "the engines' own reports or kv_blocks, its limits from `loadtest calibrate`")


def get_gpu(name: str) -> GpuProfile:
    if name == CPU:
        raise ProfileError(NO_ROOFLINE)
    try:
        return GPUS[name]
    except KeyError:
        raise ProfileError(
            f"gpu: unknown GPU {name!r}; expected one of {', '.join(GPUS)}, or {CPU}"
        ) from None


def roofline_gpu(name: str) -> GpuProfile | None:
    """A pool's `gpu` as the planner's roofline takes it: None for `cpu` (none to take)."""
    return None if name == CPU else get_gpu(name)


@dataclass(frozen=True, slots=True)
class Ledger:
    """Per-GPU memory ledger of one engine replica, as vLLM computes it at start-up."""

    weights_per_gpu: float
    reserve_per_gpu: float
    kv_budget_per_gpu: float
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    block_size: int
    num_gpu_blocks: int

    @property
    def kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def ledger(
    model: ModelProfile,
    gpu: GpuProfile,
    tp: int,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: float | None = None,
    block_size: int = 16,
) -> Ledger:
    if tp <= 0:
        raise ProfileError(f"tp: must be a positive integer, got {tp}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ProfileError(
            f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}"
        )
    if reserve_bytes is None:
        reserve_bytes = default_reserve_bytes(model, tp)
    weights = model.weight_bytes_per_gpu(tp, dtype)
    budget = gpu.memory_bytes * gpu_memory_utilization - weights - reserve_bytes
    per_token_gpu = model.kv_bytes_per_token_per_gpu(tp, kv_dtype)
    blocks = max(0, int(budget // (per_token_gpu * block_size)))
    return Ledger(
        weights_per_gpu=weights,
        reserve_per_gpu=reserve_bytes,
        kv_budget_per_gpu=max(0.0, budget),
        kv_bytes_per_token=model.kv_bytes_per_token(kv_dtype),
        kv_bytes_per_token_per_gpu=per_token_gpu,
        block_size=block_size,
        num_gpu_blocks=blocks,
    )


def default_reserve_bytes(model: ModelProfile, tp: int) -> float:
    """Activation peak, CUDA graphs and NCCL buffers per GPU, as vLLM's profiling run finds them.

    Roughly: a fixed ~1.5 GiB (CUDA context, NCCL, graph pool) plus the activations of one
    max_num_batched_tokens (8192) step, which shrink with TP: logits (vocab x tokens x 4 B on
    every rank) and the MLP intermediate (tokens x intermediate / TP x 2 B x a few buffers).
    """
    tokens = 8192
    logits = tokens * model.vocab_size * 4 / tp
    mlp = tokens * model.intermediate_size * 2 * 4 / tp
    return 1.5 * GiB + logits + mlp


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) if tokens > 0 else 0


def vllm_batch_defaults(gpu: GpuProfile) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) recent vLLM picks for its OpenAI server on `gpu`.

    `EngineArgs.get_batch_defaults`: devices with >= 70 GiB that are not A100s (H100, H200,
    MI300x) get 8192 tokens and 1024 sequences; others 2048 and 256, because a large budget was
    measured to lower A100 throughput (vLLM PR #17885).
    """
    if gpu.memory_bytes >= 70 * GiB and "a100" not in gpu.name:
        return 8192, 1024
    return 2048, 256
