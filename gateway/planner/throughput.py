"""What one layout serves at the planned load, as a roofline sees it (`gateway plan`).

The planner's ledger (`gateway/planner/capacity.py`) says what fits; this module says how fast a
layout serves the load: tokens per second, the batch each replica decodes, its time per output
token. `gateway/planner/token_price.py` then puts a price on those tokens. The efficiency
constants are the ones the gateway prices its own tokens with (`gateway/cost/pricing.py`).

The roofline, per replica of TP ranks:
  prefill of one request  P    = prefill FLOPs / (peak x TP x PREFILL_EFFICIENCY)
  one decode step of B    step = STEP_OVERHEAD_S
                                 + (weights per GPU + B x context x KV bytes per token per GPU)
                                   / (HBM bandwidth x DECODE_EFFICIENCY)
where context is the mean prompt plus half the mean output (a request half way through its
decode). At a rate of r requests/s per replica, prefill takes r x P of the replica's time and
decode steps run in the rest; Little's law for the requests in decode, B = r x output x step(B)
/ (1 - r x P), is linear in B and solved exactly. At a stated concurrency C the replica is never
idle: X x P + X x output x step(B) / B = 1 gives X = B / (B x P + output x step(B)) requests/s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.cost.pricing import DECODE_EFFICIENCY, PREFILL_EFFICIENCY
from gateway.cost.profiles import GpuProfile, ModelProfile, blocks_for
from gateway.cost.traces import TraceRequest

# Per decode step, beyond the HBM reads: kernel launches, sampling, the TP all-reduces' latency.
# A few milliseconds with CUDA graphs; an estimate, not a measurement (docs/planner.md, Limits).
STEP_OVERHEAD_S = 0.002
Z99 = 2.3263478740408408  # standard normal quantile at 0.99


@dataclass(frozen=True, slots=True)
class Lengths:
    """Mean request lengths the cost is computed at, and where they came from."""

    mean_prompt: float
    mean_output: float
    prefill_flops: float  # mean over requests (attention is quadratic: not the mean's FLOPs)
    source: str


def lognormal_mean(p50: int, p99: int) -> float:
    """Mean of the lognormal with this median and 99th percentile (P50 itself when equal)."""
    if p50 <= 0 or p99 <= p50:
        return float(p50)
    sigma = math.log(p99 / p50) / Z99
    return p50 * math.exp(sigma * sigma / 2)


def lengths(model: ModelProfile, p50: int, p99: int, output: int, prompt_mean: float | None,
            trace: Sequence[TraceRequest]) -> Lengths:
    """Mean prompt: --prompt-mean, else the trace's, else the lognormal through P50 and P99."""
    if prompt_mean is not None:
        mean, source = prompt_mean, "--prompt-mean"
    elif trace:
        mean = sum(r.prompt_tokens for r in trace) / len(trace)
        flops = sum(model.prefill_flops(r.prompt_tokens) for r in trace) / len(trace)
        return Lengths(mean, float(output), flops, "trace means")
    elif p99 == p50:
        mean, source = float(p50), "fixed: P50 = P99"
    else:
        mean, source = lognormal_mean(p50, p99), "lognormal mean from P50 and P99"
    return Lengths(mean, float(output), model.prefill_flops(round(mean)), source)


@dataclass(frozen=True, slots=True)
class Throughput:
    """One layout serving the planned load, as the roofline sees it."""

    mode: str  # "rate": tokens/s from --rate; "concurrency": from the roofline at --concurrency
    prefill_s: float  # one request's prefill on one replica
    step_s: float  # one decode step at batch_per_replica
    batch_per_replica: float  # requests decoding together (at least 1 while any decode)
    concurrency_per_replica: float  # requests holding KV: in prefill or decode
    tpot_s: float | None  # time per output token, prefill interruptions included
    requests_s: float  # the whole deployment
    input_tokens_s: float
    output_tokens_s: float
    saturated: bool  # the load exceeds what the roofline can serve


def throughput(model: ModelProfile, gpu: GpuProfile, tp: int, replicas: int, dtype: str,
               kv_dtype: str, lengths: Lengths, rate: float | None,
               concurrency: int | None) -> Throughput | None:
    """The roofline at `rate` requests/s (tokens from the rate) or at `concurrency`; None: no
    load. With both, the rate sets the tokens and the concurrency the batch."""
    if rate is None and concurrency is None:
        return None
    peak = gpu.peak_flops(dtype)
    hbm = gpu.hbm_tb_s * 1e12 * DECODE_EFFICIENCY
    prefill = lengths.prefill_flops / (peak * tp * PREFILL_EFFICIENCY)
    fixed = STEP_OVERHEAD_S + model.weight_bytes_per_gpu(tp, dtype) / hbm
    context = lengths.mean_prompt + lengths.mean_output / 2
    per_request = context * model.kv_bytes_per_token_per_gpu(tp, kv_dtype) / hbm
    out = lengths.mean_output

    def step(batch: float) -> float:
        return fixed + per_request * batch

    if rate is None:
        assert concurrency is not None
        batch = float(math.ceil(concurrency / replicas)) if concurrency else 0.0
        busy = batch * prefill + out * step(max(batch, 1.0))
        per_replica = batch / busy if busy > 0 else 0.0  # requests/s
        prefill_time = per_replica * prefill
        tpot = step(max(batch, 1.0)) / (1 - prefill_time) if out and prefill_time < 1 else None
        return Throughput("concurrency", prefill, step(max(batch, 1.0)), batch, batch, tpot,
                          per_replica * replicas, per_replica * replicas * lengths.mean_prompt,
                          per_replica * replicas * out, saturated=False)
    r = rate / replicas
    prefill_time = r * prefill
    saturated = prefill_time >= 1
    batch = 0.0
    if concurrency is not None:  # Little's law gave it: check decode keeps up at that batch
        batch = float(math.ceil(concurrency / replicas))
        saturated = saturated or r * out * step(max(batch, 1.0)) / max(batch, 1.0) \
            > 1 - prefill_time
    elif out and not saturated:
        room = (1 - prefill_time) - r * out * per_request
        saturated = room <= 0
        batch = r * out * fixed / room if room > 0 else 0.0
    if saturated:  # no steady state: the queue grows without bound
        return Throughput("rate", prefill, step(max(batch, 1.0)), batch, batch, None,
                          rate, rate * lengths.mean_prompt, rate * out, saturated=True)
    b = max(batch, 1.0)
    tpot = step(b) / (1 - prefill_time) if out else None
    in_flight = batch if concurrency is not None else r * (prefill + out * (tpot or 0.0))
    return Throughput("rate", prefill, step(b), batch, in_flight, tpot,
                      rate, rate * lengths.mean_prompt, rate * out, saturated=False)


def shortfall(weights_fit: bool, fits: bool, tput: Throughput | None, kv_blocks: int,
              block_size: int, lens: Lengths) -> str:
    """Why a layout cannot hold the load, the first reason that applies; "" when it can."""
    mean_len = math.ceil(lens.mean_prompt + lens.mean_output)
    capacity = kv_blocks // max(1, blocks_for(mean_len, block_size))
    held = math.ceil(tput.concurrency_per_replica - 1e-9) if tput is not None else 0
    return ("weights do not fit" if not weights_fit else
            "no KV budget left" if not fits else
            "load beyond the roofline's throughput" if tput is not None and tput.saturated else
            f"needs {held:,} requests in KV per replica, holds {capacity:,} at the mean length"
            if held > capacity else "")
