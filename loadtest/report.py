"""What a run measured, as users feel it: latency percentiles, throughput, goodput, rejections.

Definitions follow vLLM's `benchmark_serving` so figures and JSON keys compare one to one:
TPOT of a request is (E2E - TTFT) / (output tokens - 1); ITLs are the gaps between chunks after
the first token; goodput is the completed requests that meet every SLO, per second of the run;
throughputs divide by the whole run's duration. Ours beside them: rejections (429/503, which a
gateway answers on purpose and which are not measurement errors) with their Retry-After, the
gateway's queue time, SLO attainment, and each figure's own noise (see `noise`).

Rates that are shares are percentages (`error_rate_pct`, `slo_attainment_pct`), so a gate
allowance in percentage points reads directly.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.client import RequestResult
from loadtest.stats import percentile_sorted

PERCENTILES = (50, 90, 95, 99)
REJECTION_STATUSES = (429, 503)
# SLO names accepted on the command line -> the per-request figure they bound.
SLO_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2el", "e2el": "e2el", "itl": "itl"}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*$")


class SloError(ValueError):
    """An SLO string that does not parse; the message quotes it and shows the form."""


def parse_duration(text: str, what: str) -> float:
    """`2s`, `60ms`, `1.5s` -> seconds. A bare number is refused: ms or s is too easy to mix."""
    m = _DURATION.match(text)
    if m is None:
        raise SloError(f"{what}: {text!r} is not a duration; write it with a unit, like 2s or "
                       "60ms")
    value = float(m.group(1))
    return value / 1000.0 if m.group(2) == "ms" else value


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=2s,tpot=60ms[,e2e=30s][,itl=200ms]` -> {"ttft": 2.0, "tpot": 0.06, ...} seconds."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        key = SLO_NAMES.get(name.strip().lower())
        if not sep or key is None:
            raise SloError(f"--slo {text!r}: expected NAME=DURATION[,...] with NAME one of ttft, "
                           "tpot, e2e, itl, e.g. ttft=2s,tpot=60ms")
        seconds = parse_duration(value, f"--slo {name.strip()}")
        if seconds <= 0:
            raise SloError(f"--slo {name.strip()}: must be positive, got {value!r}")
        out[key] = seconds
    return out


def format_slo(slo: Mapping[str, float]) -> str:
    return ",".join(f"{k}={v * 1000:g}ms" for k, v in slo.items())


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as sent (its lengths) and as answered."""

    index: int
    prompt_tokens: int        # as built; the target's usage wins when it reports one
    output_tokens: int        # as asked (max_tokens)
    result: RequestResult

    @property
    def kind(self) -> str:
        r = self.result
        if r.ok:
            return "ok"
        return "rejected" if r.status in REJECTION_STATUSES else "error"

    @property
    def output_len(self) -> int:
        r = self.result
        if r.usage is not None:
            return r.usage.completion_tokens
        if r.ttft_s is None:
            return 0
        return len(r.gaps_s) + 1  # one chunk a token, as vLLM streams; an estimate otherwise

    @property
    def input_len(self) -> int:
        u = self.result.usage
        return u.prompt_tokens if u is not None and u.prompt_tokens else self.prompt_tokens

    @property
    def tpot_s(self) -> float | None:
        r = self.result
        n = self.output_len
        if r.ttft_s is None or n < 2:
            return None
        return (r.e2e_s - r.ttft_s) / (n - 1)

    def meets(self, slo: Mapping[str, float]) -> bool:
        """vLLM's goodput test: every SLO given holds (a 1-token answer has no TPOT to miss)."""
        r = self.result
        if not r.ok or r.ttft_s is None:
            return False
        for key, limit in slo.items():
            if key == "ttft" and r.ttft_s > limit:
                return False
            if key == "e2el" and r.e2e_s > limit:
                return False
            if key == "tpot":
                tpot = self.tpot_s
                if tpot is not None and tpot > limit:
                    return False
            if key == "itl" and r.max_gap_s > limit:
                return False
        return True


def _summary(name: str, values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/median/std/pNN of `values` in ms under vLLM's key names; NaN-free (None when empty)."""
    out: dict[str, Any] = {}
    ordered = sorted(values)
    if not ordered:
        for key in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)):
            out[f"{key}_{name}_ms"] = None
        return out
    out[f"mean_{name}_ms"] = statistics.fmean(ordered) * scale
    out[f"median_{name}_ms"] = percentile_sorted(ordered, 50) * scale
    out[f"std_{name}_ms"] = (statistics.pstdev(ordered) if len(ordered) > 1 else 0.0) * scale
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile_sorted(ordered, p) * scale
    return out


def latency_figures(samples: Sequence[Sample]) -> dict[str, float]:
    ok = [s for s in samples if s.kind == "ok"]
    ttfts = [s.result.ttft_s for s in ok if s.result.ttft_s is not None]
    tpots = [t for s in ok if (t := s.tpot_s) is not None]
    itls = [g for s in ok for g in s.result.gaps_s]
    e2els = [s.result.e2e_s for s in ok]
    queue = [s.result.queue_ms / 1000.0 for s in samples
             if s.result.queue_ms is not None and s.kind == "ok"]
    out: dict[str, Any] = {}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_summary(name, values))
    if queue:
        out.update(_summary("queue", queue))
    return out


# Figures whose noise the gate needs: the run's own spread is estimated for each.
NOISE_KEYS = ("median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p95_tpot_ms",
              "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "p99_e2el_ms", "request_throughput",
              "request_goodput", "output_throughput", "error_rate_pct", "rejection_rate_pct",
              "slo_attainment_pct")


def noise(samples: Sequence[Sample], duration_s: float, slo: Mapping[str, float]
          ) -> dict[str, float]:
    """Each figure's own spread within the run, as one standard error.

    The run is cut into two interleaved halves (requests 0, 2, 4... and 1, 3, 5...), so a drift
    over time falls into both; each half's figure has about twice the variance of the whole
    run's, so |a - b| / 2 estimates the whole run's standard error. Relative for latencies and
    throughputs, absolute (percentage points) for the *_pct figures.
    """
    if len(samples) < 8:
        return {}
    halves = [figures(samples[k::2], duration_s / 2, slo, with_noise=False) for k in (0, 1)]
    whole = figures(samples, duration_s, slo, with_noise=False)
    out: dict[str, float] = {}
    for key in NOISE_KEYS:
        a, b, w = halves[0].get(key), halves[1].get(key), whole.get(key)
        if a is None or b is None or w is None:
            continue
        spread = abs(float(a) - float(b)) / 2.0
        if key.endswith("_pct"):
            out[key] = spread
        elif w:
            out[key] = spread / abs(float(w))
    return out


def served_rate(samples: Sequence[Sample]) -> float | None:
    """Requests per second the target began to answer (first token) over the second half of
    the sending window: the offered rate while the target keeps up, its capacity once the
    offer exceeds it (the rest waits in a queue or is refused). The second half, because an
    empty engine takes its first requests faster than it can sustain. A first token is when a
    request got its prefill and a place in the batch: in a steady state as many start as end,
    and starts come seconds after sending, where completions come a whole request later."""
    if len(samples) < 8:
        return None
    end = max(s.result.start_s for s in samples)
    half = end / 2.0
    if end - half <= 0:
        return None
    started = sum(1 for s in samples if s.result.ttft_s is not None
                  and half <= s.result.start_s + s.result.ttft_s <= end)
    return started / (end - half)


def figures(samples: Sequence[Sample], duration_s: float, slo: Mapping[str, float],
            with_noise: bool = True) -> dict[str, Any]:
    """The report's figures (no configuration), under vLLM's names where vLLM has one."""
    ok = [s for s in samples if s.kind == "ok"]
    rejected = [s for s in samples if s.kind == "rejected"]
    errors = [s for s in samples if s.kind == "error"]
    sent = len(samples)
    met = [s for s in ok if s.meets(slo)]
    good = len(met)
    dur = duration_s if duration_s > 0 else math.nan
    input_tokens = sum(s.input_len for s in ok)
    output_tokens = sum(s.output_len for s in ok)
    retry = sorted(s.result.retry_after_s for s in rejected if s.result.retry_after_s is not None)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(errors) + len(rejected),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / dur,
        "request_goodput": good / dur if slo else None,
        "output_throughput": output_tokens / dur,
        "input_throughput": input_tokens / dur,
        "total_token_throughput": (input_tokens + output_tokens) / dur,
        "sent": sent,
        "rejected": len(rejected),
        "errors": len(errors),
        "rejection_rate_pct": 100.0 * len(rejected) / sent if sent else 0.0,
        "error_rate_pct": 100.0 * len(errors) / sent if sent else 0.0,
        "good": good if slo else None,
        # Tokens of the requests meeting every SLO: what the cost per goodput token divides by.
        "good_input_tokens": sum(s.input_len for s in met) if slo else None,
        "good_output_tokens": sum(s.output_len for s in met) if slo else None,
        # Of everything sent: a rejection or an error misses the SLO as a user sees it.
        "slo_attainment_pct": 100.0 * good / sent if slo and sent else None,
        "slo_attainment_completed_pct": 100.0 * good / len(ok) if slo and ok else None,
        "retry_after_median_s": percentile_sorted(retry, 50) if retry else None,
        "max_chunk_gap_ms": max((s.result.max_gap_s for s in ok), default=0.0) * 1000.0,
        "served_rate": served_rate(samples),
    }
    out.update(latency_figures(samples))
    if with_noise:
        out["noise"] = noise(samples, duration_s, slo)
    return out


def error_examples(samples: Iterable[Sample], limit: int = 5) -> dict[str, int]:
    """The most frequent error messages with their counts (what went wrong, briefly)."""
    counts: dict[str, int] = {}
    for s in samples:
        if s.kind != "ok":
            key = f"{s.result.status}: {(s.result.error or '')[:160]}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:limit])


def prefix_figures(before: Mapping[str, float], after: Mapping[str, float],
                   potential: float | None) -> dict[str, Any] | None:
    """The run's prefix-cache figures: the engines' own hit rate over the run (their
    counters' increase: hit tokens / queried tokens), the gateway's predicted rate where it
    routes by prefix, and the workload's potential (an unbounded cache, `potential_hit_rate`)."""
    def delta(key: str) -> float | None:
        if key not in after:
            return None
        return max(0.0, after[key] - before.get(key, 0.0))

    queries, hits = delta("queries"), delta("hits")
    prompt, predicted = delta("prompt"), delta("predicted")
    if queries is None and potential is None:
        return None
    return {
        "engine_hit_rate": hits / queries if queries and hits is not None else None,
        "engine_queried_tokens": queries, "engine_hit_tokens": hits,
        "predicted_hit_rate": predicted / prompt if prompt and predicted is not None else None,
        "potential_hit_rate": potential,
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def render_text(report: Mapping[str, Any]) -> str:
    """The human summary printed after a run, vLLM's layout with our lines added."""
    f: Callable[[str], Any] = report.get
    lines = [f"{'=' * 18} Serving Benchmark Result {'=' * 18}"]

    def row(label: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{label:<44}{_fmt(value, digits):>18}")

    row("Successful requests:", f("completed"))
    row("Rejected (429/503):", f("rejected"))
    row("Errors:", f("errors"))
    row("Benchmark duration (s):", f("duration"))
    row("Total input tokens:", f("total_input_tokens"))
    row("Total generated tokens:", f("total_output_tokens"))
    row("Request throughput (req/s):", f("request_throughput"))
    if f("request_goodput") is not None:
        row("Request goodput (req/s):", f("request_goodput"))
        row("SLO attainment (% of sent):", f("slo_attainment_pct"))
    row("Input token throughput (tok/s):", f("input_throughput"))
    row("Output token throughput (tok/s):", f("output_throughput"))
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token "
                                                                  "(excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"),
                        ("queue", "Gateway queue time")):
        if f(f"mean_{name}_ms") is None:
            continue
        lines.append(f"{title:-^62}")
        row(f"Mean {name.upper()} (ms):", f(f"mean_{name}_ms"))
        row(f"Median {name.upper()} (ms):", f(f"median_{name}_ms"))
        for p in (90, 95, 99):
            row(f"P{p} {name.upper()} (ms):", f(f"p{p}_{name}_ms"))
    cost = f("cost")
    if cost:
        cur = cost["currency"]
        lines.append(f"{f'Cost ({cur})':-^62}")
        price = f"{cost['gpus']} x {float(cost['per_gpu_hour']):,.2f}"
        lines.append(f"{'GPUs x price per GPU-hour:':<44}{price:>18}")
        row("Cost of the run:", f("cost_total"), 4)
        share = cost.get("input_share")
        row("Input share of the spend:",
            "all on output" if share is None else float(share), 3)
        for key, label in (("tokens", "Cost per million tokens:"),
                           ("input_tokens", "Cost per million input tokens:"),
                           ("output_tokens", "Cost per million output tokens:"),
                           ("goodput_tokens", "Cost per million goodput tokens:"),
                           ("goodput_input_tokens", "Cost per million goodput input tokens:"),
                           ("goodput_output_tokens", "Cost per million goodput output tokens:")):
            if "input" in key and cost.get("input_share") is None:
                continue
            if key.startswith("goodput") and f("request_goodput") is None:
                continue
            row(label, f(f"cost_per_million_{key}"), 3)
    prefix = f("prefix_cache") or {}
    if prefix:
        lines.append(f"{'Prefix cache':-^62}")
        row("Engines' hit rate over the run:", prefix.get("engine_hit_rate"), 3)
        row("Gateway's predicted hit rate:", prefix.get("predicted_hit_rate"), 3)
        row("Workload's potential (unbounded cache):", prefix.get("potential_hit_rate"), 3)
    gen = f("generator") or {}
    if gen:
        lines.append(f"{'Load generator':-^62}")
        row("Generator CPU (share of one core):", gen.get("cpu_fraction"))
        row("Chunks received per second:", gen.get("chunks_per_s"), 0)
        row("Max send lag behind schedule (ms):", gen.get("max_schedule_lag_ms"))
    lines.append("=" * 62)
    return "\n".join(lines)
