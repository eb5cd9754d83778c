"""llama.cpp's `llama-server` with the tiny model: the binary (built once by
tools/engine-llamacpp, cached), its command line, and a process the tests and benchmarks start.

The flags are llama.cpp's own (common/arg.cpp of the pinned sources): `-np` slots, `-c` the
whole context (split evenly over the slots unless the KV cache is unified), `-t` decode
threads, `--metrics` for /metrics, `--slots` for /slots; the chat template is the GGUF's,
rendered by llama.cpp's Jinja engine (on by default in this version).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "engine-llamacpp"
SERVED_NAME = "tiny-qwen2"


class BuildImpossible(RuntimeError):
    """The machine cannot build llama-server (no cmake or C++ compiler): tests skip on it."""


def llama_server_binary(timeout_s: float = 3600.0) -> Path:
    """The llama-server binary: $LLAMA_SERVER when set, else the cached build, built now
    (about ten minutes on two cores, once) when there is none."""
    given = os.environ.get("LLAMA_SERVER")
    if given:
        return Path(given)
    if not TOOL.exists():  # an installed package without the checkout's tools/
        raise BuildImpossible(f"{TOOL} is not in this installation: set LLAMA_SERVER to a "
                              "llama-server binary, or run from a checkout")
    # The tool takes a lock, so a racing test session waits for one build, not two.
    done = subprocess.run([str(TOOL)], capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if done.returncode == 2:  # the tool's "cannot build here" (a tool missing, no sources)
        raise BuildImpossible(done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                              else "tools/engine-llamacpp cannot build llama-server here")
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"tools/engine-llamacpp failed ({done.returncode}):\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def cached_binary() -> Path | None:
    """The llama-server binary if it is already built (or $LLAMA_SERVER is set), else None;
    never builds."""
    given = os.environ.get("LLAMA_SERVER")
    if given:
        return Path(given)
    if not TOOL.exists():
        return None
    done = subprocess.run([str(TOOL), "--cached"], capture_output=True, text=True, timeout=60,
                          check=False)
    return Path(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None


@dataclass(frozen=True)
class EngineShape:
    """How one llama-server runs: its slots, each slot's context, and its threads."""

    slots: int = 4
    slot_context: int = 2048
    threads: int = 1
    batch: int = 512  # -b and -ub: prompt tokens per decode call
    metrics: bool = True  # --metrics: /metrics answers (without it, 501)


def server_argv(binary: Path, model: Path, port: int, shape: EngineShape = EngineShape(),
                served_name: str = SERVED_NAME) -> list[str]:
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(shape.slots), "-c", str(shape.slots * shape.slot_context),
            "-t", str(shape.threads), "-tb", str(shape.threads),
            "--threads-http", "2", "-b", str(shape.batch), "-ub", str(shape.batch),
            # One KV region per slot (-np given makes it so; said here so it stays so): the
            # slot model the gateway's `engine: llamacpp` admission is built on.
            "--no-kv-unified", *(["--metrics"] if shape.metrics else []), "--slots",
            "--no-webui", "--no-warmup", "-a", served_name]
