"""An ASGI app served by the gateway's own server (uvicorn's `Server` over its HTTP/1.1
protocol) on a loopback port in this process, for tests that talk to it over raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from gateway.serving.server import ConnectionLimits, server_config
from tests.servers import free_port


@contextlib.asynccontextmanager
async def served(app: Any, limits: ConnectionLimits, max_concurrency: int | None = None
                 ) -> AsyncIterator[tuple[uvicorn.Server, int]]:
    """(the server, its port) while the block runs; the server stops after it."""
    port = free_port()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, max_concurrency, limits))
    server.config.lifespan = "off"
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started
    try:
        yield server, port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
