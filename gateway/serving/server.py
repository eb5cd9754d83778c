"""Serving: uvicorn's `Server` (uvloop, the sockets, the lifespan, signals, graceful shutdown)
over the gateway's own HTTP/1.1 protocol (gateway/serving/http_protocol.py: httptools' parser, the
limits a public endpoint needs, few objects per open stream).

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
from typing import Any

import uvicorn

from gateway.serving.http_protocol import HttpProtocol

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


def server_config(app: Any, host: str, port: int, max_concurrency: int | None,
            limits: ConnectionLimits) -> uvicorn.Config:
    protocol = type("GatewayHttpProtocol", (HttpProtocol,),
                    {"__slots__": (), "max_header_bytes": limits.max_header_bytes,
                     "header_timeout_s": limits.header_timeout_s,
                     "keep_alive_timeout_s": limits.keep_alive_timeout_s})
    return uvicorn.Config(
        # ASGI 3 said, not guessed: the gateway's `__call__` hands back a coroutine rather
        # than being a coroutine function.
        app, host=host, port=port, loop="uvloop", http=protocol, lifespan="auto",
        interface="asgi3",
        log_level="warning", access_log=False, timeout_graceful_shutdown=5, backlog=4096,
        # The gateway reads neither the caller's address nor its scheme, so uvicorn's
        # X-Forwarded-* middleware was only a coroutine more held by every stream, and a scan
        # of every request's headers.
        proxy_headers=False,
        # uvicorn's own cap is the backstop behind the gateway's OpenAI-shaped 503.
        limit_concurrency=max_concurrency)


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
