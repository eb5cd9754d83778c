"""What a gateway target decided while a run loaded it, read from its `/metrics` once a second.

Each row is the time since the run started, the admission decisions so far by
`decision/reason` (counters, cumulative) and a few gauges of the pools summed (the latency
guard's limit, requests queued, prompt tokens awaiting their first token, requests in flight).
The HTML report draws the decisions by reason over time from it; the summary is the run's
decisions, counted from the first scrape (a gateway that served before the run is not charged
its earlier decisions). A target that is not a gateway has no such metrics: `is_gateway` says
so, and the poller then records nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

DECISIONS = "gateway_admission_decisions"
GAUGES = {  # row key -> metric names (current, then the name it had before)
    "guard_limit_tokens": ("gateway_latency_guard_limit_tokens",),
    "queued": ("gateway_queue_requests", "gateway_queue_depth"),
    "prefill_pending_tokens": ("gateway_prefill_pending_tokens", "gateway_prefill_tokens_pending"),
    "inflight_requests": ("gateway_inflight_requests",),
}


def parse(text: str) -> dict[str, Any]:
    """Decisions by `decision/reason` and the gauges of one scrape."""
    decisions: dict[str, float] = {}
    gauges: dict[str, float] = {}
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.name == DECISIONS:
            for s in family.samples:
                if s.name.endswith("_total"):
                    key = f"{s.labels['decision']}/{s.labels['reason']}"
                    decisions[key] = decisions.get(key, 0.0) + s.value
            continue
        for key, names in GAUGES.items():
            if family.name in names and key not in seen:
                seen.add(key)
                gauges[key] = sum(s.value for s in family.samples)
    return {"decisions": decisions, **gauges}


# The engines' prefix-cache counters, in tokens: read on an engine itself (vLLM V1's
# vllm:prefix_cache_queries / _hits, vllm/v1/metrics/loggers.py; `_total` on the wire), or as
# a gateway exports them per backend from its scrapes (gateway/observe/prefix_metrics.py).
PREFIX_COUNTERS = {
    "queries": ("vllm:prefix_cache_queries_total",
                "gateway_engine_prefix_cache_queries_tokens_total"),
    "hits": ("vllm:prefix_cache_hits_total", "gateway_engine_prefix_cache_hits_tokens_total"),
    "predicted": ("gateway_prefix_predicted_cached_tokens_total",),
    "prompt": ("gateway_prefix_prompt_tokens_total",),
}


def parse_prefix(text: str) -> dict[str, float]:
    """The prefix-cache counters of one scrape, summed over series (engines, backends)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for key, names in PREFIX_COUNTERS.items():
                if s.name in names:
                    out[key] = out.get(key, 0.0) + s.value
                    if s.name.startswith("gateway_engine"):
                        out["gateway_engine"] = 1.0  # re-exported: a scrape behind
    return out


async def prefix_counters(urls: list[str], headers: dict[str, str] | None = None
                          ) -> dict[str, float]:
    """`parse_prefix` of every target, added up; a target that does not answer adds nothing."""
    total: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for url in urls:
            try:
                async with session.get(url + "/metrics", headers=headers) as resp:
                    if resp.status != 200:
                        continue
                    found = parse_prefix(await resp.text())
            except (aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError):
                continue
            for key, value in found.items():
                total[key] = total.get(key, 0.0) + value
    return total


async def settled_prefix_counters(urls: list[str], headers: dict[str, str] | None = None,
                                  wait_s: float = 1.2, tries: int = 5) -> dict[str, float]:
    """`prefix_counters` once they stop moving: a gateway re-exports the engines' counters
    from its scrapes (once a second by default), so right after a run it is a scrape behind.
    Engines read directly are read once."""
    now = await prefix_counters(urls, headers)
    for _ in range(tries):
        if "gateway_engine" not in now:
            break
        await asyncio.sleep(wait_s)
        then, now = now, await prefix_counters(urls, headers)
        if then == now:
            break
    return now


async def is_gateway(url: str) -> bool:
    """Does `url` export the gateway's admission metrics?"""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session, \
                session.get(url + "/metrics") as resp:
            return resp.status == 200 and DECISIONS.encode() in await resp.read()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


class Poller:
    """Scrape a gateway's /metrics every `interval_s` while a run goes (`start` is a runner
    hook: it returns the task, which the run cancels at its end)."""

    def __init__(self, url: str, interval_s: float = 1.0, headers: dict[str, str] | None = None
                 ) -> None:
        self.url = url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.headers = headers or {}
        self.rows: list[dict[str, Any]] = []
        self._base: dict[str, float] | None = None
        self._start = time.perf_counter()

    def start(self, _runner: object = None) -> asyncio.Task[None]:
        return asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        self._start = time.perf_counter()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5),
                                         headers=self.headers) as session:
            while True:
                await self._scrape(session)
                await asyncio.sleep(self.interval_s)

    async def _scrape(self, session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(self.url) as resp:
                text = (await resp.read()).decode(errors="replace")
            row = parse(text)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return
        if self._base is None:
            self._base = dict(row["decisions"])
        row["decisions"] = {k: v - self._base.get(k, 0.0) for k, v in row["decisions"].items()}
        row["t"] = round(time.perf_counter() - self._start, 2)
        self.rows.append(row)

    async def final(self) -> None:
        """One last scrape after the run, so the summary counts its last second too."""
        if self._base is None:
            return
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5),
                                         headers=self.headers) as session:
            await self._scrape(session)

    def summary(self) -> dict[str, Any]:
        """The run's decisions by `decision/reason`, most first (from the last scrape)."""
        last = self.rows[-1]["decisions"] if self.rows else {}
        return {"decisions": {k: int(v) for k, v in sorted(last.items(), key=lambda kv: -kv[1])
                              if v}}
