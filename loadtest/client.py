"""The streaming load client: send OpenAI requests and time every chunk, cheaply.

This module only sends; pacing (open and closed loops, the run's own CPU) is the one load
driver's, `loadtest/runner.py`, which `loadtest run` and `benchmarks/` use. One aiohttp
`ClientSession` with a large connection pool carries every request. aiohttp rather than httpx
because httpx costs about 3x more CPU per chunk and collapses above about 0.8 core on this
machine (see docs/benchmarks.md): a load generator that saturates first measures itself, not
the system under test.

What it costs per chunk, and why it is cheap enough for 20,000+ chunks/s from one core:
- it reads whatever bytes have arrived (`readany`), never line by line;
- it counts SSE events by counting blank lines (`b"\\n\\n"`): JSON escapes newlines inside
  strings, so a blank line only ever ends an event, whatever the token text;
- it looks for the first token with one regex only until the first token is found, and parses
  JSON once per request, on the last event (usage or an error), from the last few reads kept.

Timing is `time.perf_counter()`. TTFT is from just before the request is sent to the read that
holds the first non-empty content (so vLLM's empty role frame does not count as a token). Gaps
are between reads that hold at least one event, from the first token on; when several events
arrive in one read they count as one gap, which is what a user sees.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import re
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp
import orjson

# The first event with a non-empty token: chat `content`, completions `text`, or a reasoning
# model's `reasoning_content`. `"content":""` (vLLM's role frame) and `"content":null` miss it.
_FIRST_TOKEN = re.compile(rb'"(?:content|text|reasoning_content)":"(?!")')
_HEAD_LIMIT = 64 * 1024     # stop looking for a first token after this many bytes
_TAIL_READS = 4             # reads kept to find the last event (usage, error) in
_ERROR_BODY_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: a path on the target and a JSON body encoded once, up front."""

    path: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


def chat_request(model: str, prompt: str, max_tokens: int, *, stream: bool = True,
                 include_usage: bool = True, extra: Mapping[str, Any] | None = None
                 ) -> RequestSpec:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "stream": stream}
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    return RequestSpec("/v1/chat/completions", orjson.dumps(body),
                       {"content-type": "application/json"})


def completion_request(model: str, prompt: str, max_tokens: int, *, stream: bool = True,
                       include_usage: bool = True, extra: Mapping[str, Any] | None = None
                       ) -> RequestSpec:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "stream": stream}
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    return RequestSpec("/v1/completions", orjson.dumps(body),
                       {"content-type": "application/json"})


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request did. Times are seconds; `start_s` is from the start of the run."""

    start_s: float
    status: int                     # 0 when no response came (connection error, timeout)
    ttft_s: float | None            # None when no token came
    e2e_s: float
    events: int                     # SSE events received, role, usage and [DONE] included
    gaps_s: Sequence[float]         # between reads holding events, from the first token on
    max_gap_s: float
    usage: Usage | None
    error: str | None
    retry_after_s: float | None     # from Retry-After on a 429 or 503
    queue_ms: float | None          # the gateway's x-gateway-queue-ms header
    # When the longest gap began, on time.perf_counter()'s clock (one clock for every process
    # on Linux: benchmarks/stall_site/stall_tracer.py lays stalls beside other processes' GC)
    max_gap_at_s: float = math.nan

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class StreamClient:
    """One session to one target. Counters (`events_total`, `bytes_total`) are live, so a
    benchmark can sample throughput over a window while requests run."""

    def __init__(self, base_url: str, *, connections: int = 4096, timeout_s: float = 120.0,
                 record_gaps: bool = True, headers: Mapping[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.record_gaps = record_gaps
        self.events_total = 0
        self.bytes_total = 0
        self.in_flight = 0
        self.prefill_pending = 0  # prompt tokens sent that still await their first token
        # (start, TTFT or None) of each request cancelled mid-answer (a run's drain cut it): a
        # run where engines collapse and nothing finishes still shows how long users waited.
        self.cut: list[tuple[float, float | None]] = []
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = dict(headers or {})
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StreamClient:
        self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    def open(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._connections, limit_per_host=0,
                                             ttl_dns_cache=None, enable_cleanup_closed=False)
            # auto_decompress off: SSE is never compressed, and we count raw bytes.
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                  headers=self._headers,
                                                  auto_decompress=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, spec: RequestSpec, run_start: float | None = None,
                   prompt_tokens: int = 0) -> RequestResult:
        """Send one request and read its whole answer; never raises for a failed request.
        `prompt_tokens` count in `prefill_pending` until its first token (calibration reads
        each engine's prefill backlog from it)."""
        self.open()
        assert self._session is not None
        t0 = time.perf_counter()
        start_s = t0 - (t0 if run_start is None else run_start)
        status = 0
        ttft: float | None = None
        events = 0
        gaps: list[float] = []
        max_gap = 0.0
        max_gap_at = math.nan
        usage: Usage | None = None
        error: str | None = None
        retry_after: float | None = None
        queue_ms: float | None = None
        self.in_flight += 1
        prefill = prompt_tokens
        self.prefill_pending += prefill
        try:
            async with self._session.post(self.base_url + spec.path, data=spec.body,
                                          headers=spec.headers) as resp:
                status = resp.status
                queue_ms = _float_or_none(resp.headers.get("x-gateway-queue-ms"))
                if status in (429, 503):
                    retry_after = _retry_after(resp.headers.get("retry-after"))
                content = resp.content
                if status != 200:
                    body = await content.read(_ERROR_BODY_LIMIT)
                    error = _error_text(body) or f"HTTP {status}"
                elif not resp.headers.get("content-type", "").startswith("text/event-stream"):
                    body = await content.read()
                    now = time.perf_counter()
                    ttft = now - t0
                    events = 0
                    usage, error = _last_event([body], sse=False)
                else:
                    record = self.record_gaps
                    tail: deque[bytes] = deque(maxlen=_TAIL_READS)
                    head = b""
                    last_t = 0.0
                    prev_nl = False
                    nbytes = 0
                    # The hot loop: a few C calls per read, no parsing.
                    while True:
                        chunk = await content.readany()
                        if not chunk:
                            break
                        now = time.perf_counter()
                        nbytes += len(chunk)
                        n = chunk.count(b"\n\n")
                        if prev_nl and chunk[0] == 10:
                            n += 1  # a blank line split across two reads
                        prev_nl = chunk[-1] == 10
                        tail.append(chunk)
                        if not n:
                            continue
                        events += n
                        self.events_total += n
                        if ttft is not None:
                            gap = now - last_t
                            if gap > max_gap:
                                max_gap = gap
                                max_gap_at = last_t
                            if record:
                                gaps.append(gap)
                            last_t = now
                        elif len(head) < _HEAD_LIMIT:
                            head += chunk
                            if _FIRST_TOKEN.search(head) is not None:
                                ttft = now - t0
                                last_t = now
                                head = b""
                                self.prefill_pending -= prefill
                                prefill = 0
                    self.bytes_total += nbytes
                    usage, error = _last_event(tail, sse=True)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except asyncio.CancelledError:
            self.cut.append((start_s, ttft))
            raise
        finally:
            self.in_flight -= 1
            self.prefill_pending -= prefill
        return RequestResult(start_s=start_s, status=status, ttft_s=ttft,
                             e2e_s=time.perf_counter() - t0, events=events, gaps_s=gaps,
                             max_gap_s=max_gap, usage=usage, error=error,
                             retry_after_s=retry_after, queue_ms=queue_ms,
                             max_gap_at_s=max_gap_at)


def _float_or_none(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: either a number or an HTTP date (RFC 9110 section 10.2.3)."""
    if value is None:
        return None
    seconds = _float_or_none(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_text(body: bytes) -> str | None:
    """The message of an OpenAI-shaped error body, else the body itself (shortened)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode(errors="replace").strip()
        return text[:300] or None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return str(obj["error"].get("message") or obj["error"])
    return body.decode(errors="replace")[:300]


def _last_event(reads: Sequence[bytes] | deque[bytes], sse: bool
                ) -> tuple[Usage | None, str | None]:
    """Usage and error from the last JSON event of a stream (or from a whole JSON body)."""
    data = b"".join(reads)
    if sse:
        if data.rfind(b"data: [DONE]") < 0:
            return None, "stream ended before data: [DONE]"
        end = data.rfind(b"data: [DONE]")
        start = data.rfind(b"data: ", 0, end)
        if start < 0:
            return None, None
        payload = data[start + 6:end].strip()
    else:
        payload = data
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        # A stream's last event may have begun before the reads kept; only usage is lost.
        return None, None if sse else "response body is not JSON"
    if not isinstance(obj, dict):
        return None, None
    if isinstance(obj.get("error"), dict):
        return None, str(obj["error"].get("message") or obj["error"])
    u = obj.get("usage")
    if isinstance(u, dict):
        try:
            return Usage(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0),
                         int(u.get("total_tokens") or 0)), None
        except (TypeError, ValueError):
            return None, None
    return None, None


class LoopLagProbe:
    """Measures this process's own event-loop lag while a run goes on.

    A sleep of `interval_s` that wakes late by more than the loop's 1 ms timer granularity
    means the loop was busy: lag in the generator shows up as false gaps in the target.
    """

    def __init__(self, interval_s: float = 0.01, max_samples: int = 100_000) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._max = max_samples
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLagProbe:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while len(self.samples) < self._max:
            t = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(0.0, time.perf_counter() - t - self.interval_s))

    @property
    def max_s(self) -> float:
        return max(self.samples, default=math.nan)
