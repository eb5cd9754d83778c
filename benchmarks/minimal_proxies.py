"""The floor: the least a Python streaming proxy can do, with aiohttp or httpx as its client.

A raw ASGI app under one uvicorn worker (uvloop, httptools) that forwards the body to one
upstream and relays the response bytes as they come: no parsing, no routing, no metrics, no
admission. `proxy_overhead.py` runs it beside the gateway so the figures say what the
gateway's own work costs over the floor, and what the choice of HTTP client costs.

Run: python benchmarks/minimal_proxies.py --client aiohttp --upstream http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Hop-by-hop headers (RFC 9110 section 7.6.1) and the length we re-frame ourselves.
_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
        b"proxy-connection", b"content-length", b"host"}


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _forward_headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
            if k.lower() not in _HOP}


class AiohttpProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: Any = None

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        import aiohttp
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None))
        try:
            yield
        finally:
            await self.session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(self.lifespan, receive, send)
            return
        body = await _read_body(receive)
        async with self.session.request(scope["method"], self.upstream + scope["path"],
                                        data=body, headers=_forward_headers(scope)) as resp:
            headers = [(k.encode("latin-1"), v.encode("latin-1"))
                       for k, v in resp.headers.items() if k.lower().encode() not in _HOP]
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": headers})
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class HttpxProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client: Any = None

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        try:
            httpx = importlib.import_module("httpx")
        except ImportError:  # this venv ships httpx under the httpx2 name
            httpx = importlib.import_module("httpx2")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(limits=limits, timeout=None)
        try:
            yield
        finally:
            await self.client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(self.lifespan, receive, send)
            return
        body = await _read_body(receive)
        request = self.client.build_request(scope["method"], self.upstream + scope["path"],
                                            content=body, headers=_forward_headers(scope))
        resp = await self.client.send(request, stream=True)
        try:
            headers = [(k, v) for k, v in resp.headers.raw if k.lower() not in _HOP]
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": headers})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await resp.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _lifespan(factory: Callable[[], contextlib.AbstractAsyncContextManager[None]],
                    receive: Receive, send: Send) -> None:
    await receive()  # lifespan.startup
    async with factory():
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
    await send({"type": "lifespan.shutdown.complete"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--client", choices=["aiohttp", "httpx"], required=True)
    p.add_argument("--upstream", required=True, help="base URL of the engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8300)
    args = p.parse_args(argv)
    app = AiohttpProxy(args.upstream) if args.client == "aiohttp" else HttpxProxy(args.upstream)
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", http="httptools",
                lifespan="on", log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
