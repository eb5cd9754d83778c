"""The few ASGI helpers the endpoint modules share (reading a body, answering JSON or SSE,
noticing that the client left)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qsl

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache")]


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def respond(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond_cut(send: Send, body: bytes) -> None:
    """The "drop" fault on a whole response: promise all of `body`, send half, return (the
    server then closes the connection and the client sees a cut response)."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [*JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body[:len(body) // 2], "more_body": True})


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], object]) -> None:
    """Call `on_disconnect` when the client goes away (run as a task once the body is read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


def query(scope: Scope) -> dict[str, str]:
    """The query string's parameters (last one wins)."""
    raw = scope.get("query_string", b"")
    return dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True))
