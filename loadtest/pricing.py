"""What a run's tokens cost, from the price of the GPUs behind the target (docs/loadtest.md, Cost).

The GPUs cost the same busy or idle, so a run costs GPUs x price per GPU-hour x its `duration`
(vLLM's: the first send to the last answer), and that spend is divided by the tokens it bought:

  cost_per_million_tokens                 = spend / (input + output tokens) x 10^6
  cost_per_million_output_tokens          = spend x (1 - share) / output tokens x 10^6
  cost_per_million_input_tokens           = spend x share / input tokens x 10^6   (with a share)
  cost_per_million_goodput_*              = the same over the tokens of the requests that met
                                            every SLO (completed requests only; needs --slo)

`share` is `--input-share`; without it no split is guessed (a load test cannot see the engine's
prefill and decode time, which is what `gateway plan` and the gateway itself split by): the
output figure then charges the whole spend to output tokens, the way a price per million output
tokens is usually quoted, and there is no input figure. Token counts are the report's own (the
target's `usage` of completed requests), so every figure can be recomputed from the JSON.

The price flags, their checks and the spend's split are `gateway/cost/pricing.py`'s, as for
`gateway plan` and the gateway itself; this module adds `--gpus` (what the target runs on) and
the report's figures.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.cost.pricing import (
    PriceError,
    add_price_arguments,
    gpu_spend,
    per_token,
    price_from_args,
)

COST_KEYS = ("cost_total", "cost_per_million_tokens", "cost_per_million_input_tokens",
             "cost_per_million_output_tokens", "cost_per_million_goodput_tokens",
             "cost_per_million_goodput_input_tokens", "cost_per_million_goodput_output_tokens")


def add_price_options(p: argparse.ArgumentParser) -> None:
    """The price flags (`--gpu-hour` | `--per-gpu-hour`, `--currency`, `--input-share`) and
    `--gpus` (run, sweep)."""
    group = add_price_arguments(p, "docs/loadtest.md", price_of=" of the target's GPUs",
                                input_share_default="none; the output figures then carry the "
                                "whole spend")
    group.add_argument("--gpus", type=int, metavar="N",
                       help="GPUs behind the target, busy or idle (required with a price)")


@dataclass(frozen=True, slots=True)
class Pricing:
    gpus: int
    per_gpu_hour: float
    currency: str = "USD"
    input_share: float | None = None
    parts: tuple[tuple[str, float], ...] = ()

    @property
    def per_hour(self) -> float:
        return self.gpus * self.per_gpu_hour

    def describe(self) -> dict[str, Any]:
        """The price as the report records it (its `cost` key)."""
        return {"currency": self.currency, "gpus": self.gpus, "per_gpu_hour": self.per_gpu_hour,
                "parts": dict(self.parts), "per_hour": self.per_hour,
                "input_share": self.input_share}


def parse_pricing(args: argparse.Namespace) -> Pricing | None:
    """The flags -> Pricing, or None without a price; PriceError names the flag. Namespaces
    without the flags (calibrate) have no price."""
    gpus: int | None = getattr(args, "gpus", None)
    if gpus is not None and getattr(args, "gpu_hour", None) is None \
            and getattr(args, "per_gpu_hour", None) is None:
        raise PriceError("--gpus: give a price with it (--gpu-hour or --per-gpu-hour)")
    price = price_from_args(args)
    if price is None:
        return None
    if gpus is None:
        raise PriceError("--gpus: give the number of GPUs behind the target with a price "
                         "(the run's cost is GPUs x price per GPU-hour x its duration)")
    if gpus < 1:
        raise PriceError(f"--gpus: must be a positive integer, got {gpus}")
    return Pricing(gpus, price.per_gpu_hour, price.currency, price.input_share, price.parts)


def _per_million(per_token: float | None) -> float | None:
    return None if per_token is None else per_token * 1e6


def cost_figures(report: Mapping[str, Any], pricing: Pricing) -> dict[str, Any]:
    """The report's cost keys, from its own `duration` and token counts."""
    duration = float(report["duration"])
    spend = gpu_spend(pricing.per_hour, duration) if math.isfinite(duration) else math.nan
    share = pricing.input_share
    inp, out = int(report["total_input_tokens"]), int(report["total_output_tokens"])
    good_in: int | None = report.get("good_input_tokens")
    good_out: int | None = report.get("good_output_tokens")
    good_all = None if good_in is None or good_out is None else good_in + good_out
    # Without a share, output tokens carry the whole spend and input tokens get no figure.
    split = 0.0 if share is None else share
    per_in, per_out = per_token(spend, split, inp, out)
    good_per_in, good_per_out = per_token(spend, split, good_in or 0, good_out or 0)
    figures: dict[str, Any] = {
        "cost": pricing.describe(),
        "cost_total": spend,
        "cost_per_million_tokens": spend / (inp + out) * 1e6 if inp + out else None,
        "cost_per_million_input_tokens": _per_million(per_in) if share is not None else None,
        "cost_per_million_output_tokens": _per_million(per_out),
        "cost_per_million_goodput_tokens": spend / good_all * 1e6 if good_all else None,
        "cost_per_million_goodput_input_tokens": (_per_million(good_per_in)
                                                  if share is not None else None),
        "cost_per_million_goodput_output_tokens": _per_million(good_per_out),
    }
    return figures


def cheapest(steps: Sequence[dict[str, Any]], passed: Callable[[dict[str, Any]], bool],
             knee: float | None) -> dict[str, Any] | None:
    """The step, at or below the knee and meeting the target (`passed(step)`), with the lowest
    cost per million goodput tokens; on a tie the lower load (further from the knee). None
    without a price or a knee."""
    if knee is None:
        return None
    best: dict[str, Any] | None = None
    best_key: tuple[float, float] | None = None
    for step in steps:
        cost = step["report"].get("cost_per_million_goodput_tokens")
        if cost is None or float(step["offered"]) > knee or not passed(step):
            continue
        key = (float(cost), float(step["offered"]))
        if best_key is None or key < best_key:
            best, best_key = step, key
    return best
