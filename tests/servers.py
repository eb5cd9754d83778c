"""Start real servers (the gateway, the simulated engine) as subprocesses on loopback.

Tests talk to them over real sockets, as users do; nothing we own is mocked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def wait_http(url: str, process: subprocess.Popen[bytes], log_path: Path,
              timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return  # it answered; a 503 from /readyz still means the server is up
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer in {timeout}s:\n{log_path.read_text()}")


@contextlib.contextmanager
def run_server(args: list[str], health_path: str, tmp_path: Path, name: str,
               port: int | None = None, env: dict[str, str] | None = None,
               timeout: float = 30.0) -> Iterator[Server]:
    """Run `args` (with `{port}` substituted) until the block ends; yield its base URL."""
    port = port or free_port()
    argv = [a.replace("{port}", str(port)) for a in args]
    log_path = tmp_path / f"{name}-{port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env=full_env)
    server = Server(f"http://127.0.0.1:{port}", port, process, log_path)
    try:
        wait_http(server.url + health_path, process, log_path, timeout)
        yield server
    finally:
        server.stop()


def gateway_cmd(*args: str) -> list[str]:
    return [str(BIN / "gateway"), *args]


def loadtest_cmd(*args: str) -> list[str]:
    return [str(BIN / "loadtest"), *args]
