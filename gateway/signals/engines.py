"""Scrape each engine's own /metrics (vLLM, SGLang or llama.cpp names) for load and capacity.

Only the few lines the gateway needs are read, by prefix, without a full exposition parse: a
vLLM page is ~100 KB of histograms, and this runs every second per backend on the event loop.
A sample older than `max_age_s` is unknown: admission then relies on its own reservations and
never takes an absent signal as "idle".

One backend's page may hold several series of a name: one per data-parallel engine (vLLM's
`engine` label), one per scheduler rank (SGLang's `tp_rank`/`dp_rank`), or an old and a new name
for one quantity. They are combined the way the engine itself combines them (`_vllm`,
`_sglang`), never simply summed.

llama.cpp's server has no KV gauge: it runs a fixed number of slots, each with its own context,
and defers what finds no free slot. Its capacity comes from `/props` (slots, context per slot),
fetched with the first scrape and again after a failed one (a restart may change `-np`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.signals.blocks import EngineBlocks

log = logging.getLogger("gateway.signals")

# quantity -> metric names, newest first. A quantity is read from the first name present on the
# page and never from two: vLLM 0.9/0.10 export the renamed KV-usage gauge beside the deprecated
# one (same value), and adding both read 0.6 as 1.2.
#   vLLM: vllm/v1/metrics/loggers.py (PrometheusStatLogger): num_requests_running/_waiting,
#     kv_cache_usage_perc ("Deprecated in 0.9 - Renamed as vllm:kv_cache_usage_perc" for
#     gpu_cache_usage_perc, which vLLM V0 and 0.8 export alone), labels model_name and engine.
#   SGLang: python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector): num_running_reqs,
#     num_queue_reqs, token_usage (0-1), max_total_num_tokens ("Maximum total number of tokens
#     in the KV cache pool"), one series per scheduler process.
#   Prefix cache: vLLM V1's counters vllm:prefix_cache_queries / vllm:prefix_cache_hits ("in
#     terms of number of queried / cached tokens"; prometheus_client exposes a Counter with
#     `_total`), which replaced the deprecated vllm:gpu_prefix_cache_queries / _hits; SGLang's
#     gauge sglang:cache_hit_rate (collector.py), a ratio over its recent batches.
_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {"running": ("vllm:num_requests_running",),
             "waiting": ("vllm:num_requests_waiting",),
             "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
             "prefix_queries": ("vllm:prefix_cache_queries_total",
                                "vllm:gpu_prefix_cache_queries_total"),
             "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")},
    "sglang": {"running": ("sglang:num_running_reqs",), "waiting": ("sglang:num_queue_reqs",),
               "kv_usage": ("sglang:token_usage",),
               "max_tokens": ("sglang:max_total_num_tokens",),
               "cache_hit_rate": ("sglang:cache_hit_rate",)},
    # llama.cpp (server --metrics): tools/server/server-task.cpp,
    # server_task_result_metrics::to_metrics, pinned by tools/engine-llamacpp. Gauges:
    # requests_processing (slots processing), requests_deferred (tasks waiting for a slot),
    # n_busy_slots_per_decode (mean busy slots per llama_decode() call, since start); counters
    # prompt_tokens_total (excluding cached) and tokens_predicted_total. No labels.
    "llamacpp": {"running": ("llamacpp:requests_processing",),
                 "waiting": ("llamacpp:requests_deferred",),
                 "busy_slots": ("llamacpp:n_busy_slots_per_decode",),
                 "prompt_tokens": ("llamacpp:prompt_tokens_total",),
                 "predicted_tokens": ("llamacpp:tokens_predicted_total",)},
}
# vLLM's info-style gauge (value 1): the engine's CacheConfig as labels, one line per engine
# (PrometheusStatLogger.log_metrics_info; CacheConfig.metrics_info in vllm/config/cache.py).
_VLLM_CACHE_CONFIG = "vllm:cache_config_info"
# Names to read per engine kind: a tuple, for str.startswith's fast filter over the page.
_WANTED: dict[str, tuple[str, ...]] = {
    "vllm": (_VLLM_CACHE_CONFIG, *(n for ns in _NAMES["vllm"].values() for n in ns)),
    "sglang": tuple(n for ns in _NAMES["sglang"].values() for n in ns),
    "llamacpp": tuple(n for ns in _NAMES["llamacpp"].values() for n in ns),
}
_NAME = re.compile(r"[^\s{]+")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_LABELS_END = re.compile(r"\s*\}\s*(\S+)")
_VALUE = re.compile(r"\s+(\S+)")

Series = tuple[dict[str, str], float]


@dataclass(frozen=True, slots=True)
class EngineSample:
    at: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0-1, over the whole backend
    # vLLM's num_gpu_blocks, of the engine's own `block_size`; with data parallelism already
    # the sum over its engines (vLLM sums them at startup, see `_vllm`).
    num_gpu_blocks: int | None = None
    block_size: int | None = None  # the engine's, from vllm:cache_config_info
    # The backend's KV capacity in tokens as the engine counts it: SGLang's
    # max_total_num_tokens, vLLM's kv_cache_size_tokens; summed over data-parallel engines.
    max_tokens: int | None = None
    engines: int | None = None  # data-parallel engines (vLLM) or DP groups (SGLang) combined
    # llama.cpp: slots (`-np`) and each slot's context in tokens, from /props; the gauge of
    # busy slots per decode call and the token counters, from /metrics.
    slots: int | None = None
    slot_tokens: int | None = None
    busy_slots_per_decode: float | None = None
    prompt_tokens_total: float | None = None
    predicted_tokens_total: float | None = None
    # The engine's prefix cache: vLLM's cumulative counters in tokens, summed over its
    # engines; SGLang's recent hit rate (0-1).
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    cache_hit_rate: float | None = None

    def public(self, now: float) -> dict[str, object]:
        """What /gateway/estimate shows of this report."""
        out: dict[str, object] = {"kv_usage": self.kv_usage, "waiting": self.waiting,
                                  "running": self.running, "age_s": round(now - self.at, 3)}
        if self.slots is not None:  # llama.cpp: its slots and its own counters
            out.update(slots=self.slots, slot_tokens=self.slot_tokens,
                       busy_slots_per_decode=self.busy_slots_per_decode,
                       prompt_tokens_total=self.prompt_tokens_total,
                       predicted_tokens_total=self.predicted_tokens_total)
        return out


def _series(line: str, start: int) -> Series | None:
    """Labels and value of one exposition line whose metric name ends at `start`."""
    labels: dict[str, str] = {}
    if line.startswith("{", start):
        # Label values are quoted and may hold spaces, commas or braces (vLLM's cache config).
        pos = start + 1
        while (m := _LABEL.match(line, pos)) is not None:
            labels[m.group(1)] = m.group(2)
            pos = m.end()
        end = _LABELS_END.match(line, pos)
    else:
        end = _VALUE.match(line, start)
    if end is None:
        return None
    try:
        value = float(end.group(1))
    except ValueError:
        return None
    return (labels, value) if math.isfinite(value) else None


def _number(labels: dict[str, str], key: str) -> int | None:
    """An integer label; vLLM renders an unset config field as "None"."""
    try:
        value = float(labels.get(key, ""))
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value > 0 else None


def _present(found: dict[str, list[Series]], names: tuple[str, ...]) -> list[Series]:
    """The series of the newest name present; a deprecated name only when the new one is absent."""
    for name in names:
        if found.get(name):
            return found[name]
    return []


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _vllm(found: dict[str, list[Series]], at: float) -> EngineSample:
    """vLLM: one series per data-parallel engine (`engine` label), combined as vLLM does.

    Data parallelism in one server exports one series per engine core (make_per_engine in
    vllm/v1/metrics/loggers.py); vLLM's own aggregate over them
    (AggregatedLoggingStatLogger.aggregate_scheduler_stats) sums running and waiting and
    averages KV usage. Capacity: every engine's cache_config_info line carries the front end's
    CacheConfig, whose num_gpu_blocks is already the sum over engines ("Sum values from all
    engines in DP case": wait_for_engine_startup in vllm/v1/engine/utils.py, in newer releases
    MPClient._apply_ready_response in vllm/v1/engine/core_client.py), so it is taken once;
    kv_cache_size_tokens is per engine ("Per-DP-engine KV cache capacity in tokens",
    vllm/config/cache.py; "do not sum across DP" in core_client), so it is summed over the lines.
    """
    names = _NAMES["vllm"]

    def per_engine(quantity: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in _present(found, names[quantity]):
            key = labels.get("engine", "")
            # One engine's state twice (e.g. per-process copies under Prometheus' multiprocess
            # mode): one value, the higher, never the sum.
            out[key] = max(value, out.get(key, value))
        return out

    running, waiting, usage = per_engine("running"), per_engine("waiting"), per_engine("kv_usage")
    queries, hits = per_engine("prefix_queries"), per_engine("prefix_hits")
    configs = {labels.get("engine", ""): labels for labels, _ in found.get(_VLLM_CACHE_CONFIG, [])}
    blocks = [b for c in configs.values() if (b := _number(c, "num_gpu_blocks")) is not None]
    sizes = [s for c in configs.values() if (s := _number(c, "block_size")) is not None]
    tokens = [_number(c, "kv_cache_size_tokens") for c in configs.values()]
    engines = set(running) | set(waiting) | set(usage) | set(configs)
    return EngineSample(
        at=at,
        running=sum(running.values()) if running else None,
        waiting=sum(waiting.values()) if waiting else None,
        kv_usage=_mean(list(usage.values())) if usage else None,
        # The lines agree on one vLLM page; should they not, the smallest never overstates.
        num_gpu_blocks=min(blocks) if blocks else None,
        block_size=min(sizes) if sizes else None,
        max_tokens=sum(t for t in tokens if t is not None)
        if tokens and all(t is not None for t in tokens) else None,
        engines=len(engines) or None,
        prefix_queries=sum(queries.values()) if queries else None,
        prefix_hits=sum(hits.values()) if hits else None)


def _sglang(found: dict[str, list[Series]], at: float) -> EngineSample:
    """SGLang: one series per scheduler process, labelled tp_rank, pp_rank and, with data
    parallelism, dp_rank (SchedulerMetricsMixin.init_metrics in
    python/sglang/srt/managers/scheduler_metrics_mixin.py).

    By default only attn_tp_rank 0 of each group exports; --enable-metrics-for-all-schedulers
    makes every TP rank export. The TP (and PP) ranks of one DP group run one scheduler state
    over mirrored KV pools, each reporting the group's numbers, so within a group: usage is the
    mean, running/waiting the highest, capacity the smallest (never added across TP ranks).
    DP groups hold their own pools and queues: capacity, running and waiting add up, usage is
    their capacity-weighted mean. Limit: DP attention launches its schedulers without a dp_rank
    (data_parallel_controller.launch_dp_attention_schedulers passes None), so its ranks read as
    one group: usage stays right, capacity is one rank's (understated; policy `kv_blocks` wins).
    """
    groups: dict[str, dict[str, list[float]]] = {}
    for quantity, names in _NAMES["sglang"].items():
        for labels, value in _present(found, names):
            groups.setdefault(labels.get("dp_rank", ""), {}).setdefault(quantity, []).append(value)

    def per_group(quantity: str, combine: Callable[[list[float]], float]) -> dict[str, float]:
        return {g: combine(q[quantity]) for g, q in groups.items() if q.get(quantity)}

    usage, capacity = per_group("kv_usage", _mean), per_group("max_tokens", min)
    running, waiting = per_group("running", max), per_group("waiting", max)
    hit_rate = per_group("cache_hit_rate", _mean)
    kv_usage = None
    if usage:
        weights = [capacity.get(g, 0.0) for g in usage]
        kv_usage = sum(usage[g] * w for g, w in zip(usage, weights, strict=True)) / sum(weights) \
            if all(w > 0 for w in weights) else _mean(list(usage.values()))
    return EngineSample(
        at=at,
        running=sum(running.values()) if running else None,
        waiting=sum(waiting.values()) if waiting else None,
        kv_usage=kv_usage,
        max_tokens=int(sum(capacity.values())) if capacity else None,
        engines=len(groups) or None,
        cache_hit_rate=_mean(list(hit_rate.values())) if hit_rate else None)


def _llamacpp(found: dict[str, list[Series]], at: float,
              props: tuple[int, int] | None) -> EngineSample:
    """llama.cpp: one unlabelled series per name (one server, one model)."""
    def one(quantity: str) -> float | None:
        series = _present(found, _NAMES["llamacpp"][quantity])
        return series[0][1] if series else None

    slots, slot_tokens = props if props is not None else (None, None)
    return EngineSample(
        at=at, running=one("running"), waiting=one("waiting"),
        max_tokens=slots * slot_tokens if slots and slot_tokens else None,
        engines=1, slots=slots, slot_tokens=slot_tokens,
        busy_slots_per_decode=one("busy_slots"), prompt_tokens_total=one("prompt_tokens"),
        predicted_tokens_total=one("predicted_tokens"))


def parse_llamacpp_props(text: str) -> tuple[int, int] | None:
    """(slots, context tokens per slot) from llama.cpp's GET /props: `total_slots` (the
    server's n_parallel) and `default_generation_settings.n_ctx` (the slot's n_ctx_slot(),
    tools/server/server-context.cpp); None when either is missing or not a positive integer."""
    try:
        props = json.loads(text)
        slots = props["total_slots"]
        n_ctx = props["default_generation_settings"]["n_ctx"]
    except (ValueError, KeyError, TypeError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (slots, n_ctx)):
        return None
    return slots, n_ctx


def parse_engine_metrics(text: str, engine: str, at: float,
                         props: tuple[int, int] | None = None) -> EngineSample:
    wanted = _WANTED.get(engine)
    if wanted is None:
        return EngineSample(at=at)
    found: dict[str, list[Series]] = {}
    for line in text.splitlines():
        if not line.startswith(wanted):  # comments, histograms, process metrics: most lines
            continue
        m = _NAME.match(line)  # the exact name: `vllm:num_requests_running_x` is another
        if m is None or m.group(0) not in wanted:
            continue
        series = _series(line, m.end())
        if series is not None:
            found.setdefault(m.group(0), []).append(series)
    if engine == "llamacpp":
        return _llamacpp(found, at, props)
    return _vllm(found, at) if engine == "vllm" else _sglang(found, at)


# One scrape: the page at a URL within a timeout, or None (not 200, not text, not reached).
# The GET is the upstream seam's (gateway/upstream/aio.py `AioClient.get_text`).
Fetch = Callable[[str, float], Awaitable[str | None]]


class EngineScraper:
    """Keeps the latest sample of each backend; `fresh()` hides the stale ones."""

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self.samples: dict[tuple[str, str], EngineSample] = {}
        self.props: dict[tuple[str, str], tuple[int, int]] = {}  # llama.cpp: slots, per slot
        # Their KV block sizes, kept while an engine is down (admission reports them here).
        self.blocks = EngineBlocks()

    def fresh(self, pool: str, backend: str) -> EngineSample | None:
        s = self.samples.get((pool, backend))
        if s is None or self.clock() - s.at > self.max_age_s:
            return None
        return s

    async def scrape(self, fetch: Fetch, pool: str, backend: str,
                     url: str, engine: str, timeout_s: float) -> EngineSample | None:
        key = (pool, backend)
        text = await fetch(url, timeout_s)
        if text is None:
            self.props.pop(key, None)  # it may come back restarted with other slots
            if engine != "llamacpp":
                return None
        props = None
        if engine == "llamacpp":
            props = self.props.get(key)
            if props is None:
                page = await fetch(url.removesuffix("/metrics") + "/props", timeout_s)
                props = None if page is None else parse_llamacpp_props(page)
            if props is None:
                return None
            if text is not None:
                self.props[key] = props
            # A server started without --metrics answers /metrics with 501: its slots are
            # still known from /props (the limit holds), its load is unknown.
        sample = parse_engine_metrics(text or "", engine, self.clock(), props)
        self.samples[(pool, backend)] = sample
        return sample

    async def run(self, fetch: Fetch,
                  targets: list[tuple[str, str, str, str]], interval_s: float,
                  timeout_s: float, on_sample: Callable[[str, str, EngineSample], None]) -> None:
        """Scrape (pool, backend, metrics url, engine kind) targets every `interval_s`."""
        while True:
            results = await asyncio.gather(*(
                self.scrape(fetch, pool, backend, url, engine, timeout_s)
                for pool, backend, url, engine in targets), return_exceptions=True)
            for (pool, backend, _, _), sample in zip(targets, results, strict=True):
                if isinstance(sample, EngineSample):
                    on_sample(pool, backend, sample)
            await asyncio.sleep(interval_s)
