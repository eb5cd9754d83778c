"""How long one engine step takes: a roofline of the model on the GPU, per tensor-parallel rank.

A step runs every scheduled token through the model once. Its time is the sum of the phases a
real forward pass runs one after the other, each bound by compute or memory, whichever is slower:

  dense GEMMs   one GEMM over all T tokens of the step (prefill chunks and decodes together):
                max(2 x params x T / TP over peak FLOPs x GEMM_EFFICIENCY,
                    weight bytes per GPU over HBM bandwidth x HBM_EFFICIENCY)
  elementwise   norms, RoPE, residual adds, SiLU x gate between the GEMMs: memory bound,
                ACTIVATION_PASSES_HIDDEN passes over the 16-bit hidden state (full width on every
                rank) and ACTIVATION_PASSES_MLP over this rank's MLP slice, per token per layer
  attention     per sequence, FlashAttention-style: max(QK^T + AV FLOPs of its new tokens
                against its whole context over peak x ATTENTION_EFFICIENCY,
                its KV bytes (context + new) per GPU over HBM bandwidth x HBM_EFFICIENCY)
  all-reduce    2 per layer (after attention and after the MLP), ring over NVLink:
                2 (TP-1)/TP x T x hidden x 2 bytes over link bandwidth x NVLINK_EFFICIENCY,
                plus ALLREDUCE_LATENCY_S each
  overhead      STEP_OVERHEAD_S + PER_SEQUENCE_OVERHEAD_S x sequences (scheduler, input
                preparation, sampling, output processing: CPU time not hidden behind the GPU)

Why max inside a phase and sum across phases: the decodes of a mixed step share the GEMMs with
the prefill chunk (the weights are read once for all T tokens), so a decode rides along for free
until its tokens add compute; attention and the all-reduces are separate kernels that run after
one another, so their times add. A pure decode step is therefore weight-read bound (the classic
memory-bound TPOT), a long prefill compute bound, and a chunked-prefill step lands in between.

The efficiencies are named constants, one value each for every model, GPU, dtype and TP, set from
what kernels are known to reach on Hopper (not fitted per benchmark case); docs/simulator.md
compares the result against published measurements.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.cost.profiles import GpuProfile, ModelProfile

# Fraction of the dense tensor-core peak the prefill GEMMs reach (cuBLAS/CUTLASS on Hopper reach
# 60-70% on large shapes, less on the narrow per-rank shapes of high TP).
GEMM_EFFICIENCY = 0.60
# Fraction of the BF16 peak FlashAttention reaches in prefill (FA2 ~35-50%, FA3 ~55-75% on H100).
ATTENTION_EFFICIENCY = 0.50
# Fraction of datasheet HBM bandwidth that decode's weight and KV streaming sustains (skinny
# GEMMs at batch <= 64 and paged-attention gathers reach 55-70% of peak; STREAM-like copies 80-90%).
HBM_EFFICIENCY = 0.60
# Reads and writes of activations per token per layer outside the GEMMs, after the usual fusions
# (add+RMSNorm, SiLU x mul): about 10 passes over the hidden state and 4 over the MLP slice.
ACTIVATION_PASSES_HIDDEN = 10
ACTIVATION_PASSES_MLP = 4
# Fraction of NVLink per-direction bandwidth a ring all-reduce reaches as bus bandwidth.
NVLINK_EFFICIENCY = 0.70
# Launch plus synchronisation of one small all-reduce (vLLM's custom all-reduce / NCCL LL).
ALLREDUCE_LATENCY_S = 8e-6
# CPU work per step not overlapped with the GPU, and its growth with the batch.
STEP_OVERHEAD_S = 1.5e-3
PER_SEQUENCE_OVERHEAD_S = 4e-6
# Activations cross the all-reduce in 16-bit even when weights are FP8.
ACTIVATION_BYTES = 2
# Not GPU time: the API server's share of a request's latency, which a client sees in its TTFT
# and the roofline does not. vLLM V1 runs the HTTP server in its own process: request parsing
# and validation, the chat template, tokenization, then a ZMQ message to the EngineCore process,
# which picks the request up at its next step; on the way back the first token crosses ZMQ
# again, is detokenized by the output processor, serialised as a chunk and written as SSE.
# Measured end to end as client TTFT minus vLLM's own TTFT histogram (which starts once the
# request is tokenized): 8-12 ms for 512-token prompts (vLLM PR #54628, V1, `vllm bench serve`),
# plus ~1 ms for the two ZMQ hops and the output processor. One value for every case, applied
# once per request between its arrival and its entry into the waiting queue (at light load only
# the sum of the input and output halves shows; under load the engine's queue dominates).
FRONTEND_LATENCY_S = 12e-3


@dataclass(frozen=True, slots=True)
class StepTime:
    gemm_s: float
    elementwise_s: float
    attention_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return (self.gemm_s + self.elementwise_s + self.attention_s + self.allreduce_s
                + self.overhead_s)


class StepTimeModel:
    """Step time of a batch of (new tokens, tokens already in the KV cache) chunks."""

    def __init__(self, model: ModelProfile, gpu: GpuProfile, tp: int, dtype: str,
                 kv_dtype: str) -> None:
        self.model = model
        self.gpu = gpu
        self.tp = tp
        # FP8 weights on a GPU without FP8 tensor cores run as weight-only FP8 (vLLM's Marlin
        # kernels): half the bytes, but the math stays at the 16-bit peak.
        gemm_peak = (gpu.fp8_tflops if dtype == "fp8" and gpu.fp8_tflops else gpu.bf16_tflops)
        self._gemm_flops_per_s = gemm_peak * 1e12 * GEMM_EFFICIENCY
        self._attn_flops_per_s = gpu.bf16_tflops * 1e12 * ATTENTION_EFFICIENCY
        self._hbm_bytes_per_s = gpu.hbm_tb_s * 1e12 * HBM_EFFICIENCY
        self._weight_bytes = model.weight_bytes_per_gpu(tp, dtype)
        self._dense_flops_per_token = 2.0 * model.params / tp
        self._kv_bytes_per_token = model.kv_bytes_per_token_per_gpu(tp, kv_dtype)
        # Attention FLOPs per (query, key) pair on one rank: QK^T and AV, 2 x head_dim each,
        # for this rank's share of the query heads, in every layer.
        heads_per_rank = max(1, model.num_attention_heads // tp)
        self._attn_flops_per_pair = 4.0 * model.num_layers * heads_per_rank * model.head_dim
        self._activation_bytes_per_token = model.num_layers * ACTIVATION_BYTES * (
            ACTIVATION_PASSES_HIDDEN * model.hidden_size
            + ACTIVATION_PASSES_MLP * model.intermediate_size / tp)
        self._collectives = 2 * model.num_layers if tp > 1 else 0
        link = gpu.interconnect_gb_s * 1e9 * NVLINK_EFFICIENCY
        self._allreduce_s_per_token = (
            2.0 * (tp - 1) / tp * model.hidden_size * ACTIVATION_BYTES / link if tp > 1 else 0.0)

    def step(self, chunks: Iterable[tuple[int, int]]) -> StepTime:
        """`chunks`: one (new_tokens, context_tokens) pair per scheduled sequence."""
        tokens = 0
        sequences = 0
        attention_s = 0.0
        decode_kv_tokens = 0
        decode_pairs = 0
        for new, context in chunks:
            tokens += new
            sequences += 1
            if new == 1:
                # Decodes are all memory bound (8 FLOPs per KV byte for GQA 64/8 against a
                # ridge of ~300): sum them and take one roofline, which is what one batched
                # paged-attention kernel does.
                decode_kv_tokens += context + 1
                decode_pairs += context + 1
                continue
            pairs = new * context + new * (new + 1) / 2
            attention_s += max(self._attn_flops_per_pair * pairs / self._attn_flops_per_s,
                               (context + new) * self._kv_bytes_per_token / self._hbm_bytes_per_s)
        if sequences == 0:
            return StepTime(0.0, 0.0, 0.0, 0.0, 0.0)
        if decode_kv_tokens:
            attention_s += max(self._attn_flops_per_pair * decode_pairs / self._attn_flops_per_s,
                               decode_kv_tokens * self._kv_bytes_per_token / self._hbm_bytes_per_s)
        gemm_s = max(self._dense_flops_per_token * tokens / self._gemm_flops_per_s,
                     self._weight_bytes / self._hbm_bytes_per_s)
        elementwise_s = tokens * self._activation_bytes_per_token / self._hbm_bytes_per_s
        allreduce_s = self._collectives * (ALLREDUCE_LATENCY_S
                                           + tokens * self._allreduce_s_per_token)
        overhead_s = STEP_OVERHEAD_S + PER_SEQUENCE_OVERHEAD_S * sequences
        return StepTime(gemm_s, elementwise_s, attention_s, allreduce_s, overhead_s)

    def decode_step_s(self, batch: int, context: int) -> float:
        """Step time of `batch` decodes at `context` tokens each (for docs and planning)."""
        return self.step([(1, context)] * batch).total_s

    def prefill_s(self, tokens: int) -> float:
        """Time of one step that prefills `tokens` fresh tokens of one sequence."""
        return self.step([(tokens, 0)]).total_s
