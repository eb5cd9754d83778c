"""An engine's answer read by whole events: SSE reassembled across reads, usage read from JSON.

A read from an engine's socket ends wherever the network cut it, not where an event ends: one
event can span two reads (a sidecar, TLS, an engine that flushes part of an event), and one
read can hold several events. Everything the relay looks inside (the first token, the usage,
an error event, the usage frame the gateway asked for and the caller did not) is looked for in
whole events only, and a stream goes to the caller as whole events, each the moment its last
byte has come. An event ends at a blank line; engines write `\\n\\n` (vLLM, SGLang,
llama.cpp) or `\\r\\n\\r\\n`. An engine that ends its events otherwise is relayed unchanged
when its stream ends.

Usage is read by parsing the event's (or the non-streamed body's) JSON, compact or not: the
fields are `prompt_tokens`/`completion_tokens` (chat, completions, embeddings) or
`input_tokens`/`output_tokens` (the Responses API, whose usage sits in `response`; Anthropic's
Messages API, in `message_start`'s `message` and in `message_delta`), and the cached prompt
tokens under `*_tokens_details.cached_tokens` (Anthropic's: `cache_read_input_tokens`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

# An event the relay need not parse has none of these, compact or spaced: `"usage": null`
# (OpenAI's chunks carry it when usage is asked for) is not a usage.
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_ERROR = re.compile(rb'\{\s*"error"\s*:')

# An event still incomplete past this is no event an engine writes (a Responses API
# `response.completed` carries the whole output, so it is generous): the stream is broken.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class EventTooLarge(Exception):
    """An engine's event grew past MAX_EVENT_BYTES without ending."""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


class Events:
    """Reassembles one stream's events: `push(read)` returns every event the read completed
    (b"" if none), keeping what follows the last one for the next read."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def push(self, data: bytes) -> bytes:
        if self._tail:
            data = self._tail + data
            self._tail = b""
        if data.endswith(b"\n\n"):  # the common read: one or more whole events
            return data
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        self._tail = data[end:]
        if len(self._tail) > MAX_EVENT_BYTES:
            raise EventTooLarge(f"an event of over {MAX_EVENT_BYTES} bytes without its end")
        return data[:end]

    def rest(self) -> bytes:
        """What came after the last whole event, at the stream's end."""
        tail, self._tail = self._tail, b""
        return tail


# The plain `in` first: it passes over nearly every event of a stream faster than a search.
def has_usage(data: bytes) -> bool:
    return b'"usage"' in data and _USAGE.search(data) is not None


def has_error(data: bytes) -> bool:
    return b'"error"' in data and _ERROR.search(data) is not None


def body_usage(body: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) JSON answer, if it has one."""
    if not has_usage(body):
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return _usage_of(data)


def split_events(data: bytes) -> list[bytes]:
    """Whole events (as `Events.push` returns them) one by one, each with its blank line."""
    out: list[bytes] = []
    start = 0
    while start < len(data):
        lf = data.find(b"\n\n", start)
        crlf = data.find(b"\r\n\r\n", start)
        if lf < 0 and crlf < 0:
            out.append(data[start:])
            break
        if crlf >= 0 and (lf < 0 or crlf < lf):
            end = crlf + 4
        else:
            end = lf + 2
        out.append(data[start:end])
        start = end
    return out


def event_json(event: bytes) -> object:
    """The JSON of an event's data (its `data:` lines joined, as SSE does); None if it has
    none or it is not JSON (`[DONE]`)."""
    lines = [line[5:] for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None


def usage_events(data: bytes, strip: bool) -> tuple[bytes, Usage | None]:
    """Whole events `data` with the usage they report; with `strip`, without the usage-only
    chunk (`"choices": []`) that the gateway asked for and the caller did not."""
    found: Usage | None = None
    kept: list[bytes] = []
    dropped = False
    for event in split_events(data):
        if has_usage(event):
            parsed = event_json(event)
            usage = _usage_of(parsed)
            if usage is not None:
                found = usage
                if strip and isinstance(parsed, dict) and parsed.get("choices") == []:
                    dropped = True
                    continue
        kept.append(event)
    return (b"".join(kept) if dropped else data), found


def _usage_of(data: object) -> Usage | None:
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    if not isinstance(usage, dict):
        # A Responses API event: the response inside it; Anthropic's message_start: the message.
        response = data.get("response") or data.get("message")
        usage = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(usage, dict):
            return None
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        return _anthropic_usage(usage)
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return Usage(_count(usage.get("prompt_tokens", usage.get("input_tokens"))),
                 _count(usage.get("completion_tokens", usage.get("output_tokens"))),
                 _count(details.get("cached_tokens")) if isinstance(details, dict) else None)


def _anthropic_usage(usage: dict[str, object]) -> Usage:
    """Anthropic's usage: `input_tokens` leaves out what was read from or written to the
    prompt cache (vLLM 0.32 reports its prefix-cache hit as cache_read_input_tokens); the
    prompt is all three."""
    parts = [_count(usage.get(k)) for k in ("input_tokens", "cache_read_input_tokens",
                                            "cache_creation_input_tokens")]
    prompt = None if parts[0] is None else sum(p or 0 for p in parts)
    return Usage(prompt, _count(usage.get("output_tokens")), parts[1])


def _count(value: object) -> int | None:
    # bool is an int to Python, never a count
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None
