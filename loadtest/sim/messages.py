"""Anthropic's Messages API, as vLLM 0.32 serves it (vllm/entrypoints/anthropic/: protocol.py,
serving.py, api_router.py).

    POST /v1/messages                  a message, streamed or not
    POST /v1/messages/count_tokens     {"input_tokens": N, "context_management": {...}}

vLLM converts the body into a chat completion request (`to_chat_completion_request`) and serves
that: here the conversion is the gateway's (gateway/tokens/anthropic.py, written from the same
source), the chat request is read by the simulator's own chat parser and runs through the same
engine as a chat request (frontend time, `--max-num-queued-reqs`, the scheduler). Its output is
the filler text, one word per token.

The answer is vLLM's: a message `{"id", "type": "message", "role": "assistant", "content":
[{"type": "text", "text"}], "model", "stop_reason", "usage"}`; a stream of `event:`/`data:`
events, message_start (its usage the prompt), content_block_start, one content_block_delta per
token, content_block_stop, message_delta (stop_reason and the whole usage), message_stop.
Usage is Anthropic's: `input_tokens` without the prompt tokens read from the prefix cache,
which are `cache_read_input_tokens` (with --enable-prompt-tokens-details and a hit). Errors are
vLLM's `{"type": "error", "error": {"type", "message"}}`, the type its OpenAI name
(BadRequestError, ...).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson

from gateway.cost import RequestCostError
from gateway.tokens.anthropic import chat_form, merges_inline_system
from loadtest.sim import sse
from loadtest.sim.asgi import (
    SSE_HEADERS,
    Receive,
    Scope,
    Send,
    read_body,
    respond,
    respond_cut,
    watch_disconnect,
)
from loadtest.sim.host import Host
from loadtest.sim.protocol import (
    ERROR_TYPES,
    ApiError,
    ParsedRequest,
    bad_request,
    check_model,
    context_length_error,
    parse_chat,
    parse_json,
)
from loadtest.sim.scheduler import SimRequest, Status

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(status: int, message: str) -> bytes:
    """vLLM's `translate_error_response`: its OpenAI error type in Anthropic's shape."""
    return orjson.dumps({"type": "error", "error": {
        "type": ERROR_TYPES.get(status, "Error"), "message": message}})


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """`_build_anthropic_usage`: input_tokens leaves out the cache's hit."""
    out: dict[str, Any] = {"input_tokens": max(0, prompt_tokens - cached_tokens),
                           "output_tokens": output_tokens}
    if cached_tokens:
        out["cache_read_input_tokens"] = cached_tokens
    return out


class Messages:
    def __init__(self, app: Host) -> None:
        self.app = app

    def _chat(self, body: dict[str, Any], count_only: bool) -> ParsedRequest:
        """The chat request vLLM makes of a Messages body, read by the chat parser."""
        for name in ("model", "messages") if count_only else ("model", "messages", "max_tokens"):
            if name not in body:
                raise bad_request(f"Field required: {name}", name)
        if not isinstance(body["messages"], list) or not all(
                isinstance(m, dict) for m in body["messages"]):
            raise bad_request("messages: Input should be a valid list", "messages")
        max_tokens = body.get("max_tokens")
        if not count_only and (type(max_tokens) is not int or max_tokens <= 0):
            raise bad_request("max_tokens must be positive", "max_tokens")
        assert self.app.counter is not None, "Host.startup() was not run"
        try:
            form = chat_form(body, merges_inline_system(self.app.counter.tokenizer))
        except (RequestCostError, KeyError, TypeError, AttributeError) as exc:
            raise bad_request(str(exc), "messages") from None
        chat: dict[str, Any] = {"model": body["model"], "messages": form.messages, **form.fields}
        if form.tools is not None:
            chat["tools"] = form.tools
        if not count_only:
            chat["max_tokens"] = max_tokens
        for name in ("ignore_eos", "min_tokens"):  # vLLM's extensions, passed as they are
            if name in body:
                chat[name] = body[name]
        return parse_chat(chat)

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        try:
            body = parse_json(await read_body(receive))
            parsed = self._chat(body, count_only=True)
            check_model(parsed.model, app.spec.served_model_name)
            tokens, _, _ = await app.measure(parsed)
        except ApiError as exc:
            await respond(send, exc.status, error_body(exc.status, exc.message))
            return
        await respond(send, 200, orjson.dumps({
            "input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}))

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        arrival = asyncio.get_running_loop().time()
        try:
            body = parse_json(await read_body(receive))
            parsed = self._chat(body, count_only=False)
            check_model(parsed.model, app.spec.served_model_name)
            faults = app.faults.draw()
            if faults.fail:
                raise ApiError(500, "Simulated engine failure (fault injection: fail_rate).")
            tokens, hashes, ids = await app.measure(parsed)
            error = context_length_error(app.spec.max_model_len, tokens, parsed.max_tokens)
            if error is not None:
                raise error
            changed = asyncio.Event()
            request = await app.enter(
                arrival, "chatcmpl-" + uuid.uuid4().hex, tokens, hashes,
                parsed.max_tokens or app.spec.max_model_len - tokens, parsed.min_tokens,
                parsed.ignore_eos, lambda _r: changed.set(), prompt_ids=ids)
        except ApiError as exc:
            await respond(send, exc.status, error_body(exc.status, exc.message))
            return

        def gone() -> None:
            app.release(request)
            changed.set()

        watcher = asyncio.create_task(watch_disconnect(receive, gone))
        try:
            if body.get("stream") is True:
                await self._stream(send, request, changed)
            else:
                await self._whole(send, request, changed, faults.drop_after is not None)
        except OSError:
            pass  # the client went away mid-write
        finally:
            watcher.cancel()
            app.release(request)

    def _message(self, request: SimRequest, text: str, stop_reason: str | None
                 ) -> dict[str, Any]:
        return {"id": request.request_id, "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": text}], "model":
                self.app.spec.served_model_name, "stop_reason": stop_reason}

    async def _whole(self, send: Send, request: SimRequest, changed: asyncio.Event,
                     drop: bool) -> None:
        while not request.finished:
            await changed.wait()
            changed.clear()
        if request.status is Status.ABORTED:
            return
        n = request.num_output_tokens
        message = self._message(request, sse.filler_text(n),
                                STOP_REASONS.get(request.finish_reason or "length"))
        message["usage"] = usage(request.prompt_tokens, n, self.app.cached_tokens(request))
        body = orjson.dumps(message)
        if drop:
            await respond_cut(send, body)
            return
        await respond(send, 200, body)

    async def _stream(self, send: Send, request: SimRequest, changed: asyncio.Event) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        sent = 0
        words = sse.WORDS
        while True:
            await changed.wait()
            changed.clear()
            if request.status is Status.ABORTED:
                return  # the client left, or the engine "crashed": cut without message_stop
            out: list[bytes] = []
            produced = request.num_output_tokens
            if sent == 0 and produced > 0:
                # With the first token, as vLLM's first chunk: its usage is the prompt's.
                start = self._message(request, "", None)
                start.update(content=[], stop_sequence=None,
                             usage=usage(request.prompt_tokens, 0, 0))
                out.append(event("message_start", {"type": "message_start", "message": start}))
                out.append(event("content_block_start", {
                    "type": "content_block_start", "content_block": {"type": "text", "text": ""},
                    "index": 0}))
            while sent < produced:
                out.append(b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                           b'"delta":{"type":"text_delta","text":"' + words[sent % len(words)]
                           + b'"},"index":0}\n\n')
                sent += 1
            if request.status is Status.FINISHED:
                if produced:
                    out.append(event("content_block_stop",
                                     {"type": "content_block_stop", "index": 0}))
                out.append(event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": STOP_REASONS.get(request.finish_reason or "length"),
                              "stop_sequence": None},
                    "usage": usage(request.prompt_tokens, produced,
                                   self.app.cached_tokens(request))}))
                out.append(event("message_stop", {"type": "message_stop"}))
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": False})
                return
            if out:
                await send({"type": "http.response.body", "body": b"".join(out),
                            "more_body": True})
