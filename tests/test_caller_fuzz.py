"""The caller's side of the gateway's server (uvicorn's protocol inside gateway/serving/guard.py),
fuzzed: request-smuggling shapes (Content-Length and Transfer-Encoding together, two lengths,
`chunked` spelled oddly, obs-fold, bare CR and LF), malformed chunked bodies, truncated
requests, pipelined garbage, requests that stop mid-head or mid-body and then close or stay
silent. A few hundred cases from a fixed seed, many at once, against a small app served on
loopback with short timeouts.

What must hold (issue 43): no 500; every answer is whole HTTP/1.1, an error the guard or the
app writes is in OpenAI's shape (uvicorn's own 400 for what it cannot parse is text), and each
closes the connection; every connection is closed by the server within its bounds; afterwards
no connection, task or guard is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn

from gateway.serving.guard import LINGER_S, ConnectionGuard
from gateway.serving.server import ConnectionLimits
from gateway.wire.openai import error_body
from tests.in_process import served

SEED = 43
CASES = 300
AT_ONCE = 50

LIMITS = ConnectionLimits(max_header_bytes=8192, header_timeout_s=0.5, keep_alive_timeout_s=0.5)
# From a silent caller's last byte to the server's close: the longer of the head's and the
# body's clocks (an answer, a refusal and an idle close each come within one), with slack for
# a loaded machine.
CLOSED_WITHIN_S = max(LIMITS.header_timeout_s, LIMITS.keep_alive_timeout_s) + 2.5

# The errors in OpenAI's shape: the guard's (408, 431) and the app's late body (408); the app's
# others are 200 and 401; uvicorn's 400 is text.
PROTOCOL_ERRORS = {408, 431}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """/echo reads the whole body within the body's time, else a 408 (as the gateway's
    `server.body_timeout_s`); /early answers without reading it (a bad key's 401); anything
    else streams three chunks without reading it."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/echo":
        size = 0
        try:
            async with asyncio.timeout(LIMITS.keep_alive_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    size += len(message.get("body", b""))
                    if not message.get("more_body"):
                        break
        except TimeoutError:
            late = error_body("late", "invalid_request_error", None, "request_timeout")
            await send({"type": "http.response.start", "status": 408,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", b"%d" % len(late))]})
            await send({"type": "http.response.body", "body": late})
            return
        body = b"%d" % size
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
    elif path == "/early":
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"no"})
    else:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"%d" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


# --- what callers send -------------------------------------------------------------------

HOST = b"host: x\r\n"


def _head(line: bytes, *headers: bytes) -> bytes:
    return line + b"\r\n" + HOST + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


def _valid(rng: random.Random) -> bytes:
    body = rng.randbytes(rng.choice([0, 1, 10, 300]))
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                      for i in range(0, len(body), 7)) + b"0\r\n\r\n"
    return rng.choice([
        _head(b"GET /stream HTTP/1.1"),
        _head(b"POST /echo HTTP/1.1", b"content-length: %d" % len(body)) + body,
        _head(b"POST /echo HTTP/1.1", b"transfer-encoding: chunked") + chunks,
        _head(b"POST /early HTTP/1.1", b"content-length: %d" % len(body)) + body,
        _head(b"GET /stream HTTP/1.0"),
        _head(b"GET /stream HTTP/1.1", b"connection: close"),
    ])


_TE = [b"Chunked", b"CHUNKED", b" chunked", b"chunked ", b"\tchunked", b"chunked, identity",
       b"identity, chunked", b"gzip, chunked", b"chunked\x0b", b"xchunked", b"chunk ed",
       b'"chunked"', b"chunked;q=1"]
_CL = [b"3", b"+3", b"-1", b" 3 ", b"0x3", b"3a", b"3, 3", b"99999999999999999999999", b""]
_BAD_CHUNKS = [b"ffffffffffffffffff\r\n", b"0x5\r\nhello\r\n0\r\n\r\n", b"-1\r\n",
               b"5\r\nhelloXX\r\n0\r\n\r\n", b"5;ext\nhello\r\n0\r\n\r\n",
               b"5\r\nhello\n0\r\n\r\n", b"5 \r\nhello\r\n0\r\n\r\n", b"5\r\nhello\r\n0\r\n",
               b"5\r\nhel", b"", b"1\r\nx\r\n0\r\nbad trailer\r\n\r\n", b"0\r\n\r\n\r\n"]


def _smuggling(rng: random.Random) -> bytes:
    post = b"POST /echo HTTP/1.1"
    return rng.choice([
        _head(post, b"content-length: 6", b"transfer-encoding: chunked") + b"0\r\n\r\nX",
        _head(post, b"transfer-encoding: chunked", b"content-length: 3") + b"0\r\n\r\n",
        _head(post, b"content-length: 3", b"content-length: 5") + b"abcde",
        _head(post, b"content-length: 3", b"content-length: 3") + b"abc",
        _head(post, b"content-length: " + rng.choice(_CL)) + b"abc",
        _head(post, b"transfer-encoding: " + rng.choice(_TE)) + b"3\r\nabc\r\n0\r\n\r\n",
        _head(post, b"Transfer-Encoding: chunked", b"transfer-encoding: chunked")
        + b"0\r\n\r\n",
        _head(post, b"transfer-encoding : chunked") + b"0\r\n\r\n",
        _head(post, b"x-a: b", b" transfer-encoding: chunked") + b"0\r\n\r\n",  # obs-fold
        _head(post, b"transfer-encoding:", b" chunked") + b"0\r\n\r\n",
        _head(b"GET /stream HTTP/1.1", b"x-a: b", b"\tc"),
        b"GET /stream HTTP/1.1\rhost: x\r\n\r\n",  # a bare CR
        b"GET /stream HTTP/1.1\r\nhost: x\r\nx-a: b\rc\r\n\r\n",
        b"GET /stream HTTP/1.1\nhost: x\n\n",  # bare LFs
        b"GET /stream HTTP/1.1\r\nhost: x\n\r\n",
        b"GET /stream HTTP/1.1\r\nhost: x\r\nx-a: \x00\r\n\r\n",
        b"GET /stream\r\n\r\n",  # HTTP/0.9
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"GET  /stream  HTTP/1.1\r\nhost: x\r\n\r\n",
        b"GET http://x/stream HTTP/1.1\r\nhost: x\r\n\r\n",
        _head(b"GET /stream HTTP/1.1", b"x-big: " + b"a" * 9000),  # past max_header_bytes
        _head(b"GET /stream HTTP/1.1", *(b"x-%d: a" % i for i in range(1000))),
        _head(post, b"transfer-encoding: chunked") + rng.choice(_BAD_CHUNKS),
        _head(b"GET /stream HTTP/1.1", b"content-length: 10"),  # a body that never comes
        _head(b"POST /early HTTP/1.1", b"content-length: 100") + b"x",
        _head(post, b"content-length: 100000") + b"x" * rng.randrange(100),
    ])


def _mutated(rng: random.Random) -> bytes:
    """A valid request with a few bytes past its request line replaced, dropped or added (the
    request line is kept: a HEAD's answer has no body to read)."""
    data = bytearray(_valid(rng))
    start = data.index(b"\r\n") + 2
    for _ in range(rng.randrange(1, 4)):
        at = rng.randrange(start, len(data) + 1)
        edit = rng.choice([b"\r", b"\n", b"\x00", b":", b" ", b"\t", b"\xff", b""])
        data[at:at + rng.randrange(2)] = edit
    return bytes(data)


def _garbage(rng: random.Random) -> bytes:
    return rng.randbytes(rng.randrange(1, 40))


def case(rng: random.Random) -> tuple[list[bytes], str]:
    """What one connection sends, in pieces, and then: `close` or stay `silent`."""
    kinds: list[Callable[[random.Random], bytes]] = [_valid, _smuggling, _mutated]
    requests = [rng.choice(kinds)(rng) for _ in range(rng.randrange(1, 4))]
    if rng.random() < 0.2:
        requests.append(_garbage(rng))  # pipelined garbage
    data = b"".join(requests)
    if rng.random() < 0.25:
        data = data[:rng.randrange(len(data))]  # stops mid-head or mid-body
    cuts = sorted(rng.sample(range(1, len(data)), max(0, min(len(data) - 1, rng.randrange(3)))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return pieces, rng.choice(["close", "silent", "silent"])


# --- what callers get --------------------------------------------------------------------

_STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [A-Za-z' -]*")


def answers(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Every response in `data`, each whole (AssertionError otherwise)."""
    found = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, "a response cut in its head"
        status_line, *lines = head.split(b"\r\n")
        matched = _STATUS_LINE.fullmatch(status_line)
        assert matched, f"not an HTTP/1.1 status line: {status_line!r}"
        headers = {}
        for line in lines:
            name, colon, value = line.partition(b":")
            assert colon and re.fullmatch(rb"[a-z0-9-]+", name), f"bad header {line!r}"
            headers[name] = value.strip()
        if b"content-length" in headers:
            length = int(headers[b"content-length"])
            assert len(data) >= length, "a response cut in its body"
            body, data = data[:length], data[length:]
        else:
            assert headers.get(b"transfer-encoding") == b"chunked", "no length, not chunked"
            body = b""
            while True:
                size_line, sep, data = data.partition(b"\r\n")
                assert sep and re.fullmatch(rb"[0-9a-f]+", size_line), "a bad chunk"
                size = int(size_line, 16)
                assert data[size:size + 2] == b"\r\n", "a chunk cut short"
                body, data = body + data[:size], data[size + 2:]
                if size == 0:
                    break
        found.append((int(matched[1]), headers, body))
    return found


def check(received: bytes) -> list[int]:
    """The statuses of the answers in `received`, each checked."""
    replies = answers(received)
    for i, (status, headers, body) in enumerate(replies):
        assert status in PROTOCOL_ERRORS | {200, 400, 401}, f"status {status}"
        if headers.get(b"connection") == b"close":
            assert i == len(replies) - 1, "an answer after `connection: close`"
        if status == 400:
            assert (headers[b"connection"], body) == (b"close", b"Invalid HTTP request received.")
        if status in PROTOCOL_ERRORS:
            assert headers[b"content-type"] == b"application/json"
            assert headers[b"connection"] == b"close"
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and error["message"]
    return [status for status, _, _ in replies]


async def exchange(port: int, pieces: list[bytes], then: str,
                   held: list[asyncio.StreamWriter]) -> list[int] | str:
    """The statuses a caller got, or why it read none. A silent caller's end is left open
    (in `held`): the server must close the connection itself."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for piece in pieces:
            writer.write(piece)
            await asyncio.sleep(0.01)
        if then == "close":
            return "closed"  # the server sees the caller go, whatever it was doing
        loop = asyncio.get_running_loop()
        start = loop.time()
        received = b""
        while chunk := await asyncio.wait_for(reader.read(65536), CLOSED_WITHIN_S):
            received += chunk
            assert loop.time() - start < CLOSED_WITHIN_S, "still open"
        held.append(writer)
        return check(received)
    except TimeoutError:
        raise AssertionError(f"still open after {CLOSED_WITHIN_S}s") from None
    except (BrokenPipeError, ConnectionResetError):
        return "reset"  # the server cut a caller that was still sending
    finally:
        if writer not in held:
            writer.close()


# --- the run -----------------------------------------------------------------------------

def serving() -> contextlib.AbstractAsyncContextManager[tuple[uvicorn.Server, int]]:
    return served(app, LIMITS)


@pytest.mark.anyio
async def test_no_request_shape_gets_a_500_leaves_a_connection_open_or_leaks(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(SEED)
    cases = [case(rng) for _ in range(CASES)]
    gc.collect()
    gc.disable()  # what is left must go by reference count, as in production's heap keeper
    try:
        async with serving() as (server, port):
            state = server.server_state
            limit = asyncio.Semaphore(AT_ONCE)
            failures: list[str] = []
            seen: Counter[int | str] = Counter()
            held: list[asyncio.StreamWriter] = []

            async def one(pieces: list[bytes], then: str) -> None:
                async with limit:
                    try:
                        got = await exchange(port, pieces, then, held)
                        seen.update([got] if isinstance(got, str) else got)
                    except AssertionError as exc:
                        failures.append(f"{exc} <- {then} {b''.join(pieces)[:300]!r}")

            with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
                await asyncio.gather(*(one(*c) for c in cases))
            assert failures == [], "\n".join(failures[:10])
            # Each kind of answer came up: the cases reach every path they are meant to.
            assert {200, 401, 400, 408, 431, "closed"} <= seen.keys(), seen
            assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
            # Callers that closed are seen at once; silent ones, still open on their side,
            # are closed by the server when its linger ends.
            for _ in range(int((LINGER_S + 2) / 0.05)):
                if not state.connections and not state.tasks:
                    break
                await asyncio.sleep(0.05)
            assert (state.connections, state.tasks) == (set(), set())
            for writer in held:
                writer.close()
            await asyncio.sleep(0.1)  # closed transports let go of their protocols
            left = [o for o in gc.get_objects() if isinstance(o, ConnectionGuard)]
            assert left == []
    finally:
        gc.enable()
