"""`gateway serve --workers N`: N gateway processes on one port, one `/metrics` for them all.

The parent binds the port, starts N workers (fresh interpreters: `spawn`) that accept on the
same socket, and passes on signals: SIGHUP (reload the policy) to every worker, SIGTERM or
SIGINT (drain and stop) likewise. A worker that dies stops the others and the parent exits
non-zero, so the supervisor above (Docker, Kubernetes, systemd) restarts a whole replica
rather than one that silently runs with fewer workers.

What the workers must share, and how:

- admission: each worker admits on its own, so reservations must live in Redis: `--workers`
  needs `--redis-url` (with per-process memory N workers would admit N times the budget);
- metrics: a scrape reaches one worker at random, so every worker writes its samples to files
  in one directory (prometheus_client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR) and
  `/metrics` merges them: counters and histograms add up, each gauge combines as its
  `multiprocess_mode` in gateway/observe/metrics.py says.
"""

from __future__ import annotations

import glob
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

log = logging.getLogger("gateway.serving.workers")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STOP_TIMEOUT_S = 15.0


# What each worker process runs: (the shared listening socket, serve()'s keyword arguments).
# Passed in by `gateway serve` (a module-level function, so `spawn` can pickle it), which
# keeps this module free of the app it serves.
Worker = Callable[[socket.socket, dict[str, Any]], None]


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def metrics_dir() -> tuple[str, bool]:
    """The directory the workers write their samples to, emptied; and whether we made it."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return tempfile.mkdtemp(prefix="gateway-metrics-"), True
    os.makedirs(path, exist_ok=True)
    # Files left by an earlier run would add its counts to this one's.
    for name in glob.glob(os.path.join(path, "*.db")):
        os.remove(name)
    return path, False


def run(workers: int, host: str, port: int, target: Worker,
        serve_kwargs: dict[str, Any]) -> int:
    """Serve with `workers` processes until a signal stops them; the exit status."""
    sock = bind(host, port)
    path, made = metrics_dir()
    # Set before the workers start: prometheus_client picks its file-backed values when a
    # process first imports it.
    os.environ[MULTIPROC_ENV] = path
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(sock, serve_kwargs), name=f"gateway-worker-{i}")
             for i in range(workers)]
    pending: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        pending.append(signum)

    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    status = 0
    stopping = False
    try:
        for p in procs:
            p.start()
        log.info("gateway: %d workers on %s:%d, metrics merged from %s", workers, host, port,
                 path)
        stop_by = float("inf")
        while True:
            # Only the live workers' sentinels: an exited one is ready for ever, and waiting
            # on it spun this loop at full CPU while a stuck worker would not stop.
            live = [p.sentinel for p in procs if p.is_alive()]
            ended = wait(live, timeout=0.2) if live else []
            while pending:
                signum = pending.pop(0)
                if signum != signal.SIGHUP:
                    stopping = True
                _send(procs, signal.SIGHUP if signum == signal.SIGHUP else signal.SIGTERM)
            if stopping:
                stop_by = min(stop_by, time.monotonic() + STOP_TIMEOUT_S)
            if stopping and (not live or time.monotonic() > stop_by):
                break  # the finally kills a worker that did not stop in time
            if (ended or len(live) < len(procs)) and not stopping:  # a worker exited
                dead = [p for p in procs if not p.is_alive()]
                log.error("gateway: worker %s exited with %s; stopping the others",
                          dead[0].pid, dead[0].exitcode)
                status = 1
                stopping = True
                _send(procs, signal.SIGTERM)
    finally:
        for p in procs:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()
        sock.close()
        if made:
            shutil.rmtree(path, ignore_errors=True)
    return status


def _send(procs: Sequence[multiprocessing.process.BaseProcess], signum: int) -> None:
    for p in procs:
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signum)
