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

The price flags and their messages are `gateway plan`'s (`gateway/plancost.py` checks them);
that module is imported only when a price is given.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

COST_KEYS = ("cost_total", "cost_per_million_tokens", "cost_per_million_input_tokens",
             "cost_per_million_output_tokens", "cost_per_million_goodput_tokens",
             "cost_per_million_goodput_input_tokens", "cost_per_million_goodput_output_tokens")


class PricingError(ValueError):
    """A bad price flag; the message names the flag and the rule."""


def add_cost_options(p: argparse.ArgumentParser) -> None:
    """`--gpu-hour` | `--per-gpu-hour`, `--gpus`, `--currency`, `--input-share` (run, sweep)."""
    cost = p.add_argument_group("cost per token (docs/loadtest.md, Cost)")
    price = cost.add_mutually_exclusive_group()
    price.add_argument("--gpu-hour", type=float, metavar="PRICE", help="price per GPU-hour of "
                       "the target's GPUs")
    price.add_argument("--per-gpu-hour", metavar="NAME=PRICE,...", help="parts of the price "
                       "per GPU-hour, summed, e.g. hardware=1.4,power=0.35,operations=0.75")
    cost.add_argument("--gpus", type=int, metavar="N",
                      help="GPUs behind the target, busy or idle (required with a price)")
    cost.add_argument("--currency", default="USD", help="label for the prices (default USD)")
    cost.add_argument("--input-share", type=float, metavar="F",
                      help="share of the spend charged to input tokens (default: none; the "
                           "output figures then carry the whole spend)")


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
    """The flags -> Pricing, or None without a price. Namespaces without the flags (calibrate)
    have no price."""
    gpu_hour: float | None = getattr(args, "gpu_hour", None)
    per_gpu_hour: str | None = getattr(args, "per_gpu_hour", None)
    gpus: int | None = getattr(args, "gpus", None)
    input_share: float | None = getattr(args, "input_share", None)
    currency: str = getattr(args, "currency", "USD")
    if gpu_hour is None and per_gpu_hour is None:
        if gpus is not None:
            raise PricingError("--gpus: give a price with it (--gpu-hour or --per-gpu-hour)")
        if input_share is not None:
            raise PricingError("--input-share: give a price with it (--gpu-hour or "
                               "--per-gpu-hour)")
        return None
    from gateway.plancost import cost_model
    from gateway.profiles import ProfileError

    try:
        model = cost_model(gpu_hour, per_gpu_hour, currency, input_share)
    except ProfileError as exc:
        raise PricingError(str(exc)) from None
    assert model is not None
    if gpus is None:
        raise PricingError("--gpus: give the number of GPUs behind the target with a price "
                           "(the run's cost is GPUs x price per GPU-hour x its duration)")
    if gpus < 1:
        raise PricingError(f"--gpus: must be a positive integer, got {gpus}")
    return Pricing(gpus, model.per_gpu_hour, model.currency, model.input_share, model.parts)


def _per_million(spend: float, tokens: int | None) -> float | None:
    return spend / tokens * 1e6 if tokens else None


def cost_figures(report: Mapping[str, Any], pricing: Pricing) -> dict[str, Any]:
    """The report's cost keys, from its own `duration` and token counts."""
    duration = float(report["duration"])
    spend = pricing.per_hour * duration / 3600.0 if math.isfinite(duration) else math.nan
    share = pricing.input_share
    inp, out = int(report["total_input_tokens"]), int(report["total_output_tokens"])
    good_in: int | None = report.get("good_input_tokens")
    good_out: int | None = report.get("good_output_tokens")
    out_spend = spend * (1.0 - share) if share is not None else spend
    in_spend = spend * share if share is not None else None
    good_all = None if good_in is None or good_out is None else good_in + good_out
    figures: dict[str, Any] = {
        "cost": pricing.describe(),
        "cost_total": spend,
        "cost_per_million_tokens": _per_million(spend, inp + out),
        "cost_per_million_input_tokens": (_per_million(in_spend, inp)
                                          if in_spend is not None else None),
        "cost_per_million_output_tokens": _per_million(out_spend, out),
        "cost_per_million_goodput_tokens": _per_million(spend, good_all),
        "cost_per_million_goodput_input_tokens": (_per_million(in_spend, good_in)
                                                  if in_spend is not None else None),
        "cost_per_million_goodput_output_tokens": _per_million(out_spend, good_out),
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
