"""`/v1/chat/completions`, `/v1/completions` and `/v1/models`.

The two POST endpoints are raw ASGI callables over the request pipeline (gateway/pipeline/):
they are the hot path, and Starlette's request and response wrappers would add work on every
streamed chunk. This module is only the transport: the headers the pipeline reads, the body
read bounded in size and time, a watch for the caller leaving, and errors rendered in OpenAI's
shape (gateway/api/errors.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from types import CoroutineType
from typing import Any, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.api.errors import http_error
from gateway.errors import (
    BodyTooLarge,
    GatewayError,
    InternalError,
    RequestTimeout,
    UnsupportedMediaType,
)
from gateway.pipeline import Gate, Pipeline
from gateway.pipeline.eager import start
from gateway.pipeline.inbound import Inbound
from gateway.runtime import Runtime, runtime_of
from gateway.upstream.forward import STAGE_CLOCK, ClientGone
from gateway.wire.openai import Endpoint, error_body

log = logging.getLogger("gateway.api")
_JSON = (b"content-type", b"application/json")
_ID_PREFIX = os.urandom(4).hex()
_ids = itertools.count(1)
_READ_HEADERS = frozenset({b"x-request-id", b"x-priority", b"authorization",
                           b"x-stainless-timeout", b"x-gateway-max-queue-ms",
                           b"content-length", b"content-encoding", b"x-session-id"})


def new_request_id() -> str:
    # Unique across replicas by the random prefix; cheaper than uuid4 per request.
    return f"gw-{_ID_PREFIX}-{next(_ids)}"


def inbound(scope: Scope, endpoint: Endpoint | None) -> Inbound:
    headers = _headers(scope)
    request_id = _valid_request_id(headers.get(b"x-request-id")) or new_request_id()
    return Inbound(endpoint, request_id, asyncio.get_running_loop().time(), STAGE_CLOCK(),
                   headers)


class AsgiClient:
    """The caller of one request, over ASGI: what the pipeline's `Client` asks for."""

    __slots__ = ("_cut", "_linger_s", "_task", "_watcher", "gone", "headers", "receive", "rid",
                 "send")

    def __init__(self, receive: Receive, send: Send, headers: Mapping[bytes, bytes],
                 request_id: str) -> None:
        self.receive = receive
        self.send = send
        self.headers = headers
        self.rid = (b"x-request-id", request_id.encode())
        self.gone = False
        # The request's task, known once it runs (`watch`): the app makes this client as it
        # is called, before the server has made the task.
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Future[Any] | None = None
        self._linger_s: float | None = None
        self._cut: asyncio.TimerHandle | None = None

    async def read_body(self, limit: int, timeout_s: float) -> bytes:
        encoding = self.headers.get(b"content-encoding")
        if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
            # The body would be read as JSON as it came, and a compressed one is no JSON; the
            # gateway inflates nothing (a small body could inflate past max_body_bytes).
            raise UnsupportedMediaType(
                f"Content-Encoding {encoding.decode('latin-1')!r} is not supported; send the "
                "body uncompressed.")
        declared = self.headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"The request body is {int(declared)} bytes; the limit is "
                               f"{limit} bytes.")
        # Most bodies come with the head: the first receive() then does not wait, and needs
        # no timer (eager.start); the deadline is set only once one would wait. Concrete
        # types are tested, not the ABCs (Coroutine, MutableMapping): run cold, as between
        # requests at low load, the two ABC checks cost ~20 us more (ASGI messages are dicts).
        receiving = self.receive()
        first: Message | Awaitable[Message] = \
            start(receiving) if isinstance(receiving, CoroutineType) else receiving
        if isinstance(first, dict) and first["type"] == "http.request" \
                and not first.get("more_body", False):
            body: bytes = first.get("body", b"")
            if len(body) > limit:
                raise BodyTooLarge(f"The request body exceeds the limit of {limit} bytes.")
            return body
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(timeout_s):
                message: Message = first if isinstance(first, dict) \
                    else await cast("Awaitable[Message]", first)
                while True:
                    if message["type"] == "http.disconnect":
                        self.gone = True
                        raise ClientGone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise BodyTooLarge(f"The request body exceeds the limit of {limit} "
                                           "bytes.")
                    parts.append(chunk)
                    if not message.get("more_body", False):
                        break
                    message = await self.receive()
        except TimeoutError:
            raise RequestTimeout(f"The request body did not arrive within {timeout_s:g}s.") \
                from None
        return b"".join(parts)

    def watch(self) -> None:
        """From here on (the body is read) a disconnect cancels the request's task at once,
        so a caller leaving while it waits in the queue or on the engine frees its place: a
        task waits on `receive()` for ASGI's `http.disconnect`."""
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self.receive())
        self._watcher.add_done_callback(self._disconnected)

    def _disconnected(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None \
                and fut.result()["type"] == "http.disconnect":
            self.lost()

    def lost(self) -> None:
        self.gone = True
        if self._task is None:
            return
        if self._linger_s is None:
            self._task.cancel()
        else:
            self._cut = asyncio.get_running_loop().call_later(self._linger_s, self._task.cancel)

    def linger(self, seconds: float) -> None:
        self._linger_s = seconds

    def detach(self) -> None:
        if self._watcher is not None:
            # Not cancelled: uvicorn's receive() returns `http.disconnect` once the answer is
            # complete (or the connection lost), so the watcher ends by itself, without the
            # cost of a cancellation on every request.
            self._watcher.remove_done_callback(self._disconnected)
            self._watcher = None
        if self._cut is not None:
            self._cut.cancel()
            self._cut = None

    async def answer_json(self, work: Awaitable[object], what: str) -> None:
        """Answer 200 with `work`'s result as JSON, or its error in this client's shape (an
        unexpected one as a 500 naming the request, logged as `what`)."""
        try:
            out = await work
        except GatewayError as err:
            await self.reply_error(err, response_started=False)
            return
        except Exception:
            rid = self.rid[1].decode()
            log.exception("unexpected error in %s %s", what, rid)
            await self.reply_error(InternalError(f"Internal gateway error (request id {rid})."),
                                   False)
            return
        body = orjson.dumps(out)
        await self.send({"type": "http.response.start", "status": 200,
                         "headers": [_JSON, self.rid, (b"content-length", b"%d" % len(body))]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def reply_error(self, err: GatewayError, response_started: bool) -> int:
        answer = http_error(err)
        if not self.gone and not response_started:
            headers = [_JSON, self.rid, (b"content-length", b"%d" % len(answer.body)),
                       *answer.headers]
            await self.send({"type": "http.response.start", "status": answer.status,
                             "headers": headers})
            await self.send({"type": "http.response.body", "body": answer.body,
                             "more_body": False})
        return answer.status


class PipelineEndpoint:
    """An ASGI endpoint over the pipeline of the runtime in force."""

    def __init__(self, runtime: Callable[[], Runtime]) -> None:
        self.runtime = runtime
        self._pipeline: Pipeline | None = None

    def pipeline(self) -> Pipeline:
        """The pipeline over the runtime in force; a new one only after a reload."""
        rt = self.runtime()
        if self._pipeline is None or self._pipeline.rt is not rt:
            self._pipeline = Pipeline(rt)
        return self._pipeline


class CompletionsEndpoint(PipelineEndpoint):
    """POST /v1/chat/completions, /v1/completions and the other admitted endpoints."""

    # The caller as this endpoint answers it (errors in OpenAI's shape here).
    client_class: type[AsgiClient] = AsgiClient

    def __init__(self, endpoint: Endpoint, runtime: Callable[[], Runtime],
                 gate: Gate | None = None) -> None:
        super().__init__(runtime)
        self.endpoint = endpoint
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pipeline = self.pipeline()
        request = inbound(scope, self.endpoint)
        client = self.client_class(receive, send, request.headers, request.request_id)
        await pipeline.serve(request, client, watch=True, gate=self.gate)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    # Only the few headers the gateway reads; later duplicates are ignored, as most proxies do.
    out: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in _READ_HEADERS and name not in out:
            out[name] = value
    return out


def _valid_request_id(value: bytes | None) -> str | None:
    if value and len(value) <= 128 and value.isascii():
        text = value.decode()
        if text.isprintable():
            return text
    return None


async def list_models(request: Request) -> Response:
    rt = runtime_of(request)
    assert rt is not None, "lifespan has not run"
    created = int(rt.started_at)
    data = [{"id": m.name, "object": "model", "created": created, "owned_by": "gateway"}
            for m in rt.policy.models]
    return Response(orjson.dumps({"object": "list", "data": data}),
                    media_type="application/json")


def error_response(status: int, message: str, type_: str, code: str | None) -> Response:
    return Response(error_body(message, type_, None, code), status_code=status,
                    media_type="application/json")
