"""A scripted engine that misbehaves on purpose, on raw sockets in a thread of its own.

No engine of ours splits its events across reads, writes its JSON with spaces, answers in gzip
or with `101 Switching Protocols`, or accepts a request and stays silent; real ones and what
stands between them and the gateway (sidecars, TLS) do. The request's last message says what to
do, as words:

    stream [spaced] [error] [cut K R]   an SSE chat stream (role, two tokens, the finish, a
                                        usage-only chunk, [DONE]); `spaced`: JSON as Python's
                                        json.dumps writes it; `error`: an error event in place
                                        of the finish and usage; `cut K R`: the stream's bytes
                                        cut at every position p with p % K == R, each piece
                                        its own write, a pause between
    whole [spaced]                      a non-streamed completion with its usage
    gzip                                a completion in content-encoding gzip
    switch                              101 Switching Protocols
    silent                              reads the request and never answers

Every answer's usage is USAGE; `requests` counts what reached the engine, by script.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import json
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from tests.servers import free_port

USAGE = {"prompt_tokens": 579, "completion_tokens": 456, "total_tokens": 1035}
TEXT = ["Hello", " world"]
PAUSE_S = 0.002  # between two pieces of a cut stream: each arrives as a read of its own
ERROR = {"object": "error", "message": "The engine ran out of patience.",
         "type": "BadRequestError", "param": None, "code": 400}


def _dumps(obj: object, spaced: bool) -> bytes:
    return json.dumps(obj).encode() if spaced else \
        json.dumps(obj, separators=(",", ":")).encode()


def stream_bytes(spaced: bool = False, error: bool = False) -> bytes:
    def chunk(choices: list[dict[str, Any]], **more: Any) -> bytes:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": "test-model", "choices": choices, **more}
        return b"data: " + _dumps(body, spaced) + b"\n\n"

    events = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                      "finish_reason": None}])]
    events += [chunk([{"index": 0, "delta": {"content": t}, "finish_reason": None}])
               for t in TEXT]
    if error:
        events.append(b"data: " + _dumps({"error": ERROR}, spaced) + b"\n\n")
    else:
        events.append(chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
        events.append(chunk([], usage=USAGE))
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def whole_bytes(spaced: bool = False) -> bytes:
    return _dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                   "model": "test-model",
                   "choices": [{"index": 0, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "".join(TEXT)}}],
                   "usage": USAGE}, spaced)


def pieces(data: bytes, k: int, r: int) -> list[bytes]:
    cuts = [p for p in range(1, len(data)) if p % k == r]
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


class Misbehaving:
    """The engine; `with running() as engine:` serves it on a free loopback port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path = lines[0].split(b" ")[:2]
                length = next((int(line.split(b":", 1)[1]) for line in lines
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                if method == b"GET":
                    status, answer = (b"200 OK", b"ok") if path == b"/health" else \
                        (b"404 Not Found", b"{}")
                    writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: %d\r\n\r\n"
                                 % len(answer) + answer)
                    await writer.drain()
                    continue
                words = json.loads(body)["messages"][-1]["content"].split()
                with self._lock:
                    self.requests[words[0]] += 1
                if not await self.answer(words, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def answer(self, words: list[str], writer: asyncio.StreamWriter) -> bool:
        """Write the answer `words` ask for; False: the connection is done."""
        what, spaced = words[0], "spaced" in words
        if what == "stream":
            data = stream_bytes(spaced, "error" in words)
            parts = [data]
            if "cut" in words:
                at = words.index("cut")
                parts = pieces(data, int(words[at + 1]), int(words[at + 2]))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for part in parts:
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(PAUSE_S)
            writer.write(b"0\r\n\r\n")
        elif what in ("whole", "gzip"):
            data = whole_bytes(spaced)
            extra = b""
            if what == "gzip":
                data, extra = gzip.compress(data), b"content-encoding: gzip\r\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra
                         + b"content-length: %d\r\n\r\n" % len(data) + data)
        elif what == "switch":
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                         b"connection: upgrade\r\n\r\n")
        elif what == "silent":
            await asyncio.sleep(3600)
        await writer.drain()
        return what != "switch"


@contextlib.contextmanager
def running(engine: Misbehaving | None = None) -> Iterator[Misbehaving]:
    """Serve a Misbehaving engine on its own event loop in a thread until the block ends."""
    engine = engine or Misbehaving()
    loop = asyncio.new_event_loop()
    server: list[asyncio.Server] = []

    async def start() -> None:
        server.append(await asyncio.start_server(engine.serve, "127.0.0.1", engine.port))

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield engine
    finally:
        async def stop() -> None:
            server[0].close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
