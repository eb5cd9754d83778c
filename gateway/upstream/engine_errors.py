"""An engine's error answers in OpenAI's shape: its error bodies and mid-stream error events.

Engines answer errors in their own shapes (vLLM's and SGLang's `{"error": {...}}`, FastAPI's
`{"detail": ...}`, plain text, mid-stream error events); callers get OpenAI's.
"""

from __future__ import annotations

import orjson

from gateway.upstream.sse import has_error, split_events
from gateway.wire.openai import error_body, error_type, retry_headers


def engine_error(status: int, body: bytes, backend: str) -> bytes:
    """An engine's non-2xx body as OpenAI's error body. vLLM and SGLang answer
    `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}` (older releases:
    the same fields at the top level, with "object": "error"); their FastAPI routes answer
    `{"detail": ...}`; anything else is text. The message and param are kept."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict):
            return openai_error(inner, status)
        if isinstance(data.get("message"), str):
            return openai_error(data, status)
        detail = inner if isinstance(inner, str) else data.get("detail")
        if detail is not None:
            text = detail if isinstance(detail, str) else orjson.dumps(detail).decode()
            return error_body(text[:1000], error_type(status))
    text = body[:1000].decode("utf-8", "replace").strip()
    return error_body(text or f"The engine `{backend}` answered HTTP {status}.",
                      error_type(status))


def openai_error(err: dict[str, object], status: int) -> bytes:
    message = err.get("message")
    param = err.get("param")
    code = err.get("code")  # vLLM's is the HTTP status, an integer: not OpenAI's kind of code
    return error_body(message if isinstance(message, str) else "The engine refused the request.",
                      error_type(status), param if isinstance(param, str) else None,
                      code if isinstance(code, str) else None)


# An engine's 503 says no wait of its own (vLLM's queue valves never do): every backend of the
# pool was busy, and a running engine's queue moves within about a second.
ENGINE_BUSY_RETRY_S = 1.0


def engine_error_headers(status: int, headers: dict[str, str]) -> None:
    """The body is re-rendered JSON; an engine's 429/503 with a Retry-After in seconds gets
    retry-after-ms and x-should-retry beside it, as the gateway's own refusals do, and a 503
    without one the gateway's (`ENGINE_BUSY_RETRY_S`)."""
    headers["content-type"] = "application/json"
    if status == 503 and "retry-after" not in headers:
        headers.update((k.decode(), v.decode()) for k, v in retry_headers(ENGINE_BUSY_RETRY_S))
        return
    if status not in (429, 503) or "retry-after" not in headers:
        return
    try:
        seconds = float(headers["retry-after"])
    except ValueError:
        return  # an HTTP date: passed on as it is
    # Whatever number the engine said (infinite, negative, not one): the gateway's headers
    # for it, within their ceiling (gateway/wire/openai.py RETRY_AFTER_MAX_S).
    headers.update((k.decode(), v.decode()) for k, v in retry_headers(seconds))


def openai_error_events(chunk: bytes) -> bytes:
    """Error events in whole events of a stream (vLLM: `data: {"error": {..., "code": 400}}`)
    in OpenAI's shape; every other event untouched. A mid-stream error's status is the
    engine's integer code where it gives one."""
    events = split_events(chunk)
    changed = False
    for i, event in enumerate(events):
        if not has_error(event):
            continue
        lines = event.split(b"\n")
        for j, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                data = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            err = data.get("error") if isinstance(data, dict) else None
            if isinstance(err, dict):
                code = err.get("code")
                status = code if isinstance(code, int) and 400 <= code <= 599 else 500
                lines[j] = b"data: " + openai_error(err, status)
                changed = True
        events[i] = b"\n".join(lines)
    return b"".join(events) if changed else chunk


def error_message(body: bytes) -> str:
    try:
        data = orjson.loads(body)
        msg = data.get("error", {}).get("message") if isinstance(data, dict) else None
        if isinstance(msg, str):
            return msg[:500]
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return body[:200].decode("utf-8", "replace") or "(empty body)"
