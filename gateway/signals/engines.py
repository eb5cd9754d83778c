"""Scrape each engine's own /metrics (vLLM or SGLang names) for load and capacity.

Only the few lines the gateway needs are read, by prefix, without a full exposition parse: a
vLLM page is ~100 KB of histograms, and this runs every second per backend on the event loop.
A sample older than `max_age_s` is unknown: admission then relies on its own reservations and
never takes an absent signal as "idle".
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

log = logging.getLogger("gateway.signals")

# metric name -> field, for each engine kind. Older vLLM called KV usage gpu_cache_usage_perc.
_NAMES: dict[str, dict[str, str]] = {
    "vllm": {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage",
             "vllm:cache_config_info": "cache_config"},
    "sglang": {"sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "waiting",
               "sglang:token_usage": "kv_usage", "sglang:max_total_num_tokens": "max_tokens"},
}
_BLOCKS = re.compile(r'num_gpu_blocks="(\d+)"')
_BLOCK_SIZE = re.compile(r'block_size="(\d+)"')


@dataclass(frozen=True, slots=True)
class EngineSample:
    at: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0-1
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    max_tokens: int | None = None  # SGLang's KV capacity in tokens


def parse_engine_metrics(text: str, engine: str, at: float) -> EngineSample:
    names = _NAMES.get(engine, {})
    values: dict[str, float] = {}
    blocks = block_size = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = line.find("{")
        space = line.rfind(" ")
        name = line[: name_end if 0 < name_end < space else space]
        field = names.get(name)
        if field is None:
            continue
        if field == "cache_config":
            m = _BLOCKS.search(line)
            blocks = int(m.group(1)) if m else blocks
            m = _BLOCK_SIZE.search(line)
            block_size = int(m.group(1)) if m else block_size
            continue
        try:
            # Sum over label sets (several model_name series on one engine).
            values[field] = values.get(field, 0.0) + float(line[space + 1:])
        except ValueError:
            continue
    max_tokens = values.get("max_tokens")
    return EngineSample(at=at, running=values.get("running"), waiting=values.get("waiting"),
                        kv_usage=values.get("kv_usage"), num_gpu_blocks=blocks,
                        block_size=block_size,
                        max_tokens=int(max_tokens) if max_tokens is not None else None)


class EngineScraper:
    """Keeps the latest sample of each backend; `fresh()` hides the stale ones."""

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self.samples: dict[tuple[str, str], EngineSample] = {}

    def fresh(self, pool: str, backend: str) -> EngineSample | None:
        s = self.samples.get((pool, backend))
        if s is None or self.clock() - s.at > self.max_age_s:
            return None
        return s

    async def scrape(self, session: aiohttp.ClientSession, pool: str, backend: str,
                     url: str, engine: str, timeout_s: float) -> EngineSample | None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return None
        sample = parse_engine_metrics(text, engine, self.clock())
        self.samples[(pool, backend)] = sample
        return sample

    async def run(self, session: aiohttp.ClientSession,
                  targets: list[tuple[str, str, str, str]], interval_s: float,
                  timeout_s: float, on_sample: Callable[[str, str, EngineSample], None]) -> None:
        """Scrape (pool, backend, metrics url, engine kind) targets every `interval_s`."""
        while True:
            results = await asyncio.gather(*(
                self.scrape(session, pool, backend, url, engine, timeout_s)
                for pool, backend, url, engine in targets), return_exceptions=True)
            for (pool, backend, _, _), sample in zip(targets, results, strict=True):
                if isinstance(sample, EngineSample):
                    on_sample(pool, backend, sample)
            await asyncio.sleep(interval_s)
