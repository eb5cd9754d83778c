"""The test harness: real servers (the gateway, the simulated engine, a Redis) started as
subprocesses on loopback, and the few ways tests talk to them: plain HTTP, the official
`openai` SDK, and /metrics scrapes.

Tests talk to them over real sockets, as users do; nothing we own is mocked. Benchmarks import
`free_port` from here too, so this module needs nothing beyond the project's dependencies at
import time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    import openai

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
            http("GET", url, timeout=1)
            return  # it answered; a 503 from /readyz still means the server is up
        except (OSError, HTTPException):
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
    # GATEWAY_TEST_BIN runs the suite's gateways from another build (an older tree, to show
    # that a test fails there); unset, the checkout's own.
    return [os.environ.get("GATEWAY_TEST_BIN") or str(BIN / "gateway"), *args]


def loadtest_cmd(*args: str) -> list[str]:
    return [str(BIN / "loadtest"), *args]


# --- a Redis of a test's own ---------------------------------------------------------------


@dataclass
class Redis:
    """A throwaway redis-server: for tests that kill or restart Redis, which must not touch the
    suite's shared one (tools/with-redis finds or starts that, and exports REDIS_URL)."""

    port: int
    dir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start it (again, empty, on the same port) and wait until it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:  # a failure, not a skip: Redis tests never skip silently
            raise RuntimeError("redis-server is not installed (Debian: apt-get install "
                               "redis-server; `make test` installs it when run as root)")
        self.process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not _redis_answers(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: gone as in a crash, not a clean shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait(5)


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server(tmp_path: Path) -> Iterator[Redis]:
    """A private redis-server on a free loopback port until the block ends."""
    redis = Redis(free_port(), tmp_path)
    redis.start()
    try:
        yield redis
    finally:
        redis.kill()


# --- plain HTTP --------------------------------------------------------------------------


class Reply(NamedTuple):
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(method: str, url: str, body: bytes | object = None,
         headers: dict[str, str] | None = None, timeout: float = 10.0) -> Reply:
    """One request on a new connection, answered with whatever status the server chose (a 4xx
    or 5xx is a result to assert on, not an exception). A body that is not bytes is sent as
    JSON; any body is labelled JSON unless `headers` say otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname != "127.0.0.1":
        raise ValueError(f"tests talk to loopback only, not {url}")
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    sent = {"content-type": "application/json"} if data is not None else {}
    sent.update(headers or {})
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = HTTPConnection("127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        conn.request(method, path, body=data, headers=sent)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# --- the official OpenAI SDK -------------------------------------------------------------

# No retries, so a test sees the first answer; a timeout, so a hang fails instead of stalling
# the suite; the SDK insists on some key even where the gateway requires none.
_SDK_DEFAULTS: dict[str, Any] = {"api_key": "unused", "max_retries": 0, "timeout": 30}


def openai_client(url: str, **kw: Any) -> openai.OpenAI:
    """The SDK pointed at a server's base URL (`Server.url`; `/v1` is added here)."""
    import openai  # here, not at the top: benchmarks import this module, and the SDK is
    # only a dev dependency

    return openai.OpenAI(base_url=url + "/v1", **{**_SDK_DEFAULTS, **kw})


def async_openai_client(url: str, **kw: Any) -> openai.AsyncOpenAI:
    """`openai_client`, for async tests."""
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", **{**_SDK_DEFAULTS, **kw})


# --- /metrics ----------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Samples of a /metrics page, keyed by (name, sorted labels)."""
    reply = http("GET", url + "/metrics", timeout=5)
    assert reply.status == 200, reply
    out: Samples = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: Samples, name: str | tuple[str, ...], **labels: str) -> float:
    """Sum of the samples of `name` (or of each name given) whose labels include `labels`."""
    names = (name,) if isinstance(name, str) else name
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n in names and want <= set(ls))


def poll_metric(url: str, name: str | tuple[str, ...], until: Callable[[float], bool],
                timeout: float = 5.0, **labels: str) -> Samples:
    """Scrape `url` until `until(metric(...))` holds, and return that scrape; fail (never hang)
    when it does not within `timeout`. Counters and gauges move just after a request's last
    byte is sent, so a client that has read the whole answer can be a moment ahead of them."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        value = metric(samples, name, **labels)
        if until(value):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}/metrics: {name} {labels or ''} still {value} "
                                 f"after {timeout} s")
        time.sleep(0.05)


def settled(url: str, name: str, want: float, timeout: float = 5.0, **labels: str) -> Samples:
    """Scrape until `name` reaches at least `want`."""
    return poll_metric(url, name, lambda v: v >= want, timeout, **labels)


# What a request holds while the gateway has it: all zero once every release has run.
BUSY = ("gateway_kv_blocks_reserved", "gateway_inflight_requests", "gateway_queue_depth",
        "gateway_prefill_tokens_pending")


def quiet(url: str, timeout: float = 5.0) -> Samples:
    """Scrape until nothing is in flight, queued or reserved: releases follow the last byte."""
    return poll_metric(url, BUSY, lambda v: v == 0, timeout)
