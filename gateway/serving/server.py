"""Serving: uvicorn (uvloop + httptools) with the limits a public endpoint needs.

uvicorn's httptools protocol puts no bound on a request's head: a client can send megabytes of
headers and every byte is buffered. `BoundedHttpToolsProtocol` counts the bytes of the request
line and headers and answers 431 in OpenAI's error shape past `max_header_bytes`.

`run` serves the gateway, and the admin API on a port of its own when one is given, from one
event loop, with SIGHUP reloading the policy.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.protocol import error_body


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._head_done = False
        self._discarding = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._head_done = False

    def on_headers_complete(self) -> None:
        self._head_done = True
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return  # after a 431: read and drop the rest, so closing sends FIN, not RST
        if self._head_done:
            super().data_received(data)
            return
        self._head_bytes += len(data)
        super().data_received(data)
        if not self._head_done and self._head_bytes > self.max_header_bytes \
                and not self.transport.is_closing():
            body = error_body(f"The request line and headers exceed {self.max_header_bytes} "
                              "bytes.", "invalid_request_error", None,
                              "request_header_fields_too_large")
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            # Closing with unread bytes in the socket would reset the connection and the
            # client might never read the 431; drain for a moment, then close.
            self._discarding = True
            self.loop.call_later(1.0, self.transport.close)


def _config(app: Any, host: str, port: int, max_concurrency: int | None,
            max_header_bytes: int) -> uvicorn.Config:
    protocol = type("GatewayHttpProtocol", (BoundedHttpToolsProtocol,),
                    {"max_header_bytes": max_header_bytes})
    return uvicorn.Config(
        app, host=host, port=port, loop="uvloop", http=protocol, lifespan="auto",
        log_level="warning", access_log=False, timeout_graceful_shutdown=5, backlog=4096,
        # uvicorn's own cap is the backstop behind the gateway's OpenAI-shaped 503.
        limit_concurrency=max_concurrency, timeout_keep_alive=75)


def run(app: Any, host: str, port: int, *, max_header_bytes: int,
        max_concurrency: int | None, admin_app: Any | None = None,
        admin_port: int | None = None, on_sighup: Any | None = None,
        sockets: list[socket.socket] | None = None) -> None:
    """Serve until SIGTERM/SIGINT; `sockets`: listen on these (bound by serving/workers.py)."""
    main = uvicorn.Server(_config(app, host, port, max_concurrency, max_header_bytes))
    servers = [main]
    if admin_app is not None and admin_port is not None:
        admin = uvicorn.Server(_config(admin_app, host, admin_port, 64, max_header_bytes))
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

    uvloop.run(serve_all())
