"""The thresholds in force for a pool, and where each came from.

An SRE's value in the policy wins over a learned one (written by `loadtest calibrate`); with
neither, the default applies. `/admin/state` and `/gateway/estimate` show the source, so
"why was this rejected?" has an answer that names the number and its origin.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from gateway.policy.model import PoolSpec

Source = Literal["policy", "learned", "default"]

DEFAULT_KV_USAGE_MAX = 0.9


@dataclass(frozen=True, slots=True)
class Threshold:
    value: float | None
    source: Source


@dataclass(frozen=True, slots=True)
class Thresholds:
    kv_usage_max: Threshold
    inflight_tokens_max: Threshold
    waiting_max: Threshold
    prefill_tokens_max: Threshold
    ttft_p99_max_s: Threshold
    tpot_p99_max_s: Threshold

    def as_dict(self) -> dict[str, dict[str, float | str | None]]:
        out: dict[str, dict[str, float | str | None]] = {}
        for f in fields(self):
            t: Threshold = getattr(self, f.name)
            out[f.name] = {"value": t.value, "source": t.source}
        return out


def _pick(mine: float | None, learned: float | None, default: float | None) -> Threshold:
    if mine is not None:
        return Threshold(mine, "policy")
    if learned is not None:
        return Threshold(learned, "learned")
    return Threshold(default, "default")


def thresholds_for(pool: PoolSpec) -> Thresholds:
    a = pool.admission
    learned = a.learned
    return Thresholds(
        kv_usage_max=_pick(a.kv_usage_max, learned.kv_usage_max if learned else None,
                           DEFAULT_KV_USAGE_MAX),
        inflight_tokens_max=_pick(a.inflight_tokens_max,
                                  learned.inflight_tokens_max if learned else None, None),
        waiting_max=_pick(a.waiting_max, learned.waiting_max if learned else None, None),
        prefill_tokens_max=_pick(a.prefill_tokens_max,
                                 learned.prefill_tokens_max if learned else None, None),
        ttft_p99_max_s=_pick(a.ttft_p99_max_s, learned.ttft_p99_max_s if learned else None,
                             None),
        tpot_p99_max_s=_pick(a.tpot_p99_max_s, learned.tpot_p99_max_s if learned else None,
                             None),
    )
