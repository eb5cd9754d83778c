"""Forwarding to engines, and streaming the answer back as it arrives.

The streaming path is the hot path: the engine's events go to the ASGI server as they are,
with no re-serialising, each as soon as its last byte has come (sse.py reassembles an event
split across reads); the gateway only notes when the first token came (TTFT) and, from the one
event that carries it, the final `usage`. What an engine did (errors.py) becomes the caller's
answer here: an error of the gateway's tree before the response has started, an SSE error event
after.

Requests to plain http:// engines go through the gateway's own HTTP/1.1 client (native.py), the
rest through aiohttp's (aio.py), behind one seam (base.py). Why aiohttp and not httpx: measured
here with a minimal pass-through proxy at 100 streams, httpx adds more TTFT and collapses above
~0.8 core (its pool hands one idle connection to several waiters, encode/httpcore#822), while
aiohttp relays >20x the chunks/s per core.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.types import Send

from gateway.errors import NoBackendAvailable, UpstreamError, UpstreamTimeout
from gateway.routing.backends import Backend
from gateway.routing.router import Router
from gateway.upstream import engine_errors as errs
from gateway.upstream.aio import AioClient, Whole
from gateway.upstream.base import Answer, Client
from gateway.upstream.errors import EngineFailure, Silent, describe
from gateway.upstream.native import EnginePool
from gateway.upstream.silence import NOT_WAITING, Silences
from gateway.upstream.sse import (
    Events,
    EventTooLarge,
    Usage,
    body_usage,
    has_error,
    has_usage,
    usage_events,
)
from gateway.wire import anthropic
from gateway.wire.openai import error_body, sse_error_frame

if TYPE_CHECKING:
    from gateway.admission.pool import Ticket

log = logging.getLogger("gateway.upstream")

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,128})"')
# A Responses stream opens with events sent before any token (response.created, ...): its
# first token, and each token after, is a delta event (text, reasoning or tool arguments).
# Anthropic's Messages stream (message_start, content_block_start, ...) likewise: its tokens
# are content_block_delta events.
_FIRST_TOKEN: dict[str, bytes] = {"responses": b'.delta"', "messages": b'"content_block_delta"'}
_EVENTS: dict[str, bytes] = {"responses": b'.delta"', "messages": b'"content_block_delta"'}
# Endpoints whose callers read errors in Anthropic's shape (gateway/wire/anthropic.py): an engine's
# error body and a broken stream's error event are written in it.
_ANTHROPIC_ERRORS = frozenset({"messages"})

# Engine response headers worth passing on; everything else (hop-by-hop, server, date,
# content-length of a body we re-frame) is the gateway's own business.
_PASS_HEADERS = frozenset({"content-type", "retry-after"})
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class ClientGone(Exception):
    """The caller disconnected; nothing more can be sent."""


@dataclass(slots=True)
class Upstream:
    """What to send an engine, and what to add to its answer; the pipeline's to build."""

    request_id: str
    endpoint: str
    pool: str
    # Emptied once an engine has answered (`Forwarder.forward`): a long prompt's bytes are
    # not held for its stream's life.
    body: bytes
    stream: bool
    # Let go once sent (`Forwarder._start`): a list the stream need not keep.
    response_headers: Sequence[tuple[bytes, bytes]]
    # The gateway asked the engine for a usage frame the caller did not: drop it on the way.
    strip_usage: bool = False
    # Called with `ticket` once: admission's prefill backlog. Two fields, not a partial: one
    # bound method for every stream, not a partial and a bound method held by each.
    on_first_byte: Callable[[Ticket], None] | None = None
    ticket: Ticket | None = None


# The stage budget's clock (gateway_request_stage_seconds; the engine's headers are timed on it
# here): stages take tens of microseconds, and uvloop's loop time moves in whole milliseconds
# (uv_now), so with it each stage read 0 or 1 ms and only the mean was right.
STAGE_CLOCK = time.perf_counter


@dataclass(slots=True)
class Relay:
    """What the engine did with one request, as the forwarder saw it; written only here.

    The latency guard reads `first_byte` and `sse_events` of streams still in flight.
    """

    backend: Backend | None = None
    status: int = 0
    first_byte: float | None = None
    finished: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    sse_events: int = 0
    attempts: int = 0
    response_started: bool = False
    response_id: str | None = None  # a Responses API answer's id, to find its backend later
    headers_at: float | None = None  # when the engine's answer headers came (STAGE_CLOCK)
    error: str = ""
    upstream_headers: dict[str, str] = field(default_factory=dict)


class Forwarder:
    def __init__(self, aio: AioClient, router: Router,
                 connect_timeout: float, read_timeout: float,
                 engines: EnginePool | None = None) -> None:
        self.aio = aio
        # The gateway's own client for the plain http:// engines; None: aiohttp's for all.
        self.engines = engines
        self._clients: dict[tuple[str, str | None], Client] = {}
        self.router = router
        self.backends = router.backends
        # The read timeout bounds the wait for an answer's head and a whole body; a stream's
        # body on the gateway's own client is watched by one timer for them all (silence.py).
        self.read_timeout_s = read_timeout
        self.connect_timeout_s = connect_timeout
        self.loop = asyncio.get_running_loop()
        self.loop_time = self.loop.time  # one bound method, not one held by each stream
        self.silences = Silences(self.loop, read_timeout)

    async def forward(self, up: Upstream, ex: Relay, send: Send,
                      first: Backend | None = None) -> None:
        """Send `up` to `first` (admission's choice), or to the least-loaded backend of its
        pool, and relay the answer through `send`, noting what happened in `ex`. A connect
        failure or a busy engine's 503 moves on to another backend of the pool (the
        reservation stays booked on the first; it is short-lived).

        Raises GatewayError before the response has started; after that, failures are
        written into the stream and recorded in `ex`.
        """
        backend, resp = await self._connect(up, ex, first)
        # The tries are over: the stream's frames hold what it reads, not what it tried.
        try:
            up.body = b""  # it has the request: nothing sends it again
            try:
                if not await self._answer_whole(up, ex, backend, resp, send):
                    await self._stream(up, ex, backend, resp, send)
            finally:
                resp.release()
        finally:
            backend.outstanding -= 1

    async def _connect(self, up: Upstream, ex: Relay, first: Backend | None
                       ) -> tuple[Backend, Answer]:
        """The first backend to answer `up`'s request, and its answer's head; the backend's
        `outstanding` stays counted for the caller to uncount."""
        tried: tuple[Backend, ...] = ()
        last_error = ""
        pool_size = len(self.backends.pools[up.pool])
        while len(tried) < pool_size:
            backend = first if first is not None else self.router.pick(up.pool, tried)
            first = None  # admission's choice goes first; then the router's (or a busy one's)
            if backend is None:
                break
            tried += (backend,)
            ex.backend = backend
            ex.attempts += 1
            backend.outstanding += 1
            try:
                resp, failure = await self._open(up, backend)
            except BaseException:
                backend.outstanding -= 1
                raise
            ex.headers_at = STAGE_CLOCK()
            if resp is not None:
                if resp.status != 503:
                    return backend, resp
                # vLLM answers 503 from its own valves (--max-num-queued-reqs/-tokens) before
                # the request starts, "so that load balancers retry on a different instance"
                # (vllm/exceptions.py): the next backend takes it; the last one's 503 is the
                # caller's answer. Busy is not broken: no failure is recorded.
                first = self.router.pick(up.pool, tried)
                if first is None:
                    return backend, resp
                resp.close()
                backend.outstanding -= 1
                continue
            # A connect failure: nothing reached the engine; try another.
            backend.outstanding -= 1
            last_error = f"`{backend.name}`: {failure}"
        if ex.attempts == 0:
            raise NoBackendAvailable(f"No healthy backend in pool `{up.pool}`.",
                                     retry_after_s=1)
        raise UpstreamError(
            f"Could not reach any backend of pool `{up.pool}` "
            f"({ex.attempts} tried; last: {last_error}).", backend=ex.backend.name
            if ex.backend is not None else None)

    async def passthrough(self, backend: Backend, method: str, endpoint_url: str,
                          body: bytes | None, request_id: str) -> tuple[int, bytes, str]:
        """One call to `backend` answered whole: (status, body, content type). For what
        carries no generation (tokenize, detokenize, a stored response): nothing to admit,
        meter or stream."""
        headers = {"x-request-id": request_id, "accept-encoding": "identity"}
        if body is not None:
            headers["content-type"] = "application/json"
        if backend.auth_header:
            headers["authorization"] = backend.auth_header
        try:
            answer = await self.aio.request(method, endpoint_url, body, headers,
                                            self.connect_timeout_s, self.read_timeout_s)
        except EngineFailure as exc:
            log.warning("engine %s/%s: %s", backend.pool, backend.name, describe(exc))
            raise UpstreamError(f"The engine `{backend.name}` could not answer "
                                f"({exc.public}).", backend=backend.name) from None
        if 300 <= answer.status < 400:  # not followed, as in `_open`
            return 502, error_body(
                f"The engine `{backend.name}` {_redirected(backend, answer)}.",
                "server_error", None, "upstream_error"), "application/json"
        if answer.status >= 400:  # one error shape, whoever refused
            return answer.status, errs.engine_error(answer.status, answer.body, backend.name), \
                "application/json"
        return answer.status, answer.body, answer.headers.get("content-type", "application/json")

    def _client(self, url: str, auth_header: str | None) -> Client:
        """Which client takes requests to `url`: by its scheme, once per URL."""
        key = (url, auth_header)
        client = self._clients.get(key)
        if client is None:
            engines = self.engines
            client = self._clients[key] = engines if engines is not None and \
                engines.serves(url, auth_header) else self.aio
        return client

    async def _open(self, up: Upstream, backend: Backend) -> tuple[Answer | None, str]:
        """The engine's response, or None and what went wrong in words fit for the caller,
        where another backend may take the request."""
        url = backend.urls[up.endpoint]
        try:
            resp = await self._client(url, backend.auth_header).post(
                url, up.request_id, up.body, backend.auth_header, self.connect_timeout_s,
                self.read_timeout_s)
        except EngineFailure as exc:
            self.backends.record_failure(backend, exc.kind, describe(exc))
            if exc.retry_elsewhere:
                # Refused, unreachable, or a kept-alive connection the engine had closed:
                # the engine did not start on this request, so another backend may take it.
                return None, exc.public
            if isinstance(exc, Silent):
                # Sent, then silent past read_timeout_s: the engine may be generating it (a
                # long prefill is silent too), so no other backend is given it.
                raise UpstreamTimeout(f"The engine `{backend.name}` did not answer within "
                                      f"{self.read_timeout_s:g}s.", backend=backend.name) \
                    from None
            # Reset, broken or malformed once the request was sent: it may have started there.
            raise UpstreamError(f"The engine `{backend.name}` broke off before answering "
                                f"({exc.public}).", backend=backend.name) from None
        if 300 <= resp.status < 400:
            # The engine did not run the request, so another backend may take it.
            self.backends.record_failure(backend, "redirect", f"HTTP {resp.status} redirect")
            resp.release()
            return None, f"it {_redirected(backend, resp)}"
        refused = _unreadable(resp)
        if refused:
            # An answer the gateway cannot relay as it came: nothing of it reaches the caller.
            self.backends.record_failure(backend, "protocol", refused)
            resp.close()
            raise UpstreamError(f"The engine `{backend.name}` {refused}.", backend=backend.name)
        return resp, ""

    async def _answer_whole(self, up: Upstream, ex: Relay, backend: Backend,
                            resp: Answer, send: Send) -> bool:
        """Relay an answer that is not a stream (an error, or a request that asked for none)
        whole; False for a stream, which `_stream` relays: this coroutine is over by then,
        not one more held for the stream's life."""
        ex.status = resp.status
        for name in _PASS_HEADERS:
            value = resp.headers.get(name)
            if value is not None:
                ex.upstream_headers[name] = value
        if resp.status >= 500 and resp.status != 503:
            body = await self._read_body(backend, resp)
            self.backends.record_failure(backend, "status_5xx", f"HTTP {resp.status}")
            # The engine's own message stays in the log: it may carry its internals.
            log.warning("engine %s/%s answered HTTP %d: %s", backend.pool, backend.name,
                        resp.status, errs.error_message(body))
            raise UpstreamError(
                f"The engine `{backend.name}` failed with HTTP {resp.status}.",
                backend=backend.name)
        if resp.status != 200 or not up.stream:
            body = await self._read_body(backend, resp)
            if resp.status == 200:
                self.backends.record_success(backend)
                _note_usage(ex, body_usage(body))
                if up.endpoint == "responses":
                    _parse_response_id(ex, body)
            elif not 200 <= resp.status < 300:
                # The engine's refusal in the gateway's shape: its status and message kept,
                # OpenAI's `type` and a string `code` instead of vLLM's (BadRequestError, 400).
                body = errs.engine_error(resp.status, body, backend.name)
                if up.endpoint in _ANTHROPIC_ERRORS:
                    body = anthropic.reshaped_error(resp.status, body)
                errs.engine_error_headers(resp.status, ex.upstream_headers)
            ex.first_byte = ex.finished = self.loop.time()
            if up.on_first_byte is not None and up.ticket is not None:
                up.on_first_byte(up.ticket)
            await self._start(up, ex, send, resp.status, len(body))
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return True
        return False

    async def _read_body(self, backend: Backend, resp: Answer) -> bytes:
        try:
            return await resp.read()
        except EngineFailure as exc:
            self.backends.record_failure(backend, exc.kind, describe(exc))
            raise UpstreamError(f"The engine `{backend.name}` broke off its answer "
                                f"({exc.public}).", backend=backend.name) from None

    async def _start(self, up: Upstream, ex: Relay, send: Send, status: int,
                     length: int | None) -> None:
        headers = list(up.response_headers)
        up.response_headers = ()
        if ex.backend is not None:
            headers.append((b"x-gateway-backend", ex.backend.name.encode()))
        for name, value in ex.upstream_headers.items():
            headers.append((name.encode(), value.encode("latin-1")))
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        else:
            headers.extend(_SSE_HEADERS)
        ex.response_started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _stream(self, up: Upstream, ex: Relay, backend: Backend,
                      resp: Answer, send: Send) -> None:
        await self._start(up, ex, send, 200, None)
        loop_time = self.loop_time
        strip_usage = up.strip_usage
        first_token = _FIRST_TOKEN.get(up.endpoint)
        event = _EVENTS.get(up.endpoint, b"data:")
        want_id = up.endpoint == "responses"
        events = Events()
        watch = self.silences.watch(resp)
        try:
            while True:
                watch.since = loop_time()
                read = await resp.readany()
                watch.since = NOT_WAITING
                if not read:
                    break
                chunk = events.push(read)
                if not chunk:  # the read ended inside an event: it goes when it is whole
                    continue
                if ex.first_byte is None and (first_token is None or first_token in chunk):
                    ex.first_byte = loop_time()
                    if up.on_first_byte is not None and up.ticket is not None:
                        up.on_first_byte(up.ticket)
                if want_id and ex.response_id is None:
                    _parse_response_id(ex, chunk)
                # Kept on the exchange as it goes: the latency guard reads streams in flight.
                ex.sse_events += chunk.count(event)
                if has_usage(chunk):
                    chunk, usage = usage_events(chunk, strip_usage)
                    _note_usage(ex, usage)
                    if not chunk:
                        continue
                if has_error(chunk) and up.endpoint not in _ANTHROPIC_ERRORS:
                    # An engine's error event: OpenAI's shape too (vLLM's Messages stream
                    # writes Anthropic's already).
                    chunk = errs.openai_error_events(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (EngineFailure, EventTooLarge) as exc:
            kind, public = (exc.kind, exc.public) if isinstance(exc, EngineFailure) else \
                ("protocol", "an event past the size the gateway takes")
            self.backends.record_failure(backend, kind, describe(exc))
            ex.error = f"upstream {kind}: {describe(exc)}"
            ex.status = 502
            resp.close()  # do not return a half-read connection to the pool
            message = f"The engine `{backend.name}` broke off the stream ({public})."
            await send({"type": "http.response.body", "more_body": False,
                        "body": anthropic.error_event(message)
                        if up.endpoint in _ANTHROPIC_ERRORS else sse_error_frame(message)})
        else:
            self.backends.record_success(backend)
            # An engine that ended its last event otherwise than with a blank line: relayed
            # as it came, nothing of the stream lost.
            await send({"type": "http.response.body", "body": events.rest(),
                        "more_body": False})
        finally:
            self.silences.close(watch)
            ex.finished = loop_time()


def _parse_response_id(ex: Relay, body: bytes) -> None:
    m = _RESPONSE_ID.search(body)
    if m:
        ex.response_id = m.group(1).decode()


def _note_usage(ex: Relay, usage: Usage | None) -> None:
    if usage is None:
        return
    if usage.prompt_tokens is not None:
        ex.prompt_tokens = usage.prompt_tokens
    if usage.completion_tokens is not None:
        ex.completion_tokens = usage.completion_tokens
    if usage.cached_tokens is not None:
        ex.cached_tokens = usage.cached_tokens


def _unreadable(resp: Answer) -> str:
    """Why an engine's answer cannot be relayed, in words for the caller; "" if it can.
    An interim or protocol-switching status is no answer to a POST the gateway relays, and a
    body in an encoding the gateway did not accept (it asks for identity) would reach the
    caller as bytes its declared type is not, its usage unread."""
    if resp.status < 200:
        return f"answered HTTP {resp.status}, which is not an answer the gateway relays"
    encoding = resp.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return (f"answered in content-encoding `{encoding[:40]}`, which the gateway did "
                "not ask for")
    return ""


def _redirected(backend: Backend, resp: Answer | Whole) -> str:
    """An engine's 3xx, not followed: the gateway talks to the engines its policy names and no
    one else (a 301 would also turn the POST into a GET). Its target, the URL to fix, goes to
    the log; the words returned, for the caller, name none."""
    log.warning("engine %s/%s answered HTTP %d to %s: redirects are not followed; set the "
                "backend's url to where the engine answers", backend.pool, backend.name,
                resp.status, resp.headers.get("location", "nowhere"))
    return f"answered a redirect (HTTP {resp.status}), which is not followed"


__all__ = ["STAGE_CLOCK", "ClientGone", "Forwarder", "Relay", "Send", "Upstream"]
