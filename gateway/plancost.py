"""Cost per token for `gateway plan`: each layout's roofline at the planned load, priced.

The planner's ledger says what fits; this module says how fast a layout serves the load and what
its tokens then cost. It prices tokens the way the gateway does at run time
(`gateway/observe/accounting.py`, docs/cost.md): the deployment costs GPUs x price per
GPU-hour, busy or idle, and that spend is split between input and output tokens by
`--input-share` or by the estimated GPU time of prefill against decode, with the same
efficiency constants.

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

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.cost.traces import TraceRequest
from gateway.observe.accounting import DECODE_EFFICIENCY, PREFILL_EFFICIENCY
from gateway.profiles import GpuProfile, ModelProfile, ProfileError, blocks_for

# Per decode step, beyond the HBM reads: kernel launches, sampling, the TP all-reduces' latency.
# A few milliseconds with CUDA graphs; an estimate, not a measurement (docs/planner.md, Limits).
STEP_OVERHEAD_S = 0.002
Z99 = 2.3263478740408408  # standard normal quantile at 0.99
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")  # as the policy's names


def add_arguments(p: argparse.ArgumentParser) -> None:
    cost = p.add_argument_group("cost per token (docs/planner.md, Cost)")
    price = cost.add_mutually_exclusive_group()
    price.add_argument("--gpu-hour", type=float, metavar="PRICE", help="price per GPU-hour")
    price.add_argument("--per-gpu-hour", metavar="NAME=PRICE,...", help="parts of the price "
                       "per GPU-hour, summed, e.g. hardware=1.4,power=0.35,operations=0.75")
    cost.add_argument("--currency", default="USD", help="label for the prices (default USD)")
    cost.add_argument("--input-share", type=float, metavar="F", help="share of the cost "
                      "charged to input tokens (default: estimated prefill vs decode GPU time)")


@dataclass(frozen=True, slots=True)
class CostModel:
    per_gpu_hour: float
    currency: str = "USD"
    input_share: float | None = None  # None: estimated from prefill vs decode GPU time
    parts: tuple[tuple[str, float], ...] = ()  # --per-gpu-hour's parts, summed into the price


def cost_model(gpu_hour: float | None, per_gpu_hour: str | None, currency: str,
               input_share: float | None) -> CostModel | None:
    """The flags -> a CostModel, or None without a price; ProfileError names the flag."""
    if gpu_hour is None and per_gpu_hour is None:
        if input_share is not None:
            raise ProfileError("--input-share: give a price with it (--gpu-hour or "
                               "--per-gpu-hour)")
        return None
    parts: tuple[tuple[str, float], ...] = ()
    if per_gpu_hour is not None:
        parts = parse_parts(per_gpu_hour)
        price = sum(v for _, v in parts)
    else:
        assert gpu_hour is not None
        price = gpu_hour
        if not math.isfinite(price) or price < 0:
            raise ProfileError(f"--gpu-hour: must be a price per GPU-hour >= 0, got {price:g}")
    if input_share is not None and not 0.0 <= input_share <= 1.0:
        raise ProfileError(f"--input-share: must be between 0 and 1, got {input_share:g}")
    if not currency.strip() or len(currency) > 8:
        raise ProfileError(f"--currency: must be 1 to 8 characters, got {currency!r}")
    return CostModel(price, currency, input_share, parts)


def parse_parts(text: str) -> tuple[tuple[str, float], ...]:
    """`hardware=1.4,power=0.35` -> (("hardware", 1.4), ("power", 0.35))."""
    rule = "expected NAME=PRICE[,NAME=PRICE...] with prices per GPU-hour >= 0"
    parts: list[tuple[str, float]] = []
    for item in text.split(","):
        name, eq, value = item.strip().partition("=")
        name = name.strip()
        try:
            price = float(value)
        except ValueError:
            price = math.nan
        if not eq or not _PART.match(name) or not math.isfinite(price):
            raise ProfileError(f"--per-gpu-hour: {rule}, got {item.strip()!r}")
        if price < 0:
            raise ProfileError(f"--per-gpu-hour: {name} must not be negative, got {price:g}")
        if any(name == seen for seen, _ in parts):
            raise ProfileError(f"--per-gpu-hour: {name} is given twice")
        parts.append((name, price))
    return tuple(parts)


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


@dataclass(frozen=True, slots=True)
class LayoutCost:
    """What one layout's tokens cost at the planned load."""

    currency: str
    per_hour: float  # GPUs x price per GPU-hour, busy or idle
    input_share: float | None  # share of the spend charged to input tokens
    input_share_source: str  # "from --input-share" or "estimated from prefill vs decode ..."
    per_million_input: float | None  # None: no input (or output) tokens at this load
    per_million_output: float | None
    per_million: float | None  # all tokens, input and output together
    holds: bool  # the layout holds the load (weights fit, KV and roofline not exceeded)
    note: str  # why it does not, or ""
    p_meets: float | None  # trace: share of requests not preempted for KV (None: no trace)
    per_million_goodput: float | None  # all tokens that meet the SLO (trace only)
    per_million_goodput_input: float | None
    per_million_goodput_output: float | None


def price(cm: CostModel, gpus: int, tput: Throughput | None, holds: bool = True,
          note: str = "", p_meets: float | None = None) -> LayoutCost:
    per_hour = gpus * cm.per_gpu_hour
    source = "from --input-share" if cm.input_share is not None else (
        "estimated from prefill vs decode GPU time")
    if tput is None or tput.saturated:  # no load, or no steady state to put a price on
        return LayoutCost(cm.currency, per_hour, cm.input_share, source, None, None, None,
                          holds, note, p_meets, None, None, None)
    share = cm.input_share
    if share is None:
        # Replica time per request: its prefill against its decode steps, each step shared by
        # the batch it runs in (the gateway's own split, gateway/observe/accounting.py).
        out = tput.output_tokens_s / tput.requests_s if tput.requests_s else 0.0
        decode = out * tput.step_s / max(tput.batch_per_replica, 1.0)
        busy = tput.prefill_s + decode
        share = tput.prefill_s / busy if busy else 0.5
    if not tput.input_tokens_s:
        share = 0.0
    if not tput.output_tokens_s:
        share = 1.0
    per_s = per_hour / 3600
    pm_in = per_s * share / tput.input_tokens_s * 1e6 if tput.input_tokens_s else None
    pm_out = per_s * (1 - share) / tput.output_tokens_s * 1e6 if tput.output_tokens_s else None
    total = tput.input_tokens_s + tput.output_tokens_s
    pm_all = per_s / total * 1e6 if total else None

    def good(x: float | None) -> float | None:
        return None if x is None or not p_meets else x / p_meets

    return LayoutCost(cm.currency, per_hour, share, source, pm_in, pm_out, pm_all, holds, note,
                      p_meets, good(pm_all) if p_meets is not None else None,
                      good(pm_in) if p_meets is not None else None,
                      good(pm_out) if p_meets is not None else None)



def render(cm: CostModel, gpus: int, lens: Lengths, rate: float | None,
           concurrency: int | None,
           rows: Sequence[tuple[int, int, Throughput | None, LayoutCost]]) -> list[str]:
    """The cost section of `gateway plan`'s text output."""
    c = cm.currency
    parts = " + ".join(f"{name} {v:,.2f}" for name, v in cm.parts)
    lines = ["", f"cost ({c}): {gpus} GPUs x {cm.per_gpu_hour:,.2f} per GPU-hour"
             + (f" ({parts})" if parts else "") + f" = {gpus * cm.per_gpu_hour:,.2f} per hour"]
    if rate is None and concurrency is None:
        return [*lines, "  give --rate or --concurrency for a price per token"]
    load = (f"{rate:g} req/s (--rate)" if rate is not None
            else f"{concurrency} concurrent requests (--concurrency; tokens/s from the roofline)")
    lines.append(f"  load: {load}, mean prompt {lens.mean_prompt:,.0f} + output "
                 f"{lens.mean_output:,.0f} tokens ({lens.source})")
    good = any(cost.p_meets is not None for *_, cost in rows)
    lines.append("  TP x replicas  input tok/s  output tok/s  batch/replica     TPOT  input share"
                 f"  {c}/M input  {c}/M output" + (
                     f"  P(meets)  {c}/M good in  {c}/M good out" if good else ""))

    def money(x: float | None, width: int) -> str:
        return f"{'-' if x is None else f'{x:,.3f}':>{width}}"

    for tp, replicas, t, cost in rows:
        if t is None:
            continue
        tpot = "-" if t.tpot_s is None else f"{t.tpot_s * 1e3:.1f} ms"
        share = "-" if cost.input_share is None else f"{cost.input_share:.3f}"
        row = (f"  TP={tp:<2} x {replicas:<5}  {t.input_tokens_s:>11,.0f}"
               f"  {t.output_tokens_s:>12,.0f}  {t.batch_per_replica:>13,.1f}"
               f"  {tpot:>7}  {share:>11}"
               f"  {money(cost.per_million_input, len(c) + 8)}"
               f"  {money(cost.per_million_output, len(c) + 9)}")
        if good:
            meets = "-" if cost.p_meets is None else f"{cost.p_meets:.2%}"
            row += (f"  {meets:>8}  {money(cost.per_million_goodput_input, len(c) + 12)}"
                    f"  {money(cost.per_million_goodput_output, len(c) + 13)}")
        lines.append(row + (f"  -- cannot hold the load: {cost.note}" if cost.note else ""))
    source = rows[0][3].input_share_source if rows else ""
    lines.append(f"  (input share {source}; GPUs cost the same busy or idle"
                 + ("; P(meets): requests not preempted for KV at final length, from the trace"
                    if good else "") + ")")
    return lines
