"""Money: what the GPUs cost, and how that spend becomes a price per token.

`work.py` beside it is the work a request brings (KV blocks, tokens); this module is the money,
and the one rule that the three places putting a price on tokens share: the gateway at run time
(`gateway/observe/accounting.py`), the capacity planner (`gateway/planner/`) and the load tester
(`loadtest/pricing.py`); docs/cost.md, docs/planner.md and docs/loadtest.md describe each.

- A deployment costs GPUs x price per GPU-hour, busy or idle (`gpu_spend`).
- That spend is split between input and output tokens: a share to input tokens, stated, or
  estimated from the GPU time of prefill against decode (`input_share`); each part divided by
  its tokens is the price of one (`per_token`). Output costs more per token than input: it
  holds KV cache and decode time.
- Prefill and decode GPU time come from a roofline: prefill at PREFILL_EFFICIENCY of the peak
  FLOPs, decode at DECODE_EFFICIENCY of the HBM bandwidth.

The price flags (`--gpu-hour` | `--per-gpu-hour`, `--currency`, `--input-share`) are defined
once (`add_price_arguments`) and read once (`price_from_args`), for `gateway plan` and
`loadtest run | sweep` alike, so they parse and fail with the same messages everywhere.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

PREFILL_EFFICIENCY = 0.5  # share of peak FLOPs a prefill reaches
DECODE_EFFICIENCY = 0.7  # share of HBM bandwidth a decode step reaches
ESTIMATED_SHARE = "estimated from prefill vs decode GPU time"  # where a split came from
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")  # as the policy's names


class PriceError(ValueError):
    """A bad price flag; the message names the flag and the rule."""


@dataclass(frozen=True, slots=True)
class Price:
    """What one GPU costs per hour, and how to split the spend between input and output."""

    per_gpu_hour: float
    currency: str = "USD"
    input_share: float | None = None  # None: estimated from prefill vs decode GPU time
    parts: tuple[tuple[str, float], ...] = ()  # --per-gpu-hour's parts, summed into the price


# --- the spend and its split ----------------------------------------------------------------


def gpu_spend(per_hour: float, seconds: float) -> float:
    """What `seconds` of a deployment costing `per_hour` cost, busy or idle."""
    return per_hour * seconds / 3600


def input_share(stated: float | None, prefill_s: float, decode_s: float, input_tokens: float,
                output_tokens: float) -> float:
    """The share of the spend charged to input tokens: `stated`, else the prefill's share of
    the GPU time (half when there was none); all of it goes to the only kind of token served."""
    share = stated
    if share is None:
        busy = prefill_s + decode_s
        share = prefill_s / busy if busy > 0 else 0.5
    if not input_tokens:
        share = 0.0
    if not output_tokens:
        share = 1.0
    return share


def per_token(spend: float, share: float, input_tokens: float, output_tokens: float
              ) -> tuple[float | None, float | None]:
    """The price of one input and one output token when `share` of `spend` is charged to input
    tokens; None for a kind with no tokens to charge."""
    return (spend * share / input_tokens if input_tokens else None,
            spend * (1 - share) / output_tokens if output_tokens else None)


# --- the flags --------------------------------------------------------------------------------


def add_price_arguments(p: argparse.ArgumentParser, docs: str, *, price_of: str = "",
                        input_share_default: str) -> argparse._ArgumentGroup:
    """The price flags, in a group titled after `docs` (where the command's figures are
    explained); the caller may add its own flags to the group returned (loadtest's `--gpus`).
    `price_of` ends the help of `--gpu-hour`; `input_share_default` says what happens without
    `--input-share`."""
    group = p.add_argument_group(f"cost per token ({docs}, Cost)")
    price = group.add_mutually_exclusive_group()
    price.add_argument("--gpu-hour", type=float, metavar="PRICE",
                       help=f"price per GPU-hour{price_of}")
    price.add_argument("--per-gpu-hour", metavar="NAME=PRICE,...", help="parts of the price "
                       "per GPU-hour, summed, e.g. hardware=1.4,power=0.35,operations=0.75")
    group.add_argument("--currency", default="USD", help="label for the prices (default USD)")
    group.add_argument("--input-share", type=float, metavar="F", help="share of the spend "
                       f"charged to input tokens (default: {input_share_default})")
    return group


def price_from_args(args: argparse.Namespace) -> Price | None:
    """The flags' values -> a Price, or None without a price; PriceError names the flag. A
    namespace without the flags (`loadtest calibrate`) has no price."""
    return parse_price(getattr(args, "gpu_hour", None), getattr(args, "per_gpu_hour", None),
                       getattr(args, "currency", "USD"), getattr(args, "input_share", None))


def parse_price(gpu_hour: float | None, per_gpu_hour: str | None, currency: str,
                input_share: float | None) -> Price | None:
    """The flags' values, checked -> a Price, or None without a price."""
    if gpu_hour is None and per_gpu_hour is None:
        if input_share is not None:
            raise PriceError("--input-share: give a price with it (--gpu-hour or "
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
            raise PriceError(f"--gpu-hour: must be a price per GPU-hour >= 0, got {price:g}")
    if input_share is not None and not 0.0 <= input_share <= 1.0:
        raise PriceError(f"--input-share: must be between 0 and 1, got {input_share:g}")
    if not currency.strip() or len(currency) > 8:
        raise PriceError(f"--currency: must be 1 to 8 characters, got {currency!r}")
    return Price(price, currency, input_share, parts)


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
            raise PriceError(f"--per-gpu-hour: {rule}, got {item.strip()!r}")
        if price < 0:
            raise PriceError(f"--per-gpu-hour: {name} must not be negative, got {price:g}")
        if any(name == seen for seen, _ in parts):
            raise PriceError(f"--per-gpu-hour: {name} is given twice")
        parts.append((name, price))
    return tuple(parts)
