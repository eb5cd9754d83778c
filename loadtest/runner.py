"""Drive one load against one target (or a pool's engines) and collect what each request did.

Open loop sends at precomputed arrival times whether or not earlier requests finished (what
real users do); closed loop keeps a fixed number in flight. Both are bounded: sending stops at
`max_requests` or `duration_s`, whichever comes first, and requests still running
`drain_s` after the last send are cancelled and counted as errors, so a run always ends.

Request bodies for an open-loop run are built before the clock starts: building a prompt costs
far more than sending it, and doing it on schedule would show up as the generator's own lag.
The sending itself is `loadtest.client.StreamClient`, whose per-chunk cost is a few C calls.

This is the one load driver: `loadtest run | sweep | calibrate`, the benchmarks and the tests all
pace requests through `Runner`. What it sends is a `Requests`: prompts of exact lengths built
from a workload (`WorkloadRequests`, the command line's), or one fixed request
(`FixedRequests`, the benchmarks', which measure the path and not the prompt).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO
from urllib.parse import urlsplit

import aiohttp
import orjson

from loadtest import __version__
from loadtest.client import LoopLagProbe, RequestResult, RequestSpec, StreamClient
from loadtest.report import Sample, error_examples, figures, format_slo
from loadtest.workload import Arrival, PromptBuilder, Workload, WorkloadError, arrival_times

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
SATURATION_CPU = 0.8        # the generator's share of a core above which its figures are suspect


class TargetError(RuntimeError):
    """The target cannot be used: unreachable, refusing, or not serving the model."""


@dataclass(frozen=True, slots=True)
class LoadShape:
    """How requests are paced: at a rate (open loop) or at a concurrency (closed loop)."""

    rate: float | None = None
    concurrency: int | None = None
    arrival: Arrival = field(default_factory=lambda: Arrival("poisson"))
    time_compress: float = 1.0
    duration_s: float = 60.0
    max_requests: int = 10_000
    drain_s: float = 60.0
    max_in_flight: int = 10_000
    ramp_s: float | None = None       # closed loop: spread of the first sends; None: auto

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        if self.arrival.kind == "trace" and self.rate is None:
            return f"trace arrivals x{self.time_compress:g}"
        return f"{self.rate:g} req/s {self.arrival.describe()}"


@dataclass
class Tracker:
    """Live counters: the progress bar and the calibration scraper read them mid-run."""

    planned: int = 0
    sent: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0
    in_flight: int = 0
    in_flight_tokens: int = 0      # prompt + output tokens of the requests in flight
    started: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> int:
        return self.ok + self.rejected + self.errors


@dataclass(frozen=True, slots=True)
class Outcome:
    samples: list[Sample]       # in request order
    wall_s: float
    cpu_s: float                # this process's CPU time over the run
    chunks: int                 # SSE events received over the run
    dropped: int                # open loop: arrivals skipped at the in-flight cap
    max_schedule_lag_s: float   # open loop: how far behind its schedule sending fell
    max_loop_lag_s: float
    cancelled: int

    @property
    def cpu_fraction(self) -> float:
        """The generator's share of one core over the run."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def saturated(self) -> bool:
        return self.cpu_fraction >= SATURATION_CPU

    @property
    def results(self) -> list[RequestResult]:
        return [s.result for s in self.samples]

    def ttfts(self) -> list[float]:
        """Time to first token of every request that succeeded."""
        return [s.result.ttft_s for s in self.samples
                if s.result.ok and s.result.ttft_s is not None]

    def failed(self) -> list[RequestResult]:
        """Every request that did not succeed: rejections, errors and cancellations."""
        return [s.result for s in self.samples if not s.result.ok]


# --- what to send -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Planned:
    """One request to send and the tokens it counts as (for the counters and the report)."""

    spec: RequestSpec
    prompt_tokens: int
    output_tokens: int


class Requests(Protocol):
    """What a run sends: the request of each index, and (trace replay) the trace's arrivals."""

    def request(self, index: int) -> Planned: ...

    def trace_times(self) -> list[float] | None: ...


@dataclass(frozen=True, slots=True)
class WorkloadRequests:
    """The workload's lengths as prompts of exactly those lengths (`loadtest run`)."""

    builder: PromptBuilder
    workload: Workload

    def request(self, index: int) -> Planned:
        item = self.workload.item(index)
        spec, prompt_tokens = self.builder.build(index, item)
        return Planned(spec, prompt_tokens, item.output_tokens)

    def trace_times(self) -> list[float] | None:
        return self.workload.trace_times()


@dataclass(frozen=True, slots=True)
class FixedRequests:
    """One request, or one per index from a function; the token counts are whatever the caller
    states (0: unknown), since no tokenizer measured the prompt."""

    source: RequestSpec | Callable[[int], RequestSpec]
    prompt_tokens: int = 0
    output_tokens: int = 0

    def request(self, index: int) -> Planned:
        spec = self.source if isinstance(self.source, RequestSpec) else self.source(index)
        return Planned(spec, self.prompt_tokens, self.output_tokens)

    def trace_times(self) -> list[float] | None:
        return None


# --- the target ---------------------------------------------------------------------------------


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(f"--url {url!r}: expected a base URL like http://127.0.0.1:8000")
    return url.rstrip("/").removesuffix("/v1")


def is_loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in LOOPBACK_HOSTS or (
        urlsplit(url).hostname or "").startswith("127.")


async def served_models(url: str, headers: dict[str, str], timeout_s: float = 5.0) -> list[str]:
    """The models the target lists; raises TargetError saying why it cannot be used."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         headers=headers) as session, \
                session.get(url + "/v1/models") as resp:
            body = await resp.read()
            if resp.status != 200:
                raise TargetError(f"{url}/v1/models answered HTTP {resp.status}: "
                                  f"{body[:200].decode(errors='replace')}")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        raise TargetError(f"cannot reach {url}: {reason} (is the engine or gateway running, "
                          "and is the URL right?)") from None
    try:
        data = orjson.loads(body)
        return [str(m["id"]) for m in data["data"]]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise TargetError(f"{url}/v1/models: not an OpenAI model list ({exc})") from None


async def resolve_model(urls: Sequence[str], model: str | None, headers: dict[str, str]) -> str:
    """Check every target is up and serves `model` (default: the first one listed)."""
    chosen = model
    for url in urls:
        models = await served_models(url, headers)
        if chosen is None:
            if not models:
                raise TargetError(f"{url} serves no model")
            chosen = models[0]
        elif chosen not in models:
            raise TargetError(f"model {chosen!r} is not served by {url}; it serves: "
                              f"{', '.join(models) or 'nothing'}")
    assert chosen is not None
    return chosen


# --- the run ------------------------------------------------------------------------------------


def _cancelled(start_s: float, now_s: float, drain_s: float) -> RequestResult:
    return RequestResult(start_s=start_s, status=0, ttft_s=None, e2e_s=now_s - start_s, events=0,
                         gaps_s=(), max_gap_s=0.0, usage=None,
                         error=f"cancelled: still running {drain_s:g} s after the last send",
                         retry_after_s=None, queue_ms=None)


def schedule(shape: LoadShape, requests: Requests, seed: int) -> list[float]:
    """Open-loop send times. `--arrival trace` with `--rate` rescales the trace to that rate."""
    rng = random.Random(seed)
    compress = shape.time_compress
    if shape.arrival.kind == "trace":
        times = requests.trace_times()
        if times is None:
            raise WorkloadError("--arrival trace needs --trace")
        if shape.rate is not None:
            span = times[-1] - times[0] if len(times) > 1 else 0.0
            if span <= 0:
                raise WorkloadError("--arrival trace --rate: the trace spans no time")
            compress = shape.rate / ((len(times) - 1) / span)
        return arrival_times(shape.arrival, None, shape.max_requests, shape.duration_s, rng,
                             times, compress)
    return arrival_times(shape.arrival, shape.rate, shape.max_requests, shape.duration_s, rng)


class Runner:
    """One run: clients (one per target), what to send, the counters.

    A target is a base URL, for which the run opens a client and closes it at the end, or a
    `StreamClient` the caller opened and keeps (a benchmark warms its connections in one run
    and measures in the next; `headers` and `timeout_s` are then the client's own).
    """

    def __init__(self, targets: Sequence[str | StreamClient], requests: Requests,
                 shape: LoadShape, *, headers: dict[str, str] | None = None,
                 timeout_s: float = 300.0, seed: int = 0) -> None:
        self.requests = requests
        self.shape = shape
        self.seed = seed
        self.tracker = Tracker()
        self.clients = [t if isinstance(t, StreamClient)
                        else StreamClient(t, timeout_s=timeout_s, headers=headers or {})
                        for t in targets]
        self.urls = [c.base_url for c in self.clients]
        self._owned = [c for c, t in zip(self.clients, targets, strict=True)
                       if not isinstance(t, StreamClient)]

    def _client(self) -> StreamClient:
        # Fewest in flight, as the gateway balances: LLM requests differ in length too much
        # for round robin.
        return min(self.clients, key=lambda c: c.in_flight)

    async def _send(self, index: int, spec: RequestSpec, prompt_tokens: int, output_tokens: int,
                    t0: float, out: list[Sample]) -> None:
        tr = self.tracker
        tokens = prompt_tokens + output_tokens
        tr.sent += 1
        tr.in_flight += 1
        tr.in_flight_tokens += tokens
        try:
            result = await self._client().send(spec, run_start=t0, prompt_tokens=prompt_tokens)
        finally:
            tr.in_flight -= 1
            tr.in_flight_tokens -= tokens
        sample = Sample(index, prompt_tokens, output_tokens, result)
        kind = sample.kind
        if kind == "ok":
            tr.ok += 1
        elif kind == "rejected":
            tr.rejected += 1
        else:
            tr.errors += 1
        out.append(sample)

    async def run(self) -> Outcome:
        for c in self.clients:
            c.open()
        try:
            async with LoopLagProbe(interval_s=0.02) as lag:
                if self.shape.concurrency is not None:
                    outcome = await self._closed(self.shape.concurrency)
                else:
                    outcome = await self._open()
            return Outcome(outcome.samples, outcome.wall_s, outcome.cpu_s, outcome.chunks,
                           outcome.dropped, outcome.max_schedule_lag_s,
                           0.0 if math.isnan(lag.max_s) else lag.max_s, outcome.cancelled)
        finally:
            for c in self._owned:
                await c.close()

    def _chunks(self) -> int:
        return sum(c.events_total for c in self.clients)

    async def _drain(self, tasks: dict[asyncio.Task[None], tuple[int, float, Planned]],
                     t0: float, out: list[Sample]) -> int:
        """Wait for the requests still running, at most `drain_s`; cancel and count the rest."""
        if not tasks:
            return 0
        started = dict(tasks)  # the done-callback empties `tasks`, cancelled tasks included
        _, pending = await asyncio.wait(list(started), timeout=self.shape.drain_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        now = time.perf_counter() - t0
        for task in pending:
            index, start, planned = started[task]
            result = _cancelled(start, now, self.shape.drain_s)
            out.append(Sample(index, planned.prompt_tokens, planned.output_tokens, result))
            self.tracker.errors += 1
        return len(pending)

    async def _open(self) -> Outcome:
        times = schedule(self.shape, self.requests, self.seed)
        built = [self.requests.request(i) for i in range(len(times))]
        self.tracker.planned = len(times)
        out: list[Sample] = []
        tasks: dict[asyncio.Task[None], tuple[int, float, Planned]] = {}
        dropped = 0
        max_lag = 0.0
        chunks0 = self._chunks()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        self.tracker.started = t0
        for i, due in enumerate(times):
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                max_lag = max(max_lag, -delay)
            if self.tracker.in_flight >= self.shape.max_in_flight:
                dropped += 1  # the target is not keeping up; never grow without bound
                continue
            planned = built[i]
            task = asyncio.create_task(self._send(i, planned.spec, planned.prompt_tokens,
                                                  planned.output_tokens, t0, out))
            tasks[task] = (i, due, planned)
            task.add_done_callback(lambda t: tasks.pop(t, None))
        del built
        cancelled = await self._drain(tasks, t0, out)
        wall = time.perf_counter() - t0
        out.sort(key=lambda s: s.index)
        return Outcome(out, wall, time.process_time() - cpu0, self._chunks() - chunks0, dropped,
                       max_lag, 0.0, cancelled)

    async def _closed(self, concurrency: int) -> Outcome:
        count = self.shape.max_requests
        self.tracker.planned = count
        out: list[Sample] = []
        next_i = 0
        chunks0 = self._chunks()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        self.tracker.started = t0
        deadline = t0 + self.shape.duration_s
        workers = max(1, min(concurrency, count))
        # Spread the first sends over ~1/10 of the run (at most 2 s): requests of equal length
        # would otherwise start, end and restart in lockstep bursts. `--ramp 0` keeps the
        # lockstep, as tools without a ramp run it (the agreement benchmark).
        ramp = self.shape.ramp_s if self.shape.ramp_s is not None else min(
            2.0, self.shape.duration_s / 10)

        async def worker(k: int) -> None:
            nonlocal next_i
            await asyncio.sleep(ramp * k / workers)
            while next_i < count and time.perf_counter() < deadline:
                i = next_i
                next_i += 1
                planned = self.requests.request(i)
                await self._send(i, planned.spec, planned.prompt_tokens, planned.output_tokens,
                                 t0, out)

        tasks = {asyncio.create_task(worker(k)): (k, 0.0) for k in range(workers)}
        # Workers stop sending at the deadline; drain bounds the requests they still read.
        _, pending = await asyncio.wait(
            list(tasks), timeout=self.shape.duration_s + ramp + self.shape.drain_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        cancelled = len(pending)
        self.tracker.errors += cancelled
        wall = time.perf_counter() - t0
        out.sort(key=lambda s: s.index)
        return Outcome(out, wall, time.process_time() - cpu0, self._chunks() - chunks0, 0,
                       0.0, 0.0, cancelled)


# --- progress -----------------------------------------------------------------------------------


async def progress(tracker: Tracker, duration_s: float, stream: TextIO = sys.stderr,
                   interval_s: float = 0.5) -> None:
    """A one-line progress bar, redrawn in place; cancelled by the caller when the run ends."""
    cpu0 = time.process_time()
    width = 24
    try:
        while True:
            await asyncio.sleep(interval_s)
            elapsed = time.perf_counter() - tracker.started
            cpu = (time.process_time() - cpu0) / elapsed if elapsed > 0 else 0.0
            if tracker.planned:
                frac = min(1.0, max(tracker.done / tracker.planned, elapsed / duration_s))
            else:
                frac = min(1.0, elapsed / duration_s)
            bar = "#" * int(frac * width)
            stream.write(f"\r[{bar:<{width}}] {elapsed:5.1f}s sent {tracker.sent} ok {tracker.ok}"
                         f" rejected {tracker.rejected} errors {tracker.errors} in flight "
                         f"{tracker.in_flight} cpu {cpu:.0%}   ")
            stream.flush()
    except asyncio.CancelledError:
        stream.write("\n")
        stream.flush()
        raise


async def run_with_progress(runner: Runner, show: bool) -> Outcome:
    if not show:
        return await runner.run()
    bar = asyncio.create_task(progress(runner.tracker, runner.shape.duration_s))
    try:
        return await runner.run()
    finally:
        bar.cancel()
        await asyncio.gather(bar, return_exceptions=True)


# --- the report ---------------------------------------------------------------------------------


def build_report(outcome: Outcome, *, urls: Sequence[str], model: str, workload: Workload,
                 shape: LoadShape, slo: dict[str, float], seed: int, endpoint: str,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "tool": "loadtest", "version": __version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "backend": "openai-chat" if endpoint == "chat" else "openai",
        "model_id": model, "base_url": urls[0] if len(urls) == 1 else list(urls),
        "request_rate": shape.rate if shape.rate is not None else "inf",
        "max_concurrency": shape.concurrency,
        "burstiness": (1.0 / (shape.arrival.cv ** 2)) if shape.arrival.kind == "gamma" else 1.0,
        "num_prompts": len(outcome.samples),
        "load": {"shape": shape.describe(), "rate": shape.rate,
                 "concurrency": shape.concurrency, "arrival": shape.arrival.describe(),
                 "time_compress": shape.time_compress, "duration_s": shape.duration_s,
                 "max_requests": shape.max_requests, "workload": workload.source,
                 "endpoint": endpoint, "seed": seed, "slo": format_slo(slo),
                 "max_model_len": workload.max_model_len},
    }
    report.update(figures(outcome.samples, outcome.wall_s, slo))
    report["generator"] = {
        "cpu_fraction": outcome.cpu_fraction, "cpu_s": outcome.cpu_s,
        "saturated": outcome.saturated,
        "chunks": outcome.chunks, "chunks_per_s": outcome.chunks / outcome.wall_s
        if outcome.wall_s > 0 else 0.0,
        "max_schedule_lag_ms": outcome.max_schedule_lag_s * 1000.0,
        "max_loop_lag_ms": outcome.max_loop_lag_s * 1000.0,
        "dropped_at_in_flight_cap": outcome.dropped, "cancelled_at_drain": outcome.cancelled,
    }
    report["error_examples"] = error_examples(outcome.samples)
    report.update(extra or {})
    return report


def warnings_for(report: dict[str, Any]) -> list[str]:
    """What makes this run's figures suspect, said plainly."""
    out: list[str] = []
    gen = report["generator"]
    if gen["saturated"]:
        out.append(f"the load generator used {gen['cpu_fraction']:.0%} of a core: it may be "
                   "the bottleneck; its latencies include its own queueing")
    if gen["max_schedule_lag_ms"] > 100:
        out.append(f"sending fell up to {gen['max_schedule_lag_ms']:.0f} ms behind schedule")
    if gen["dropped_at_in_flight_cap"]:
        out.append(f"{gen['dropped_at_in_flight_cap']} arrivals dropped: "
                   "the in-flight cap was reached")
    if gen["cancelled_at_drain"]:
        out.append(f"{gen['cancelled_at_drain']} requests were cancelled at the end of the run")
    if report["completed"] == 0:
        out.append("no request completed")
    return out
