"""What the gateway adds to a stream: TTFT overhead, relay throughput, stalls, loop lag.

Starts the stub engine, the gateway and (as reference points) the minimal aiohttp and httpx
pass-through proxies as real processes on loopback, then measures them side by side in one run:

  A. TTFT overhead: 100 concurrent streams (engine 50 ms TTFT, 20 ms/token), direct vs each
     proxy, repeated with the order rotated so drift on a noisy machine favours no one.
  B. Saturation: raise the offered chunk rate until the proxy's CPU nears one core; report the
     chunks/s it relays, its CPU (from /proc/PID/stat) and chunks per CPU-second.
  C. Stalls: many streams at the target relay rate; per stream the longest gap between reads
     beyond the engine's own interval; the gateway's event-loop lag and GC pauses from /metrics.
  D. Forced full GC: 100 streams through a second gateway started with
     GATEWAY_DEBUG_GC_EVERY_S=1 (a full gc.collect() on its loop every second), beside the
     plain gateway and direct: the stall a full collection adds, and its measured pause;
     beside the shipped gateway, a third twin whose sweeps fall due every 0.1 s and run when
     its heap keeper lets them (a moment with no request open, or growth).

Beside the gateway, `--peer NAME=SPEC` (repeatable) measures another router with the same
client against the same stub engine, in the same interleaved runs (parts A to C): SPEC is a
command the benchmark starts, `{engine}` and `{port}` in it replaced by the stub engine's URL and
a free port (`--peer smg='smg launch --worker-urls {engine} --port {port}'`), or the URL of one
already running (start the stub yourself and give `--engine URL`). benchmarks/README.md says
how to install SMG, vllm-router and sglang-router; none is a dependency.

On a 2-core machine the proxy under test is pinned to CPU 1 and the engine and this client to
CPU 0 (`--no-pin` to turn off): the proxy gets a core of its own, as in production, and its
CPU share is not muddled with the load it is measured under. The client's own CPU and loop lag
are reported so a run can say when the measuring side, not the proxy, was the limit.

Run: .venv/bin/python benchmarks/proxy_overhead.py [--quick] [--out run.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import itertools
import math
import operator
import os
import re
import shlex
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from benchmarks import harness, pipeline_probe
from benchmarks.harness import median, percentile
from benchmarks.stall_site import stall_tracer
from loadtest.client import (
    LoopLagProbe,
    RequestSpec,
    StreamClient,
    chat_request,
)
from loadtest.runner import FixedRequests, LoadShape, Outcome, Runner

LEGACY_PROXY_CHUNKS_S = 1400.0  # the most used Python LLM proxy on this machine (issue 2)
MODEL = harness.STUB_MODEL
PROMPT = ["Say hello."]  # the user message every request sends; --prompt-words sets it
HISTORY = ["same"]  # --history: how requests' prompts relate to each other
HISTORY_TURNS = 8   # --history seen: the shared history's user/assistant turns
_SERIAL = itertools.count()  # unique across runs: the gateway's piece cache outlives a run

# The stub is not a GPU: capacity enough that admission decides every request, with its
# reservations, but never binds (an 8B model's planner limits would queue ten 16K-token
# prompts, and the latency guard a stub slower per token than the SLO).
STUB_POOL = {"kv_blocks": 4_000_000,
             "admission": {"prefill_tokens_max": 10**9, "inflight_tokens_max": 10**9}}
DUE_SWEEP_S = 0.1  # part D's keeping twin: its backoff's cap (16x) is then 1.6 s
# The gateway's policies: the floor (tokenizer `none`) or as shipped (the model's exact
# tokenizer and chat template, admission over the model's KV ledger, the access log on), and
# the keys a variant sets: each a switch measured on and off side by side. A key left out is
# the gateway's default, so a tree from before a key (--gateway) still reads the policy.
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "floor": (False, {}),
    "shipped": (True, {}),
    "shipped-nostages": (True, {"server": {"stage_metrics": False}}),
    "shipped-noinline": (True, {"server": {"inline_tokenize_chars": 0}}),
    "shipped-nofreeze": (True, {"server": {"gc_freeze_interval_s": 0}}),
    "shipped-hf": (True, {"model": {"encoder": "huggingface"}}),
    "shipped-inline8k": (True, {"server": {"inline_tokenize_chars": 8192}}),
    "shipped-jinja": (True, {"model": {"renderer": "jinja"}}),
    "shipped-aioclient": (True, {"upstream": {"client": "aiohttp"}}),
    "floor-aioclient": (False, {"upstream": {"client": "aiohttp"}}),
    "shipped-due": (True, {"server": {"gc_sweep_interval_s": DUE_SWEEP_S}}),
}


def target_policy(engine: str, variant: str, tpot: float = 0.06) -> str:
    """The policy of one gateway target (VARIANTS) in front of the stub engine at `engine`."""
    shipped, keys = VARIANTS[variant]
    return harness.stub_policy(engine, shipped=shipped, model=keys.get("model"), pool=STUB_POOL,
                               defaults={"slo": {"tpot_p95_s": tpot}},
                               **{k: v for k, v in keys.items() if k != "model"})


STAGES = ("read", "parse", "count", "route", "quota", "queue", "admission", "upstream_headers")


# ---------------------------------------------------------------- peers


def peer_target(name: str, spec: str, engine: str, work: Path, cpu: int | None,
                stack: contextlib.ExitStack) -> Target:
    """`--peer NAME=SPEC`: a router at a URL already running, or one started from a command
    template ({engine}: the stub engine's URL, {port}: a free port) on the proxy's CPU."""
    if spec.startswith(("http://", "https://")):
        url = spec.rstrip("/")
        port = urllib.parse.urlsplit(url).port
        pid = harness.pid_listening(port) if port else None
        if pid is None:
            print(f"peer {name}: no process of ours listens at {url}; its CPU is not read")
    else:
        argv = shlex.split(spec.replace("{engine}", engine))
        proc = stack.enter_context(harness.start(harness.Command(
            f"peer-{name}", argv, "/health", cpu=cpu, any_answer=True), work, timeout=120))
        url, pid = proc.url, proc.pid
    wait_serving(url, name)
    return Target(name, url, pid, peer=True)


def wait_serving(url: str, name: str, timeout: float = 60.0) -> None:
    """Until a chat request through `url` is answered 200 (a router may still be checking its
    workers after it listens)."""
    body = orjson.dumps({"model": MODEL, "max_tokens": 2, "stream": False,
                         "messages": [{"role": "user", "content": "Say hello."}]})
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"peer {name} at {url} does not serve: {e}") from None
        time.sleep(0.2)


_BUCKET = re.compile(r'^(\w+)_bucket\{(.*?)le="([^"]+)"\} ([0-9.e+-]+)$', re.M)


def histogram(text: str | None, name: str, labels: str = "") -> dict[float, float]:
    """Cumulative bucket counts {upper bound: count} of one histogram series."""
    out: dict[float, float] = {}
    for m in _BUCKET.finditer(text or ""):
        if m.group(1) == name and labels in m.group(2):
            out[float(m.group(3))] = float(m.group(4))
    return out


@dataclass(frozen=True)
class HistDelta:
    count: float
    p99_le: float   # the bucket bound under which 99% of this window's samples fell
    max_le: float   # the bucket bound the largest sample fell under

    def show(self) -> str:
        if not self.count:
            return "no samples"
        return f"n={self.count:.0f}, p99 <= {_ms(self.p99_le)}, max <= {_ms(self.max_le)}"


def hist_delta(before: dict[float, float], after: dict[float, float]) -> HistDelta:
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if not total:
        return HistDelta(0.0, math.nan, math.nan)
    p99 = next(b for b, c in zip(bounds, counts, strict=True) if c >= 0.99 * total)
    top = next(b for b, c in zip(bounds, counts, strict=True) if c >= total)
    return HistDelta(total, p99, top)


def gc_delta(before: str | None, after: str | None, gen: str) -> HistDelta:
    """One generation's GC pauses between two /metrics scrapes."""
    label = f'generation="{gen}"'
    return hist_delta(histogram(before, "gateway_gc_pause_seconds", label),
                      histogram(after, "gateway_gc_pause_seconds", label))


def gc_summary(before: str | None, after: str | None) -> str:
    """The gateway's GC pauses between two /metrics scrapes, per generation."""
    parts = []
    for gen in ("0", "1", "2"):
        d = gc_delta(before, after, gen)
        if d.count:
            parts.append(f"gen{gen} n={d.count:.0f} max <= {_ms(d.max_le)}")
    return ", ".join(parts) or "none"


_SWEEPS = re.compile(r'^gateway_gc_sweeps_total\{trigger="(\w+)"\} ([0-9.e+-]+)$', re.M)


def sweeps_by_trigger(text: str | None) -> str:
    """The heap keeper's sweeps so far, by what let each run ("lull 12, growth 0")."""
    found = {m.group(1): float(m.group(2)) for m in _SWEEPS.finditer(text or "")}
    return ", ".join(f"{k} {found.get(k, 0.0):.0f}" for k in ("lull", "growth"))


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1e3:g} ms"


# ---------------------------------------------------------------- measurements

@dataclass
class Target:
    name: str
    url: str
    pid: int | None            # the proxy's process; None for direct (or a peer not ours)
    metrics: bool = False      # exports gateway_* metrics
    peer: bool = False         # another router (--peer)


def stage_means(before: str | None, after: str | None) -> dict[str, float]:
    """Mean seconds per request in each pipeline stage between two scrapes."""
    out: dict[str, float] = {}
    for stage in STAGES:
        label = f'stage="{stage}"'
        got = [_sample(text, "gateway_request_stage_seconds", label) for text in (before, after)]
        d_sum = got[1][0] - got[0][0]
        d_count = got[1][1] - got[0][1]
        out[stage] = d_sum / d_count if d_count else math.nan
    return out


def _sample(text: str | None, name: str, label: str) -> tuple[float, float]:
    total = count = 0.0
    for line in (text or "").splitlines():
        if line.startswith(name + "_sum{") and label in line:
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count{") and label in line:
            count = float(line.rsplit(" ", 1)[1])
    return total, count


@dataclass(frozen=True)
class Snapshot:
    wall: float
    client: float       # CPU seconds of this process
    engine: float
    proxy: float
    proxy_wait: float   # seconds the proxy's loop thread sat runnable but not running
    busy: float         # CPU seconds all CPUs spent busy, whoever used them (steal too)
    stolen: float       # CPU seconds the hypervisor ran something else on our virtual CPUs


def _cpu(pid: int | None) -> float:
    return harness.cpu_seconds(pid) if pid is not None else 0.0


def snapshot(engine: Target, proxy: Target) -> Snapshot:
    m = harness.machine_cpu()
    return Snapshot(time.perf_counter(), time.process_time(), _cpu(engine.pid), _cpu(proxy.pid),
                    harness.run_queue_seconds(proxy.pid) if proxy.pid is not None else 0.0,
                    m.busy, m.stolen)


@dataclass(frozen=True)
class Usage:
    """Shares of one core over a window: ours, and everyone else's on this machine."""

    client: float
    engine: float
    proxy: float
    proxy_wait: float   # share of the window the proxy was ready to run and did not
    other: float        # other processes (and interrupts not charged to ours), steal included
    stolen_s: float = 0.0  # seconds the hypervisor took our CPUs (10 ms ticks)
    wall_s: float = 0.0

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> Usage:
        w = b.wall - a.wall
        client, engine, proxy = (b.client - a.client) / w, (b.engine - a.engine) / w, \
            (b.proxy - a.proxy) / w
        other = max(0.0, (b.busy - a.busy) / w - client - engine - proxy)
        return cls(client, engine, proxy, (b.proxy_wait - a.proxy_wait) / w, other,
                   b.stolen - a.stolen, w)

    def noisy(self, args: argparse.Namespace) -> bool:
        return bool(self.other > args.max_other or self.proxy_wait > args.max_wait)

    def show(self) -> str:
        return (f"other {f_pct(self.other)}, proxy waited {f_pct(self.proxy_wait)}, "
                f"stolen {self.stolen_s * 1e3:.0f} ms")


@dataclass
class TtftRun:
    target: str
    p50: float
    p99: float
    n: int
    errors: int
    excess_gap_p99: float      # per stream max gap beyond the engine's interval
    excess_gap_max: float
    usage: Usage
    client_lag_max: float
    loop_lag: HistDelta | None
    gc: str
    gc_full: HistDelta | None = None   # generation-2 pauses (the gateway's metric)
    # (when the stall began, its excess) of each stream stalled over stall_tracer.NOTE_S
    stalls: list[tuple[float, float]] = field(default_factory=list)
    attempts: int = 1

    @property
    def cpu_per_request_s(self) -> float:
        """The proxy's CPU seconds over the run per request it completed."""
        return self.usage.proxy * self.usage.wall_s / self.n if self.n else math.nan


@dataclass
class SatRun:
    target: str
    offered: float
    delivered: float
    usage: Usage
    ttft_p50: float
    ttft_p99: float
    excess_gap_p99: float
    excess_gap_max: float
    errors: int
    loop_lag: HistDelta | None
    gc: str
    attempts: int = 1

    @property
    def per_cpu_s(self) -> float:
        return self.delivered / self.usage.proxy if self.usage.proxy > 0 else math.nan


def excess_gaps(run: Outcome, itl_s: float) -> list[float]:
    return [max(0.0, r.max_gap_s - itl_s) for r in run.results if r.ok and r.ttft_s is not None]


def gateway_figures(t: Target, before: str | None, after: str | None
                    ) -> tuple[HistDelta | None, str]:
    if not t.metrics:
        return None, ""
    name = "gateway_event_loop_lag_seconds"
    return hist_delta(histogram(before, name), histogram(after, name)), gc_summary(before, after)


def client_gc_quiet() -> None:
    """Collect, then freeze what survives, in this (the client's) process, before a window.

    The client keeps every run's results; without this, a full collection that the growing
    heap triggers mid-run stalls the client's own loop (79 ms was seen late in a run) and
    shows as a stall of every stream, through whichever target is being measured. Frozen once
    a window, its young collections still took 4-6 ms inside windows at 300 streams (traced
    with CLOCK_MONOTONIC stamps against the streams' stalls), every stream late with them, and
    the engine too, which shares its CPU: Python counts allocations minus deallocations, and
    each result's frozen objects freed lowers the count, so the young generation grows far
    past its threshold's 700 objects. So `measure` also freezes every 0.1 s (`freeze_every`),
    as the gateway's heap keeper does (gateway/serving/heap.py), and it stays small.
    """
    gc.collect()
    gc.freeze()


def freeze_every(loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
    """Freeze what survives in this process every `interval_s`, for as long as `loop` runs."""
    gc.freeze()
    loop.call_later(interval_s, freeze_every, loop, interval_s)


def prompt_requests(tokens: int, extra: dict[str, float]) -> FixedRequests:
    """Part A's requests, by `--history`.

    same: every request sends the same user message (the piece cache holds it after the first);
    fresh: each request's message starts with a serial number, so its whole text is new to the
    gateway (a history never seen); seen: a fixed history of HISTORY_TURNS user/assistant turns
    (the words of --prompt-words shared among them) and a new short question each request, as a
    conversation's next turn is (the earlier turns' pieces are cached, the question is not).
    """
    if HISTORY[0] == "same":
        return FixedRequests(chat_request(MODEL, PROMPT[0], tokens, extra=extra))
    if HISTORY[0] == "fresh":
        return FixedRequests(lambda i: chat_request(
            MODEL, f"Request {next(_SERIAL)}. {PROMPT[0]}", tokens, extra=extra))
    words = PROMPT[0].split(" ")
    per_turn = max(1, len(words) // (2 * HISTORY_TURNS))
    history = [{"role": ("user", "assistant")[k % 2],
                "content": " ".join(words[k * per_turn:(k + 1) * per_turn])}
               for k in range(2 * HISTORY_TURNS)]

    def next_turn(i: int) -> RequestSpec:
        body = {"model": MODEL, "max_tokens": tokens, "stream": True,
                "stream_options": {"include_usage": True}, **extra,
                "messages": [*history, {"role": "user",
                                        "content": f"Question {next(_SERIAL)}: and then?"}]}
        return RequestSpec("/v1/chat/completions", orjson.dumps(body),
                           {"content-type": "application/json"})
    return FixedRequests(next_turn)


async def ttft_run(t: Target, engine: Target, *, streams: int, tokens: int, duration_s: float,
                   ttft_ms: float, itl_ms: float) -> TtftRun:
    requests = prompt_requests(tokens, {"stub_ttft_ms": ttft_ms, "stub_itl_ms": itl_ms})
    one_request_s = (ttft_ms + (tokens - 1) * itl_ms) / 1e3
    async with StreamClient(t.url, connections=streams * 2) as client:
        # Warm-up: open the connections (through the proxy too) before anything is timed.
        await Runner([client], requests, LoadShape(
            concurrency=streams, max_requests=streams, duration_s=10,
            ramp_s=one_request_s / 2)).run()
        client_gc_quiet()
        before = harness.metrics_text(t.url) if t.metrics else None
        s0 = snapshot(engine, t)
        async with LoopLagProbe() as lag:
            run = await Runner([client], requests, LoadShape(
                concurrency=streams, max_requests=1_000_000, duration_s=duration_s,
                ramp_s=one_request_s)).run()
        usage = Usage.between(s0, snapshot(engine, t))
        after = harness.metrics_text(t.url) if t.metrics else None
    if t.metrics:
        STAGE_RUNS.setdefault(t.name, []).append(stage_means(before, after))
    lag_delta, gc_note = gateway_figures(t, before, after)
    ttfts = run.ttfts()
    gaps = excess_gaps(run, itl_ms / 1e3)
    itl_s = itl_ms / 1e3
    stalls = [(r.max_gap_at_s, r.max_gap_s - itl_s) for r in run.results
              if r.ok and r.ttft_s is not None and r.max_gap_s - itl_s > stall_tracer.NOTE_S]
    return TtftRun(t.name, percentile(ttfts, 50), percentile(ttfts, 99), len(ttfts),
                   len(run.failed()), percentile(gaps, 99), max(gaps, default=math.nan),
                   usage, lag.max_s, lag_delta, gc_note,
                   gc_delta(before, after, "2") if t.metrics else None, stalls=stalls)


async def sat_run(t: Target, engine: Target, *, streams: int, itl_ms: float, stream_s: float,
                  window_s: float) -> SatRun:
    """Hold `streams` streams at `itl_ms`; measure relayed chunks/s over a steady window."""
    tokens = max(2, int(stream_s * 1e3 / itl_ms))
    spec = chat_request(MODEL, "Say hello.", tokens,
                        extra={"stub_ttft_ms": 50.0, "stub_itl_ms": itl_ms})
    warm_s = 0.5 + stream_s / 2   # ramp plus half a stream: every stream is in flight
    client_gc_quiet()
    async with StreamClient(t.url, connections=streams * 2, record_gaps=False) as client:
        task = asyncio.create_task(Runner([client], FixedRequests(spec), LoadShape(
            concurrency=streams, max_requests=1_000_000, duration_s=warm_s + window_s,
            ramp_s=0.5)).run())
        await asyncio.sleep(warm_s)
        before = harness.metrics_text(t.url) if t.metrics else None
        e0, s0 = client.events_total, snapshot(engine, t)
        await asyncio.sleep(window_s)
        e1, s1 = client.events_total, snapshot(engine, t)
        after = harness.metrics_text(t.url) if t.metrics else None
        run = await task
    lag_delta, gc_note = gateway_figures(t, before, after)
    ttfts = run.ttfts()
    gaps = excess_gaps(run, itl_ms / 1e3)
    return SatRun(t.name, streams * 1e3 / itl_ms, (e1 - e0) / (s1.wall - s0.wall),
                  Usage.between(s0, s1), percentile(ttfts, 50), percentile(ttfts, 99),
                  percentile(gaps, 99), max(gaps, default=math.nan), len(run.failed()),
                  lag_delta, gc_note)


STAGE_RUNS: dict[str, list[dict[str, float]]] = {}  # target -> per-run stage means


def ours(targets: Sequence[Target], engine: Target) -> list[int]:
    """The processes of the benchmark's own (whose CPU is not "other load")."""
    return [t.pid for t in (engine, *targets) if t.pid is not None]


# ---------------------------------------------------------------- report

@dataclass
class Report:
    lines: list[str] = field(default_factory=list)

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        self("| " + " | ".join(header) + " |")
        self("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            self("| " + " | ".join(row) + " |")
        self()


def f_ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def f_delta(seconds: float) -> str:
    return f"{seconds * 1e3:+.2f}"


def f_ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}x" if y > 0 and not math.isnan(x) else "n/a"


def f_pct(share: float) -> str:
    return f"{share * 100:.0f}%"


STALL_COLUMNS = ["target", "rep", "TTFT P50", "TTFT P99", "stall P99", "stall max", "proxy CPU",
                 "client CPU", "other load", "stolen ms", "client lag max", "gateway loop lag",
                 "gateway GC pauses"]


def stall_row(name: str, rep: int, r: TtftRun, proxied: bool) -> list[str]:
    """One run of parts C and D as a table row (the proxy's CPU only when there is one)."""
    return [name, str(rep), f_ms(r.p50), f_ms(r.p99), f_ms(r.excess_gap_p99),
            f_ms(r.excess_gap_max), f_pct(r.usage.proxy) if proxied else "",
            f_pct(r.usage.client), f_pct(r.usage.other), f"{r.usage.stolen_s * 1e3:.0f}",
            f_ms(r.client_lag_max),
            "" if r.loop_lag is None else r.loop_lag.show(), r.gc]


COLD_GAP_S = 0.035  # part A's gap between one stream's requests at 10 streams, roughly


def cold_code_probe(cpu: int | None) -> str:
    """How much slower the gateway's request parse runs after the CPU sat idle for as long as
    it does between requests at 10 streams. On a virtual machine that loses its caches to the
    host meanwhile, every stage of a request at low load runs that much slower: the floor's
    added latency then measures the machine as much as the proxy. The same gap spent
    spinning in this process (the vCPU never idle, nothing else run on it) tells whether
    idling is the cause (busy polling would help) or time alone (the host evicts whatever
    sat unused; only touching less code and data per request helps)."""
    from gateway.wire.openai import endpoint_of, parse_request

    body = orjson.dumps({"model": MODEL, "max_tokens": 16, "stream": True,
                         "messages": [{"role": "user", "content": "Say hello."}]})
    endpoint = endpoint_of(body)

    def spin(gap_s: float) -> None:
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass

    def timed(wait: Callable[[float], None] | None, n: int) -> float:
        out = []
        for _ in range(n):
            if wait is not None:
                wait(COLD_GAP_S)
            t = time.perf_counter()
            parse_request(body, endpoint)
            out.append(time.perf_counter() - t)
        return median(out) * 1e6

    with harness.pinned(cpu):
        hot, cold, spun = timed(None, 400), timed(time.sleep, 60), timed(spin, 60)
    return (f"Cold code: the gateway's parse of a 30-token chat request takes {hot:.1f} us "
            f"back to back, {cold:.1f} us after {COLD_GAP_S * 1e3:.0f} ms idle on the "
            f"proxy's CPU ({cold / hot:.1f}x) and {spun:.1f} us after {COLD_GAP_S * 1e3:.0f} "
            f"ms spinning there ({spun / hot:.1f}x)")


def pipeline_context(policies: dict[str, str], cpu: int | None) -> str:
    """The gateway's own work before upstream, in-process (benchmarks/pipeline_probe.py): the
    floor's and shipped's, back to back and after part A's gap idle. The tree's own gateway
    package, whatever `--gateway` runs."""
    parts = []
    for kind in ("floor", "shipped"):
        r = asyncio.run(pipeline_probe.probe(
            policies[kind], pipeline_probe.chat_body(MODEL, PROMPT[0]),
            gap_s=COLD_GAP_S, cpu=cpu))
        parts.append(f"{kind} {r.hot_us:.0f} us hot, {r.cold_us:.0f} us after "
                     f"{COLD_GAP_S * 1e3:.0f} ms idle")
    return ("The gateway's work before upstream, in-process with no socket "
            "(benchmarks/pipeline_probe.py, one user message of --prompt-words): "
            + "; ".join(parts))


def write_doc(path: Path, body: list[str]) -> None:
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    block = "\n".join([start, *body, end])
    if path.exists() and start in path.read_text():
        text = path.read_text()
        pre, rest = text.split(start, 1)
        post = rest.split(end, 1)[1] if end in rest else ""
        path.write_text(pre + block + post)
    else:
        path.write_text("# Proxy overhead: gateway vs direct\n\n"
                        "Produced by `benchmarks/proxy_overhead.py`; see benchmarks/README.md."
                        "\n\n" + block + "\n")


# ---------------------------------------------------------------- main

async def measure(args: argparse.Namespace, targets: list[Target], engine: Target,
                  out: Report,
                  start_gc_gateway: GcGateway | None = None) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    freeze_every(loop, 0.1)  # the client's young generation kept small (client_gc_quiet)
    if args.trace_stalls:
        stall_tracer.beat(loop)
    results: dict[str, Any] = {}
    if "A" in args.parts:
        results["A"] = await part_a(args, targets, engine, out)
    if "B" in args.parts:
        results["B"] = await part_b(args, targets, engine, out)
    if "C" in args.parts:
        results["C"] = await part_c(args, targets, engine, out)
    if "D" in args.parts and start_gc_gateway is not None:
        results["D"] = await part_d(args, targets, engine, out, start_gc_gateway)
    return results


async def wait_for_quiet(args: argparse.Namespace, ours: Sequence[int]) -> float:
    """Wait (at most --quiet-wait-s) until other processes leave the CPUs nearly idle.

    Returns the other load seen last, in shares of a core. Between measurements our own
    processes are idle, so what keeps the CPUs busy is someone else's work.
    """
    start = time.monotonic()
    while True:
        b0, o0 = harness.machine_cpu().busy, sum(map(_cpu, ours)) + time.process_time()
        await asyncio.sleep(0.5)
        o1 = sum(map(_cpu, ours)) + time.process_time()
        other = ((harness.machine_cpu().busy - b0) - (o1 - o0)) / 0.5
        waited = time.monotonic() - start
        if other <= args.max_other or waited > args.quiet_wait_s:
            if waited > 1.0:
                print(f"  waited {waited:.0f} s for other work to pass (other load now "
                      f"{f_pct(other)})", flush=True)
            return other


class Measured(Protocol):
    usage: Usage
    attempts: int


R = TypeVar("R", bound=Measured)


async def retried(args: argparse.Namespace, label: str,
                  measure_once: Callable[[], Awaitable[R]], ours: Sequence[int]) -> R:
    """Run a measurement again (up to --retries times) while other work disturbed it.

    On a shared 2-core machine another process on the proxy's CPU stalls the proxy and shows
    as its overhead; the noisy attempt is thrown away rather than averaged in.
    """
    attempt = 0
    while True:
        attempt += 1
        await wait_for_quiet(args, ours)
        result = await measure_once()
        if not result.usage.noisy(args) or attempt > args.retries:
            result.attempts = attempt
            return result
        print(f"  {label}: disturbed ({result.usage.show()}), measuring again", flush=True)


async def part_a(args: argparse.Namespace, targets: list[Target], engine: Target,
                 out: Report) -> dict[str, Any]:
    streams, ttft_ms, itl_ms = args.streams, 50.0, args.itl_ms
    prompt = (f"user message of {args.prompt_words} words" if args.prompt_words
              else "'Say hello.'")
    out(f"## A. TTFT overhead: {streams} concurrent streams, engine {ttft_ms:g} ms TTFT / "
        f"{itl_ms:g} ms per token, {args.tokens} tokens per request, {prompt}, history "
        f"`{args.history}`")
    out()
    out(f"{args.repeats} repeats of {args.ttft_s:g} s per target, order rotated each repeat; "
        "figures are medians over repeats; deltas are paired with the direct run of the same "
        "repeat. Times in ms.")
    out()
    runs: dict[str, list[TtftRun]] = {t.name: [] for t in targets}
    for rep in range(args.repeats):
        order = targets[rep % len(targets):] + targets[:rep % len(targets)]
        if rep % 2:
            order.reverse()
        for t in order:
            r = await retried(args, f"rep {rep} {t.name}", functools.partial(
                ttft_run, t, engine, streams=streams, tokens=args.tokens,
                duration_s=args.ttft_s, ttft_ms=ttft_ms, itl_ms=itl_ms), ours(targets, engine))
            runs[t.name].append(r)
            print(f"  rep {rep} {t.name:<15} p50 {f_ms(r.p50)} p99 {f_ms(r.p99)} n={r.n} "
                  f"err={r.errors} proxy cpu {f_pct(r.usage.proxy)} client cpu "
                  f"{f_pct(r.usage.client)} {r.usage.show()} stall max "
                  f"{f_ms(r.excess_gap_max)}", flush=True)
    direct = runs["direct"]
    rows = []
    for t in targets:
        rs = runs[t.name]
        d50 = [r.p50 - d.p50 for r, d in zip(rs, direct, strict=True)]
        d99 = [r.p99 - d.p99 for r, d in zip(rs, direct, strict=True)]
        proxied = t.name != "direct"
        rows.append([t.name, f_ms(median([r.p50 for r in rs])),
                     f_ms(median([r.p99 for r in rs])),
                     f_delta(median(d50)) if proxied else "",
                     f_delta(median(d99)) if proxied else "",
                     f"{f_delta(min(d99))} .. {f_delta(max(d99))}" if proxied else "",
                     f_ms(median([r.excess_gap_p99 for r in rs])),
                     f_ms(max(r.excess_gap_max for r in rs)),
                     f_pct(median([r.usage.proxy for r in rs])) if proxied else "",
                     f_ms(median([r.cpu_per_request_s for r in rs])) if proxied else "",
                     f_pct(median([r.usage.client for r in rs])),
                     f_pct(max(r.usage.other for r in rs)),
                     str(sum(r.n for r in rs)), str(sum(r.errors for r in rs)),
                     str(sum(r.attempts - 1 for r in rs))])
    out.table(["target", "TTFT P50", "TTFT P99", "+P50", "+P99", "+P99 range", "stall P99",
               "stall max", "proxy CPU", "CPU per request", "client CPU", "other load max",
               "requests", "errors", "retried"], rows)
    out("+P50/+P99: the median over repeats of (proxy - direct of the same repeat); the range "
        "shows the spread of +P99. Stall: a stream's longest gap between chunks beyond the "
        "engine's 20 ms, P99 over streams (median of repeats) and the worst of all. Other "
        "load: CPU used by processes not in the benchmark, in shares of a core. Client loop "
        f"lag max {f_ms(max(r.client_lag_max for rs in runs.values() for r in rs))} ms.")
    out()
    if any(t.peer for t in targets):
        beside_peers(targets, runs, out)
    staged = [t for t in targets if t.metrics and STAGE_RUNS.get(t.name)]
    if staged:
        out("Where a request's time goes before its first byte is upstream, and the engine's "
            "answer headers after it (gateway_request_stage_seconds: mean per request, "
            "median over repeats; microseconds):")
        out()
        def us(name: str, pick: Callable[[dict[str, float]], float]) -> str:
            return f"{median([pick(r) for r in STAGE_RUNS[name]]) * 1e6:.0f}"

        def before_upstream(r: dict[str, float]) -> float:
            return sum(v for k, v in r.items() if k != "upstream_headers")

        out.table(["stage", *(t.name for t in staged)],
                  [[stage, *(us(t.name, operator.itemgetter(stage)) for t in staged)]
                   for stage in STAGES]
                  + [["before upstream", *(us(t.name, before_upstream) for t in staged)]])
        out()
    for t in (t for t in targets if t.metrics):
        out(f"{t.name} event-loop lag per run (gateway_event_loop_lag_seconds): "
            + "; ".join(r.loop_lag.show() for r in runs[t.name] if r.loop_lag is not None))
        out()
        out(f"{t.name} GC pauses per run: " + "; ".join(r.gc for r in runs[t.name]))
        out()
    return {name: [as_json(r) for r in rs] for name, rs in runs.items()}


def as_json(r: TtftRun) -> dict[str, Any]:
    return {**dataclasses.asdict(r), "cpu_per_request_s": r.cpu_per_request_s}


def added(rs: Sequence[TtftRun], direct: Sequence[TtftRun]) -> tuple[float, float, float]:
    """Medians over repeats: +P50 and +P99 (each paired with the direct run of its repeat),
    and the proxy's CPU seconds per request."""
    return (median([r.p50 - d.p50 for r, d in zip(rs, direct, strict=True)]),
            median([r.p99 - d.p99 for r, d in zip(rs, direct, strict=True)]),
            median([r.cpu_per_request_s for r in rs]))


def beside_peers(targets: Sequence[Target], runs: dict[str, list[TtftRun]],
                 out: Report) -> None:
    """Each gateway target beside each peer, from the same interleaved runs, and issue 44's
    bound on it: the gateway's +P50 within 1.25 x the peer's + 0.2 ms, its +P99 within the
    peer's + 2 ms."""
    direct = runs["direct"]
    rows = []
    for g in (t for t in targets if t.metrics):
        g50, g99, gcpu = added(runs[g.name], direct)
        for p in (t for t in targets if t.peer):
            p50, p99, pcpu = added(runs[p.name], direct)
            met = g50 <= 1.25 * p50 + 0.0002 and g99 <= p99 + 0.002
            rows.append([g.name, p.name, f"{f_delta(g50)} / {f_delta(p50)}", f_ratio(g50, p50),
                         f"{f_delta(g99)} / {f_delta(p99)}", f_delta(g99 - p99),
                         f"{f_ms(gcpu)} / {f_ms(pcpu)}", f_ratio(gcpu, pcpu),
                         "met" if met else "NOT met"])
    out.table(["gateway", "peer", "+P50 gateway / peer", "ratio", "+P99 gateway / peer",
               "difference", "CPU per request gateway / peer", "ratio",
               "+P50 <= 1.25 x peer + 0.2, +P99 <= peer + 2"], rows)
    out("Times in ms, medians over the repeats above; every target ran in each repeat, in "
        "rotated order, against the same engine through the same client.")
    out()


async def part_b(args: argparse.Namespace, targets: list[Target], engine: Target,
                 out: Report) -> list[dict[str, Any]]:
    out(f"## B. Saturation: {args.sat_streams} streams, shorter token intervals until "
        "the proxy nears one core")
    out()
    out(f"Each level holds the streams for {args.sat_window_s:g} s of steady state. "
        "Chunks = SSE events delivered to the client. Per CPU-s = chunks/s divided by the "
        "proxy's share of a core: what one fully busy worker would relay.")
    out()
    rows = []
    best: dict[str, SatRun] = {}
    levels: list[SatRun] = []
    for itl in args.sat_itl_ms:
        for t in targets:
            if t.name in best and best[t.name].usage.proxy >= 0.95:
                continue  # this one is already at a full core
            s = await retried(args, f"itl {itl:g} {t.name}", functools.partial(
                sat_run, t, engine, streams=args.sat_streams, itl_ms=itl,
                stream_s=args.sat_stream_s, window_s=args.sat_window_s), ours(targets, engine))
            u = s.usage
            print(f"  itl {itl:g} {t.name:<15} offered {s.offered:.0f} delivered "
                  f"{s.delivered:.0f} proxy {f_pct(u.proxy)} engine {f_pct(u.engine)} "
                  f"client {f_pct(u.client)} {u.show()} ttft p99 {f_ms(s.ttft_p99)} "
                  f"stall p99 {f_ms(s.excess_gap_p99)} max {f_ms(s.excess_gap_max)} "
                  f"err {s.errors}", flush=True)
            levels.append(s)
            if t.name not in best or s.delivered > best[t.name].delivered:
                best[t.name] = s
            proxied = t.name != "direct"
            rows.append([t.name, f"{s.offered:.0f}", f"{s.delivered:.0f}",
                         f_pct(u.proxy) if proxied else "",
                         f"{s.per_cpu_s:.0f}" if proxied else "",
                         f_pct(u.engine), f_pct(u.client), f_pct(u.other),
                         f_pct(u.proxy_wait) if proxied else "",
                         f_ms(s.ttft_p50), f_ms(s.ttft_p99), f_ms(s.excess_gap_p99),
                         f_ms(s.excess_gap_max), str(s.errors),
                         "" if s.loop_lag is None else s.loop_lag.show(), s.gc])
    out.table(["target", "offered/s", "chunks/s", "proxy CPU", "per CPU-s", "engine CPU",
               "client CPU", "other load", "proxy waited", "TTFT P50", "TTFT P99",
               "stall P99", "stall max", "errors", "loop lag", "GC pauses"], rows)
    out("Best level per target:")
    out()
    best_rows = []
    for t in targets:
        if t.name == "direct" or t.name not in best:
            continue
        s = best[t.name]
        best_rows.append([t.name, f"{s.delivered:.0f}", f_pct(s.usage.proxy),
                          f"{s.per_cpu_s:.0f}", f"{s.delivered / LEGACY_PROXY_CHUNKS_S:.1f}x",
                          f"{s.per_cpu_s / LEGACY_PROXY_CHUNKS_S:.1f}x"])
    out.table(["proxy", "chunks/s", "CPU", "chunks per CPU-s", "vs 1,400/s",
               "per CPU-s vs 1,400/s"], best_rows)
    out("Where the proxy stayed well under a core at the top level, the engine and client "
        "on CPU 0 were the limit, not the proxy: chunks per CPU-s is then the figure to hold "
        "against the target.")
    out()
    return [{**dataclasses.asdict(s), "per_cpu_s": s.per_cpu_s} for s in levels]


async def part_c(args: argparse.Namespace, targets: list[Target], engine: Target,
                 out: Report) -> list[dict[str, Any]]:
    out(f"## C. Stalls at the target relay rate: {args.stall_streams} streams at 20 ms/token "
        f"({args.stall_streams * 50} chunks/s offered), {args.stall_s:g} s, direct and gateway "
        "alternated")
    out()
    rows = []
    done: list[dict[str, Any]] = []
    stall_targets = [t for t in targets
                     if t.peer or t.name in ("direct", "gateway", "shipped", "shipped-nofreeze",
                                             "shipped-aioclient")]
    for rep in range(args.stall_repeats):
        order = stall_targets if rep % 2 == 0 else list(reversed(stall_targets))
        for t in order:
            r = await retried(args, f"stall rep {rep} {t.name}", functools.partial(
                ttft_run, t, engine, streams=args.stall_streams, tokens=100,
                duration_s=args.stall_s, ttft_ms=50.0, itl_ms=20.0), ours(targets, engine))
            print(f"  stall rep {rep} {t.name:<10} stall p99 {f_ms(r.excess_gap_p99)} max "
                  f"{f_ms(r.excess_gap_max)} ttft p99 {f_ms(r.p99)} {r.usage.show()}",
                  flush=True)
            if args.trace_stalls:
                for line in stall_tracer.explain(str(args.trace_stalls), r.stalls):
                    out(f"  traced, rep {rep} {t.name}: {line}")
            proxied = t.name != "direct"
            rows.append(stall_row(t.name, rep, r, proxied))
            done.append({"rep": rep, **as_json(r)})
    out.table(STALL_COLUMNS, rows)
    out("A stall seen direct as well as through the gateway belongs to the engine or the "
        "client (both on CPU 0), not to the gateway. The GC pauses above are the ones that "
        "happened during the run; part D forces full collections.")
    out()
    return done


DEBUG_GC = "GATEWAY_DEBUG_GC_EVERY_S"
GC_SUFFIX = "+gc1s"  # part D's forcing twin of the plain target it runs beside
DUE_SUFFIX = "+due"  # its keeping twin: a sweep due every 0.1 s, run when its keeper says
StartProc = Callable[[], contextlib.AbstractContextManager[harness.Proc]]
# Part D's plain target, how to start its forcing twin, and (shipped only) its keeping twin.
GcGateway = tuple[str, StartProc, StartProc | None]


async def part_d(args: argparse.Namespace, targets: list[Target], engine: Target, out: Report,
                 start_gc_gateway: GcGateway) -> dict[str, Any]:
    """Stalls with and without a full collection forced every second.

    The forcing gateway is a second process, started only for this part (on the proxy's
    CPU, like the plain one), so parts A-C never share a core with its collections. It is
    the shipped gateway's twin when `shipped` is among the targets, else the floor's. Beside
    the shipped one runs a third twin whose sweep falls due every 0.1 s (backing off to 1.6 s
    while sweeps find nothing) and runs when its heap keeper lets it: what a load that never
    pauses sees of full collections as shipped, at 6,000-96,000 times their due rate.
    """
    base, start_forced, start_due = start_gc_gateway
    forced_name = base + GC_SUFFIX
    streams, itl_ms, tokens = args.streams, args.itl_ms, 100
    due_name = base + DUE_SUFFIX
    out(f"## D. Forced full GC: {streams} streams at {itl_ms:g} ms/token, {args.gc_s:g} s per "
        f"run, {args.gc_repeats} repeats; `{forced_name}` is `{base}` started with "
        "GATEWAY_DEBUG_GC_EVERY_S=1" + (
            f"; `{due_name}` is `{base}` with `server.gc_sweep_interval_s: {DUE_SWEEP_S}` (at "
            "most 16 times that apart), its heap keeper left to choose when a due sweep runs"
            if start_due is not None else ""))
    out()
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(start_forced())
        forced = Target(forced_name, proc.url, proc.pid, metrics=True)
        plain = [t for t in targets if t.name in ("direct", base)]
        twins = [forced]
        if start_due is not None:
            due = stack.enter_context(start_due())
            twins.append(Target(due_name, due.url, due.pid, metrics=True))
        order0 = [*plain, *twins]
        everyone = ours([*targets, *twins], engine)
        runs: dict[str, list[TtftRun]] = {t.name: [] for t in order0}
        rows = []
        for rep in range(args.gc_repeats):
            order = order0[rep % len(order0):] + order0[:rep % len(order0)]
            if rep % 2:
                order.reverse()
            for t in order:
                r = await retried(args, f"gc rep {rep} {t.name}", functools.partial(
                    ttft_run, t, engine, streams=streams, tokens=tokens,
                    duration_s=args.gc_s, ttft_ms=50.0, itl_ms=itl_ms), everyone)
                runs[t.name].append(r)
                print(f"  gc rep {rep} {t.name:<13} stall p99 {f_ms(r.excess_gap_p99)} max "
                      f"{f_ms(r.excess_gap_max)} {r.usage.show()} gc {r.gc or '-'}",
                      flush=True)
                proxied = t.name != "direct"
                rows.append(stall_row(t.name, rep, r, proxied))
        swept = {t.name: sweeps_by_trigger(harness.metrics_text(t.url)) for t in twins[1:]}
    out.table(STALL_COLUMNS, rows)
    out("Side by side (stall P99: median over repeats; stall max: worst of all repeats; "
        "full collections: `gateway_gc_pause_seconds{generation=\"2\"}` over all repeats, "
        "timed in the collecting thread's CPU time):")
    out()
    summary = []
    for name, rs in runs.items():
        row = [name, f_ms(median([r.excess_gap_p99 for r in rs])),
               f_ms(max(r.excess_gap_max for r in rs))]
        if name != "direct":
            lags = [r.loop_lag for r in rs if r.loop_lag is not None and r.loop_lag.count]
            full = [r.gc_full for r in rs if r.gc_full is not None and r.gc_full.count]
            row += [f"{max(x.max_le for x in lags) * 1e3:g}" if lags else "no samples",
                    f"{sum(x.count for x in full):.0f}",
                    f"<= {max(x.max_le for x in full) * 1e3:g}" if full else ""]
        else:
            row += ["", "", ""]
        summary.append(row)
    out.table(["target", "stall P99", "stall max", "loop lag max (bucket, ms)",
               "full collections", "full-GC pause max (bucket, ms)"], summary)
    for name, counts in swept.items():
        out(f"`{name}`'s heap keeper swept (the whole part, between runs included): {counts}.")
        out()
    out("A full collection holds the loop, so every stream in flight waits for it; with a "
        "collection every second and 2 s streams, each stream sees about two, so the stall "
        "P99 of the forcing gateway includes them. Objects frozen at start-up (`gc.freeze()`) "
        "are not traversed. The keeping twin's sweeps (`gateway_gc_sweeps_total`) run in the "
        "lulls between runs, or under load once memory has grown `server.gc_sweep_growth`.")
    out()
    return {name: [as_json(r) for r in rs] for name, rs in runs.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="one short repeat of everything")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--tokens", type=int, default=16, help="tokens per request in part A")
    p.add_argument("--ttft-s", type=float, default=3.0, help="seconds per part-A run")
    p.add_argument("--sat-streams", type=int, default=200)
    p.add_argument("--sat-itl-ms", type=float, nargs="+", default=[20.0, 10.0, 5.0, 3.3])
    p.add_argument("--sat-stream-s", type=float, default=1.0)
    p.add_argument("--sat-window-s", type=float, default=3.0)
    p.add_argument("--stall-streams", type=int, default=300)
    p.add_argument("--stall-s", type=float, default=5.0)
    p.add_argument("--stall-repeats", type=int, default=2)
    p.add_argument("--gc-s", type=float, default=10.0,
                   help="seconds per part-D run (one forced full collection per second)")
    p.add_argument("--gc-repeats", type=int, default=3)
    p.add_argument("--prompt-words", type=int, default=0,
                   help="each request's user message: this many distinct words (default: "
                        "'Say hello.', ~25 prompt tokens with the chat template)")
    p.add_argument("--history", choices=("same", "fresh", "seen"), default="same",
                   help="part A: same (one prompt for all), fresh (every prompt new), seen "
                        f"(a shared {HISTORY_TURNS}-turn history, then a new question)")
    p.add_argument("--itl-ms", type=float, default=20.0,
                   help="parts A and D: the engine's time per token (longer for 1,000 "
                        "streams, so the chunk rate stays one worker's)")
    p.add_argument("--targets", default="shipped,gateway,aiohttp,httpx",
                   help="proxies to run beside direct: gateway (tokenizer none: the floor), "
                        "shipped (exact tokenizer and template, admission, access log), "
                        "shipped-nostages (the same without the stage histogram), "
                        "shipped-noinline (every prompt counted in a worker thread), "
                        "shipped-nofreeze (Python's own GC thresholds, no heap keeper), "
                        "shipped-hf (the Hugging Face encoder, not the rank encoder), "
                        "shipped-inline8k (prompts under 8,192 characters counted on the loop), "
                        "shipped-switch1ms (the GIL's switch interval 1 ms), "
                        "shipped-jinja (every chat template rendered by Jinja, "
                        "models[].renderer: jinja), "
                        "shipped-aioclient and floor-aioclient (requests to the engine through "
                        "aiohttp's client, upstream.client: aiohttp), "
                        "aiohttp, httpx (the minimal pass-through proxies); beside them, other "
                        "routers with --peer")
    p.add_argument("--parts", default="ABCD", help="which parts to run, e.g. A or BD")
    p.add_argument("--gateway-log-level", default="info",
                   help="info keeps the access log on, as deployed (it goes to a file)")
    p.add_argument("--retries", type=int, default=2,
                   help="measure again when other work disturbed a measurement")
    p.add_argument("--quiet-wait-s", type=float, default=30.0,
                   help="before each measurement, wait up to this long for other load to pass")
    p.add_argument("--max-other", type=float, default=0.15,
                   help="other processes' CPU (share of a core) that makes a run noisy")
    p.add_argument("--max-wait", type=float, default=0.02,
                   help="share of a run the proxy waited for a CPU that makes it noisy")
    p.add_argument("--nice", type=int, default=0,
                   help="run everything at this niceness (e.g. -10, needs root) so other work "
                        "on a shared machine disturbs less")
    p.add_argument("--realtime", action="store_true",
                   help="run everything at SCHED_RR priority 1 (needs root): on a shared "
                        "machine, other work then cannot delay the processes measured")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--gateway", default=str(harness.BIN / "gateway"),
                   help="the gateway executable")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=SPEC",
                   help="another router beside the gateway, with the same client and engine: "
                        "SPEC a command ({engine}: the stub engine's URL, {port}: a free port) "
                        "or the URL of one already running (with --engine); repeatable")
    p.add_argument("--engine", metavar="URL",
                   help="a stub engine already running (benchmarks/stub_engine.py), for peers "
                        "started by hand against it; default: one started here")
    p.add_argument("--out", type=Path, metavar="FILE.json", help="every run's figures as JSON")
    p.add_argument("--write", type=Path, help="write results into this markdown file")
    p.add_argument("--trace-stalls", type=Path, metavar="DIR",
                   help="trace every process's GC pauses and loop lateness into DIR and, in "
                        "part C, print beside each burst of stalls what they were doing "
                        "(benchmarks/stall_site/stall_tracer.py; tracing costs CPU: figures "
                        "come from untraced runs)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.ttft_s, args.sat_window_s = 1, 2.0, 1.5
        args.sat_itl_ms, args.stall_s, args.stall_repeats = [20.0, 5.0], 2.0, 1
        args.gc_s, args.gc_repeats = 4.0, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harness.stop_on_sigterm()
    pin = not args.no_pin and harness.can_pin()
    engine_cpu, proxy_cpu = (0, 1) if pin else (None, None)
    if pin:
        os.sched_setaffinity(0, {0})  # this client shares CPU 0 with the engine
    if args.realtime:
        # Round-robin real-time priority, inherited by the servers started below: other
        # tenants' work can no longer delay a proxy that has a chunk to relay. Our processes
        # block on I/O between chunks, and the kernel's RT throttling (95% per second by
        # default) keeps the machine responsive.
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        except PermissionError:
            print("cannot take real-time priority (not root); running at normal priority")
            args.realtime = False
    if args.nice:
        # Children inherit it: on a shared machine the scheduler then favours the benchmark's
        # processes over background work, which would otherwise show as proxy overhead.
        try:
            os.nice(args.nice)
        except PermissionError:
            print(f"cannot renice to {args.nice} (not root); running at normal priority")
            args.nice = 0
    wanted = [n.strip() for n in args.targets.split(",") if n.strip()]
    peers = [parse_peer(p, wanted) for p in args.peer]
    if args.prompt_words:  # distinct words: roughly 1.5-2 tokens each with this vocabulary
        PROMPT[0] = " ".join(f"w{i} item" for i in range(args.prompt_words // 2))
    HISTORY[0] = args.history
    if args.trace_stalls:  # before any server starts: they inherit it
        args.trace_stalls.mkdir(parents=True, exist_ok=True)
        os.environ[stall_tracer.ENV] = str(args.trace_stalls)
        site = str(harness.ROOT / "benchmarks" / "stall_site")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [site, *filter(None, [os.environ.get("PYTHONPATH")])])
        stall_tracer.start("client")
    machine = harness.machine()
    context = [harness.describe(machine), cold_code_probe(proxy_cpu)]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        if args.engine:
            port = urllib.parse.urlsplit(args.engine).port
            engine = Target("engine", args.engine.rstrip("/"),
                            harness.pid_listening(port) if port else None)
        else:
            proc = stack.enter_context(harness.start(
                harness.stub_engine_command(cpu=engine_cpu), work))
            engine = Target("engine", proc.url, proc.pid)
        print(f"stub engine at {engine.url}", flush=True)
        targets = [Target("direct", engine.url, None)]
        # The SLO the planner derives the latency guard from: the default 60 ms per token, or
        # twice the stub's token interval when --itl-ms is longer, so the guard does not hold
        # back an engine that is slow by the benchmark's design.
        tpot = max(0.06, 2 * args.itl_ms / 1e3)
        policies = {kind: target_policy(engine.url, kind, tpot) for kind in VARIANTS}

        def gateway(name: str, env: dict[str, str] | None = None, kind: str = "floor"
                    ) -> contextlib.AbstractContextManager[harness.Proc]:
            return harness.start(harness.gateway_command(
                policies[kind], work, name=name, cpu=proxy_cpu, env=env,
                args=("--log-level", args.gateway_log_level), executable=args.gateway), work)

        def add(name: str, proc: harness.Proc, metrics: bool = True) -> None:
            targets.append(Target(name, proc.url, proc.pid, metrics=metrics))

        start_gc_gateway: GcGateway | None = None
        for name in wanted:
            if name == "shipped-switch1ms":  # the GIL handed over every 1 ms, not 5
                add(name, stack.enter_context(gateway(
                    name, {"GATEWAY_SWITCH_INTERVAL_S": "0.001"}, kind="shipped")))
            elif name in VARIANTS and name not in ("floor", "shipped-due"):
                add(name, stack.enter_context(gateway(name, kind=name)))
                if name == "shipped":  # part D forces sweeps in the gateway as users run it
                    start_gc_gateway = (name, functools.partial(
                        gateway, "shipped-gc", {DEBUG_GC: "1"}, kind="shipped"),
                        functools.partial(gateway, "shipped-due", kind="shipped-due"))
            elif name == "gateway":
                add(name, stack.enter_context(gateway("gateway")))
                if start_gc_gateway is None:
                    start_gc_gateway = ("gateway", functools.partial(
                        gateway, "gateway-gc", {DEBUG_GC: "1"}), None)
            elif name in ("aiohttp", "httpx"):
                add(f"minimal-{name}", stack.enter_context(harness.start(harness.Command(
                    f"minimal-{name}", [sys.executable, "benchmarks/minimal_proxies.py",
                                        "--client", name, "--upstream", engine.url, "--port",
                                        "{port}"], cpu=proxy_cpu), work)), metrics=False)
            else:
                raise SystemExit(f"unknown target {name!r}")
        for name, spec in peers:
            targets.append(peer_target(name, spec, engine.url, work, proxy_cpu, stack))
        context.append(pipeline_context(policies, proxy_cpu))
        out = Report()
        out("Machine: " + context[0] + ".")
        for line in context[1:]:
            out(line + ".")
        pinning = ("proxy under test pinned to CPU 1, engine and client to CPU 0" if pin
                   else "no CPU pinning") + (f", all at nice {args.nice}" if args.nice else "") \
            + (", all at real-time priority (SCHED_RR 1)" if args.realtime else "")
        command = f"python benchmarks/proxy_overhead.py {shlex.join(argv or sys.argv[1:])}"
        out(f"Run {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}, {pinning}. "
            f"Command: `{command}`")
        out()
        import uvloop
        results = uvloop.run(measure(args, targets, engine, out, start_gc_gateway))
        out(f"Total run time {time.time() - started:.0f} s.")
    if args.write:
        write_doc(args.write, out.lines)
    if args.out:
        harness.write_json(args.out, {"machine": machine, "command": command,
                                      "pinning": pinning, "context": context[1:],
                                      "peers": dict(peers), **results})
    return 0


def parse_peer(arg: str, wanted: Sequence[str]) -> tuple[str, str]:
    name, sep, spec = arg.partition("=")
    name = name.strip()
    if not sep or not name or not spec.strip():
        raise SystemExit(f"--peer {arg!r}: expected NAME=URL or NAME='COMMAND {{engine}} {{port}}'")
    if name == "direct" or name in wanted or name in VARIANTS:
        raise SystemExit(f"--peer {name}: the name of a target already")
    return name, spec.strip()


if __name__ == "__main__":
    raise SystemExit(main())
