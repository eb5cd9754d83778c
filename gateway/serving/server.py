"""Serving: uvicorn (uvloop, its httptools protocol, the sockets, the lifespan, signals,
graceful shutdown), with the limits a public endpoint needs that it lacks kept around it
(gateway/serving/guard.py).

`run` serves the gateway, and the admin API on an address and port of its own when a port is
given, from one event loop, with SIGHUP reloading the policy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any, cast

import uvicorn

from gateway.serving.guard import GuardedApp, Limits

# The GIL's hand-off interval: how long the loop may wait for it while a counting thread runs
# Python (the template's render, piece lookups, block hashes). CPython's default, 5 ms, unless
# the environment says otherwise (benchmarks/proxy_overhead.py measures both).
SWITCH_INTERVAL_ENV = "GATEWAY_SWITCH_INTERVAL_S"
SWITCH_INTERVAL_S = 0.005


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What the protocol enforces on each connection: the policy's `server:` keys."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 75.0
    max_body_bytes: int = 8 * 2**20


def server_config(app: Any, host: str, port: int, max_concurrency: int | None,
                  limits: ConnectionLimits) -> uvicorn.Config:
    guard = Limits(limits.max_header_bytes, limits.header_timeout_s, limits.max_body_bytes,
                   max_concurrency)
    return uvicorn.Config(
        GuardedApp(app, guard), host=host, port=port, loop="uvloop",
        # Called as uvicorn calls a protocol class: the guard around uvicorn's own.
        http=cast("type[asyncio.Protocol]", guard.protocol),
        lifespan="auto", interface="asgi3", ws="none",
        log_level="warning", access_log=False, timeout_graceful_shutdown=5, backlog=4096,
        # uvicorn arms its idle timer with call_later: a fraction of a second is kept.
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
        # The gateway reads neither the caller's address nor its scheme.
        proxy_headers=False,
        # Not uvicorn's own cap: it counts idle connections too (the guard counts requests).
        limit_concurrency=None)


def run(app: Any, host: str, port: int, *, limits: ConnectionLimits,
        max_concurrency: int | None, admin_app: Any | None = None,
        admin_host: str = "127.0.0.1", admin_port: int | None = None,
        on_sighup: Any | None = None, sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGTERM/SIGINT; `sockets`: listen on these (bound by serving/workers.py)."""
    main = uvicorn.Server(server_config(app, host, port, max_concurrency, limits))
    servers = [main]
    if admin_app is not None and admin_port is not None:
        admin = uvicorn.Server(server_config(admin_app, admin_host, admin_port, 64, limits))
        admin.config.lifespan = "off"
        servers.append(admin)

    async def serve_all() -> None:
        loop = asyncio.get_running_loop()
        if on_sighup is not None:
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(on_sighup()))
        tasks = [asyncio.create_task(s.serve(sockets if s is main else None))
                 for s in servers]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for s in servers:  # one stopped (signal): stop the other too
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)

    import uvloop

    sys.setswitchinterval(float(os.environ.get(SWITCH_INTERVAL_ENV, SWITCH_INTERVAL_S)))
    uvloop.run(serve_all())
