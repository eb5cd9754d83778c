"""A very cheap OpenAI-compatible streaming engine for benchmarks (not the simulator).

It answers `POST /v1/chat/completions` and `/v1/completions` with a fixed time to first token
and a fixed interval between tokens, in vLLM's chunk format, and nothing else of interest: no
scheduler, no model. Its job is to never be the bottleneck, so a benchmark measures the proxy
in front of it.

Why it is built this way:
- a raw asyncio Protocol on uvloop with httptools parsing, no ASGI framework, so one core can
  offer tens of thousands of chunks per second;
- frames are encoded once per request (the whole HTTP chunk, size line included), so a token
  costs one `transport.write` of a bytes object that already exists;
- one loop timer per due millisecond for all streams (streams grouped by their next due time)
  rather than one sleep per stream, so 1,000 streams cost 1,000 timers/s, not 50,000 wakeups;
- a stream's next due time is its previous due time plus the interval, so lateness does not
  accumulate into the engine's own timing;
- what survives each young collection is frozen (`gc.freeze()`), as the gateway's heap keeper
  does, so no older-generation collection stalls every stream at once (the proxy benchmark
  would read it as a stall of whichever target it was measuring).

A request may carry `"stub_ttft_ms"` and `"stub_itl_ms"` in its body to override the engine's
defaults, so one engine (and the proxy in front of it) serves runs at several speeds.

Run: python benchmarks/stub_engine.py --port 8100 --ttft-ms 50 --itl-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import signal
import time
from collections.abc import Callable
from typing import cast

import httptools
import orjson
import uvloop

MAX_BODY = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS = 16


def _status_line(status: int) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found",
              405: b"Method Not Allowed", 413: b"Payload Too Large"}.get(status, b"Error")
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


def _plain_response(status: int, body: bytes, keep_alive: bool,
                    content_type: bytes = b"application/json") -> bytes:
    conn = b"keep-alive" if keep_alive else b"close"
    return (_status_line(status) + b"content-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: " + conn + b"\r\n\r\n" + body)


def _error_body(message: str, code: int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "BadRequestError",
                                   "param": None, "code": code}})


def _http_chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk (size line, payload, CRLF) around an SSE event."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Config:
    def __init__(self, ttft_s: float, itl_s: float, tick_s: float, model: str,
                 token_text: str) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.tick_s = tick_s
        self.model = model
        self.token_text = token_text


class Ticker:
    """One loop timer per due tick for every stream due in it (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float) -> None:
        self._loop = loop
        self._tick = tick_s
        self._buckets: dict[int, list[Stream]] = {}

    def schedule(self, stream: Stream, due: float) -> None:
        # Rounding up means a frame is never early; libuv timers have 1 ms resolution anyway.
        key = math.ceil(due / self._tick - 1e-9)
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = [stream]
            self._loop.call_at(key * self._tick, self._fire, key)
        else:
            bucket.append(stream)

    def _fire(self, key: int) -> None:
        streams = self._buckets.pop(key, ())
        for stream in streams:
            stream.step()


class Stream:
    """A response in progress: the frames it still has to write and when the next is due."""

    __slots__ = ("_conn", "_done", "_due", "_itl", "_left", "_mid", "_prefix", "_tail",
                 "_ticker", "closed")

    def __init__(self, conn: EngineProtocol, ticker: Ticker, prefix: bytes, mid: bytes,
                 tail: bytes, tokens: int, first_due: float, itl_s: float) -> None:
        self._conn = conn
        self._ticker = ticker
        self._itl = itl_s
        self._prefix = prefix  # goes out with the first token (vLLM's role frame)
        self._mid = mid        # every token but the last
        self._tail = tail      # the last token, usage, [DONE] and the terminating chunk
        self._left = tokens
        self._due = first_due
        self._done: Callable[[], None] | None = None
        self.closed = False
        ticker.schedule(self, self._due)

    def on_done(self, callback: Callable[[], None]) -> None:
        self._done = callback

    def step(self) -> None:
        if self.closed:
            return
        transport = self._conn.transport
        if transport is None or transport.is_closing():
            self.closed = True
            return
        frame = self._mid if self._left > 1 else self._tail
        if self._prefix:
            frame = self._prefix + frame
            self._prefix = b""
        transport.write(frame)
        self._left -= 1
        if self._left > 0:
            self._due += self._itl
            self._ticker.schedule(self, self._due)
        else:
            self.closed = True
            if self._done is not None:
                self._done()


class EngineProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection: parse requests with httptools, answer them one at a time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._body_len = 0
        self._pending: list[tuple[bytes, bytes, bytes, bool]] = []
        self._stream: Stream | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport does not subclass asyncio.Transport, but has its methods.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stream is not None:
            self._stream.closed = True
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._write_and_close(_plain_response(400, _error_body("bad request", 400), False))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []
        self._body_len = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len <= MAX_BODY:
            self._body.append(body)

    def on_message_complete(self) -> None:
        method = self._parser.get_method()
        keep_alive = self._parser.should_keep_alive()
        path = self._url.split(b"?", 1)[0]
        body = b"".join(self._body) if self._body_len <= MAX_BODY else b""
        self._pending.append((method, path, body, keep_alive))
        if self._stream is None:
            self._next()

    def _next(self) -> None:
        # HTTP/1.1 answers in order: a pipelined request waits for the stream before it.
        while self._pending and self._stream is None and self.transport is not None:
            method, path, body, keep_alive = self._pending.pop(0)
            self._handle(method, path, body, keep_alive)

    def _write_and_close(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.transport.close()

    def _reply(self, data: bytes, keep_alive: bool) -> None:
        if self.transport is None:
            return
        self.transport.write(data)
        if not keep_alive:
            self.transport.close()

    def _handle(self, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> None:
        engine = self._engine
        if path == b"/health":
            self._reply(_plain_response(200, b"", keep_alive), keep_alive)
        elif path == b"/v1/models":
            self._reply(_plain_response(200, engine.models_body, keep_alive), keep_alive)
        elif path in (b"/v1/chat/completions", b"/v1/completions"):
            if method != b"POST":
                self._reply(_plain_response(405, _error_body("use POST", 405), keep_alive),
                            keep_alive)
                return
            if self._body_len > MAX_BODY:
                self._write_and_close(
                    _plain_response(413, _error_body("body too large", 413), False))
                return
            self._completion(path == b"/v1/chat/completions", body, keep_alive)
        else:
            self._reply(_plain_response(404, _error_body("not found", 404), keep_alive),
                        keep_alive)

    def _completion(self, chat: bool, body: bytes, keep_alive: bool) -> None:
        try:
            req = orjson.loads(body)
            if not isinstance(req, dict):
                raise ValueError("body is not a JSON object")
            tokens = int(req.get("max_completion_tokens") or req.get("max_tokens")
                         or DEFAULT_MAX_TOKENS)
            if tokens < 1:
                raise ValueError("max_tokens must be at least 1")
            # Benchmark-only fields, so one engine can serve runs at several speeds.
            ttft_s = float(req.get("stub_ttft_ms", self._engine.config.ttft_s * 1e3)) / 1e3
            itl_s = float(req.get("stub_itl_ms", self._engine.config.itl_s * 1e3)) / 1e3
            if ttft_s < 0 or itl_s < 0:
                raise ValueError("stub_ttft_ms and stub_itl_ms must not be negative")
        except (ValueError, TypeError) as exc:
            self._reply(_plain_response(400, _error_body(str(exc), 400), keep_alive),
                        keep_alive)
            return
        engine = self._engine
        rid = engine.next_id()
        model = str(req.get("model") or engine.config.model)
        # A cheap stand-in for a tokenizer: about four bytes per token.
        prompt_tokens = max(1, len(body) // 4)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + tokens,
                 "completion_tokens": tokens}
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        frames = Frames(chat, ident, int(time.time()),
                        model, engine.config.token_text)
        loop = engine.loop
        if req.get("stream"):
            opts = req.get("stream_options")
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
                    + (b"" if keep_alive else b"connection: close\r\n") + b"\r\n")
            assert self.transport is not None
            # Headers go out at once, as vLLM's StreamingResponse sends them; tokens follow.
            self.transport.write(head)
            tail = frames.last()
            if include_usage:
                tail += _http_chunk(_sse(frames.usage(usage)))
            tail += _http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            stream = Stream(self, engine.ticker, frames.role(), frames.mid(), tail, tokens,
                            loop.time() + ttft_s, itl_s)
        else:
            payload = orjson.dumps(frames.whole(tokens, usage))
            response = _plain_response(200, payload, keep_alive)
            # One frame at the time the last token would be done: TTFT + (n-1) intervals.
            stream = Stream(self, engine.ticker, b"", b"", response, 1,
                            loop.time() + ttft_s + (tokens - 1) * itl_s, itl_s)
        self._stream = stream

        def done() -> None:
            self._stream = None
            if not keep_alive and self.transport is not None:
                self.transport.close()
            else:
                self._next()

        stream.on_done(done)


class Frames:
    """The pre-encoded frames of one response in vLLM's chunk format."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, text: str) -> None:
        self._chat = chat
        self._base: dict[str, object] = {
            "id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model}
        self._text = text

    def _choice(self, text: str, finish: str | None, role: bool = False) -> dict[str, object]:
        if self._chat:
            delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {
                "content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                "stop_reason": None}

    def _event(self, choice: dict[str, object]) -> bytes:
        return _http_chunk(_sse({**self._base, "choices": [choice]}))

    def role(self) -> bytes:
        return self._event(self._choice("", None, role=True)) if self._chat else b""

    def mid(self) -> bytes:
        return self._event(self._choice(self._text, None))

    def last(self) -> bytes:
        return self._event(self._choice(self._text, "length"))

    def usage(self, usage: dict[str, int]) -> dict[str, object]:
        return {**self._base, "choices": [], "usage": usage}

    def whole(self, tokens: int, usage: dict[str, int]) -> dict[str, object]:
        text = self._text * tokens
        choice: dict[str, object]
        if self._chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": "length"}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                      "stop_reason": None}
            kind = "text_completion"
        return {**self._base, "object": kind, "choices": [choice], "usage": usage}


class Engine:
    def __init__(self, loop: asyncio.AbstractEventLoop, config: Config) -> None:
        self.loop = loop
        self.config = config
        self.ticker = Ticker(loop, config.tick_s)
        self._ids = 0
        self.models_body = orjson.dumps({"object": "list", "data": [
            {"id": config.model, "object": "model", "created": 0, "owned_by": "stub"}]})

    def next_id(self) -> int:
        self._ids += 1
        return self._ids


def _freeze_after_young(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info["generation"] == 0:
        gc.freeze()


async def serve(host: str, port: int, config: Config) -> None:
    gc.collect()
    gc.freeze()
    gc.callbacks.append(_freeze_after_young)
    loop = asyncio.get_running_loop()
    engine = Engine(loop, config)
    server = await loop.create_server(lambda: EngineProtocol(engine), host, port,
                                      reuse_address=True, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub engine on http://{host}:{port} ttft={config.ttft_s * 1e3:g}ms "
          f"itl={config.itl_s * 1e3:g}ms", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--ttft-ms", type=float, default=50.0, help="time to first token")
    p.add_argument("--itl-ms", type=float, default=20.0, help="interval between tokens")
    p.add_argument("--tick-ms", type=float, default=1.0,
                   help="timer granularity; streams due in the same tick share one timer")
    p.add_argument("--model", default="bench-model", help="the name /v1/models lists")
    p.add_argument("--token", default=" tok", help="the text of every token")
    args = p.parse_args(argv)
    config = Config(args.ttft_ms / 1e3, args.itl_ms / 1e3, args.tick_ms / 1e3, args.model,
                    args.token)
    uvloop.run(serve(args.host, args.port, config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
