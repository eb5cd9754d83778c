"""`/v1/chat/completions`, `/v1/completions` and `/v1/models`.

The two POST endpoints are raw ASGI callables: they are the hot path, and Starlette's request
and response wrappers would add work on every streamed chunk. Each request: read the body
(bounded in size and time), validate what the gateway needs, route, forward, measure, log.
Whatever goes wrong, the caller gets OpenAI's error shape, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.admission.controller import Ask, Ticket
from gateway.api.errors import http_error, rate_limit_headers
from gateway.costing import cost_request, profile_of
from gateway.errors import BodyTooLarge, GatewayError, InternalError, RequestTimeout, UpstreamError
from gateway.observe.accesslog import log_exchange, log_rejection
from gateway.protocol import Endpoint, error_body, parse_request
from gateway.proxy import ClientGone, Exchange
from gateway.quotas import QuotaTicket
from gateway.runtime import Runtime, runtime_of

log = logging.getLogger("gateway.api")

_JSON = (b"content-type", b"application/json")
_ID_PREFIX = os.urandom(4).hex()
_ids = itertools.count(1)


def new_request_id() -> str:
    # Unique across replicas by the random prefix; cheaper than uuid4 per request.
    return f"gw-{_ID_PREFIX}-{next(_ids)}"


async def read_body(scope: Scope, receive: Receive, limit: int,
                    timeout_s: float) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(f"The request body is {int(value)} bytes; the limit is "
                               f"{limit} bytes.")
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"The request body exceeds the limit of {limit} bytes.")
                parts.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g}s.") from None
    return b"".join(parts)


class CompletionsEndpoint:
    """POST /v1/chat/completions or /v1/completions."""

    def __init__(self, endpoint: Endpoint, runtime: Callable[[], Runtime]) -> None:
        self.endpoint = endpoint
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt = self.runtime()
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        headers = _headers(scope)
        request_id = _valid_request_id(headers.get(b"x-request-id")) or new_request_id()
        rid_header = (b"x-request-id", request_id.encode())
        ex: Exchange | None = None
        ticket: Ticket | None = None
        forward_start = 0.0

        # Watch for the caller leaving while we wait (queue, engine); cancel the work at once.
        task = asyncio.current_task()
        gone = False

        def on_receive(fut: asyncio.Future[Any]) -> None:
            nonlocal gone
            if not fut.cancelled() and fut.exception() is None \
                    and fut.result()["type"] == "http.disconnect":
                gone = True
                if task is not None:
                    task.cancel()

        watcher: asyncio.Future[Any] | None = None
        quota: QuotaTicket | None = None
        try:
            tenant = rt.tenants.identify(headers.get(b"authorization"))
            body = await read_body(scope, receive, rt.policy.server.max_body_bytes,
                                   rt.policy.server.body_timeout_s)
            watcher = asyncio.ensure_future(receive())
            watcher.add_done_callback(on_receive)
            data, parsed = parse_request(body, self.endpoint, rt.policy.server.max_json_depth,
                                         rt.policy.server.max_json_items)
            model = rt.router.model(parsed.model)
            rt.tenants.check_model(tenant, model.name)
            costed, chars = await cost_request(rt, model, data, parsed)
            route = costed.route
            quota = await rt.quotas.take(tenant, costed.tokens, route.pool)
            ask = Ask(route.pool, costed.blocks, costed.tokens,
                      priority=rt.tenants.priority(tenant, headers.get(b"x-priority")),
                      caller=tenant.name, deadline_s=_client_deadline(headers),
                      overflow=route.overflow, tenant=tenant.name,
                      tenant_share=tenant.max_kv_share,
                      tenant_shadow=tenant.shadow, prompt_tokens=costed.prompt_tokens)
            strip_usage = False
            if parsed.stream and not (parsed.stream_options and
                                      parsed.stream_options.include_usage):
                # Ask the engine for its usage frame so tokens are counted as the engine
                # counts them; the caller, who did not ask, never sees it.
                data["stream_options"] = {**(data.get("stream_options") or {}),
                                          "include_usage": True}
                strip_usage = True
            if model.upstream_name != parsed.model or strip_usage:
                data["model"] = model.upstream_name
                body = orjson.dumps(data)
            ticket = await rt.admission.admit(ask)
            response_headers = [
                rid_header, (b"x-gateway-pool", route.pool.encode()),
                (b"x-gateway-decision", ticket.decision.encode()),
                (b"x-gateway-queue-ms", b"%d" % int(ticket.queue_s * 1000)),
                (b"x-gateway-prompt-tokens", b"%d" % costed.prompt_tokens)]
            if quota is not None and quota.window is not None:
                response_headers.extend(rate_limit_headers(quota.window))
            ex = Exchange(
                request_id=request_id, endpoint=self.endpoint, model=model.name,
                pool=route.pool, body=body, stream=bool(parsed.stream), arrival=arrival,
                response_headers=response_headers, tenant=tenant.name,
                estimated_prompt_tokens=costed.prompt_tokens, strip_usage=strip_usage,
                on_first_byte=partial(rt.admission.prefill_done, ticket),
            )
            inflight = rt.metrics.pool_children(route.pool)[3]
            inflight.inc()
            forward_start = loop.time()
            if ex.stream:
                rt.admission.watch(ticket, ex, forward_start,
                                   costed.cost.expected_output_tokens)
            try:
                await rt.forwarder.forward(ex, send, ticket.backend)
            finally:
                inflight.dec()
                _learn(rt, model.name, ex, chars, costed.exact)
                used = _usage_of(ex)
                if used is not None:
                    rt.accountant.record(route.pool, tenant.name, *used, profile_of(model),
                                         rt.backends.pools_inflight(route.pool))
        except asyncio.CancelledError:
            if not gone:
                raise
            if task is not None:
                task.uncancel()
        except ClientGone:
            gone = True
        except GatewayError as err:
            if ex is not None and ex.backend is not None and isinstance(err, UpstreamError) \
                    and err.backend is None:
                err.backend = ex.backend.name
            answer = http_error(err)
            if not gone and (ex is None or not ex.response_started):
                await _send_error(send, err, rid_header)
            if ex is not None:
                ex.status = answer.status
                ex.error = err.message
            else:
                rt.metrics.request_done("", "", answer.status)
                log_rejection(request_id, self.endpoint, answer.status, err.message)
        except Exception:
            log.exception("unexpected error in request %s", request_id)
            if ex is None or not ex.response_started:
                await _send_error(send, InternalError(
                    f"Internal gateway error (request id {request_id})."), rid_header)
            if ex is not None:
                ex.status = 500
        finally:
            if watcher is not None:
                watcher.remove_done_callback(on_receive)
                watcher.cancel()
            # Shielded: a second cancellation must not leak a reservation or a quota.
            if ticket is not None:
                await asyncio.shield(rt.admission.release(ticket))
            if quota is not None:
                await asyncio.shield(rt.quotas.settle(quota, _tokens_used(ex)))
        if ex is not None:
            _observe(rt, ex, gone, loop.time(), forward_start)


def _usage_of(ex: Exchange | None) -> tuple[int, int, int] | None:
    """(prompt, cached, output) tokens the engine spent; None when it never took the request.

    The engine's `usage` when it sent one (the gateway asks every stream for it); for a
    stream cut short, the prompt as counted here and one output token per streamed event
    (after the role event that opens a chat stream).
    """
    if ex is None or not ex.response_started or ex.status not in (200, 499, 502):
        return None
    if ex.prompt_tokens is not None and ex.completion_tokens is not None:
        return ex.prompt_tokens, ex.cached_tokens or 0, ex.completion_tokens
    if not ex.stream or ex.first_byte is None:
        return None
    opening = 1 if ex.endpoint == "chat" else 0
    return ex.estimated_prompt_tokens or 0, 0, max(0, ex.sse_events - opening)


def _tokens_used(ex: Exchange | None) -> int | None:
    used = _usage_of(ex)
    return None if used is None else used[0] + used[2]


def _headers(scope: Scope) -> dict[bytes, bytes]:
    # Only the few headers the gateway reads; later duplicates are ignored, as most proxies do.
    out: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in _READ_HEADERS and name not in out:
            out[name] = value
    return out


_READ_HEADERS = frozenset({b"x-request-id", b"x-priority", b"authorization",
                           b"x-stainless-timeout", b"x-gateway-max-queue-ms"})


def _valid_request_id(value: bytes | None) -> str | None:
    if value and len(value) <= 128 and value.isascii():
        text = value.decode()
        if text.isprintable():
            return text
    return None


def _client_deadline(headers: dict[bytes, bytes]) -> float | None:
    """A caller's own limit on queueing: x-gateway-max-queue-ms, or half the SDK's timeout.

    The official SDKs send their timeout as x-stainless-timeout (seconds); waiting longer than
    half of it in the queue leaves too little time to generate.
    """
    deadline = None
    raw = headers.get(b"x-gateway-max-queue-ms")
    if raw:
        with contextlib.suppress(ValueError):
            deadline = max(0.0, float(raw) / 1000)
    raw = headers.get(b"x-stainless-timeout")
    if raw:
        with contextlib.suppress(ValueError):
            half = max(0.0, float(raw) / 2)
            deadline = half if deadline is None else min(deadline, half)
    return deadline


def _learn(rt: Runtime, model: str, ex: Exchange, chars: int, exact: bool) -> None:
    """Feed completed requests back: output lengths, and the char ratio of `none` tokenizers."""
    if ex.status != 200:
        return
    if ex.completion_tokens is not None:
        rt.output_lengths[model].observe(ex.completion_tokens)
    if not exact and ex.prompt_tokens and chars:
        error = rt.counters[model].tokenizer.observe(chars, ex.prompt_tokens)
        rt.metrics.token_estimate_error.labels(model).observe(abs(error))


def _observe(rt: Runtime, ex: Exchange, gone: bool, now: float, forward_start: float) -> None:
    if gone:
        ex.status = 499  # nginx's "client closed request"
    if ex.finished is None:
        ex.finished = now
    duration, ttft, tpot, _ = rt.metrics.pool_children(ex.pool)
    rt.metrics.request_done(ex.pool, ex.model, ex.status)
    duration.observe(ex.finished - ex.arrival)
    if ex.status == 200 and ex.first_byte is not None:
        ttft.observe(ex.first_byte - ex.arrival)
        tokens = ex.completion_tokens
        if tokens is None and ex.stream:
            tokens = max(0, ex.sse_events - 2)  # minus the role frame and [DONE]
        tpot_s = None
        if ex.stream and tokens and tokens > 1:
            tpot_s = (ex.finished - ex.first_byte) / (tokens - 1)
            tpot.observe(tpot_s)
        # The guard watches the engines' latency, without our own queueing in it: otherwise
        # queueing would read as slowness and shrink the limit that causes the queueing.
        rt.admission.observe_latency(ex.pool, ex.first_byte - forward_start, tpot_s,
                                     admitted_s_ago=now - forward_start)
    log_exchange(ex, gone)


async def _send_error(send: Send, err: GatewayError, rid: tuple[bytes, bytes]) -> None:
    answer = http_error(err)
    headers = [_JSON, rid, (b"content-length", b"%d" % len(answer.body)), *answer.headers]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})


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

