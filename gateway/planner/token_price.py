"""What each layout's tokens cost at the planned load (`gateway plan`, docs/planner.md, Cost).

`gateway/planner/throughput.py` says how many tokens a layout serves; this module prices them
by the gateway's own rule (`gateway/cost/pricing.py`, docs/cost.md): the deployment costs GPUs x
price per GPU-hour, busy or idle, and that spend is split between input and output tokens by
`--input-share` or by the estimated GPU time of prefill against decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.cost.pricing import ESTIMATED_SHARE, Price, gpu_spend, input_share, per_token
from gateway.planner.throughput import Lengths, Throughput


@dataclass(frozen=True, slots=True)
class LayoutPrice:
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


def price_layout(price: Price, gpus: int, tput: Throughput | None, holds: bool = True,
                 note: str = "", p_meets: float | None = None) -> LayoutPrice:
    per_hour = gpus * price.per_gpu_hour
    source = "from --input-share" if price.input_share is not None else ESTIMATED_SHARE
    if tput is None or tput.saturated:  # no load, or no steady state to put a price on
        return LayoutPrice(price.currency, per_hour, price.input_share, source, None, None, None,
                           holds, note, p_meets, None, None, None)
    # Replica time per request: its prefill against its decode steps, each step shared by the
    # batch it runs in (the gateway's own split, gateway/observe/accounting.py).
    out = tput.output_tokens_s / tput.requests_s if tput.requests_s else 0.0
    decode = out * tput.step_s / max(tput.batch_per_replica, 1.0)
    share = input_share(price.input_share, tput.prefill_s, decode, tput.input_tokens_s,
                        tput.output_tokens_s)
    per_s = gpu_spend(per_hour, 1.0)
    pt_in, pt_out = per_token(per_s, share, tput.input_tokens_s, tput.output_tokens_s)
    pm_in = None if pt_in is None else pt_in * 1e6
    pm_out = None if pt_out is None else pt_out * 1e6
    total = tput.input_tokens_s + tput.output_tokens_s
    pm_all = per_s / total * 1e6 if total else None

    def good(x: float | None) -> float | None:
        return None if x is None or not p_meets else x / p_meets

    return LayoutPrice(price.currency, per_hour, share, source, pm_in, pm_out, pm_all, holds,
                       note, p_meets, good(pm_all) if p_meets is not None else None,
                       good(pm_in) if p_meets is not None else None,
                       good(pm_out) if p_meets is not None else None)


def render(price: Price, gpus: int, lens: Lengths, rate: float | None,
           concurrency: int | None,
           rows: Sequence[tuple[int, int, Throughput | None, LayoutPrice]]) -> list[str]:
    """The cost section of `gateway plan`'s text output."""
    c = price.currency
    parts = " + ".join(f"{name} {v:,.2f}" for name, v in price.parts)
    lines = ["", f"cost ({c}): {gpus} GPUs x {price.per_gpu_hour:,.2f} per GPU-hour"
             + (f" ({parts})" if parts else "") + f" = {gpus * price.per_gpu_hour:,.2f} per hour"]
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
