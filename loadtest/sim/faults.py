"""Fault injection: which requests fail, drop or stall, which streams reach the wire split or
spaced, and when the server is "down".

Settings come from CLI flags at start and from `POST /admin/faults` at run time (a JSON object
with any of the fields below; unknown fields are a 400). Every fault applies to a share of
requests (`*_rate`, 0-1, drawn from a seeded RNG so runs repeat):

    fail_rate            answer 500 at once, in vLLM's error shape, before any work is done
    drop_rate            close the connection abruptly after `drop_after_tokens` tokens: a stream
    drop_after_tokens    ends without `data: [DONE]`; a non-stream response is cut mid-body
    stall_rate           a stream goes silent for `stall_s` seconds (wall clock) after
    stall_after_tokens   `stall_after_tokens` tokens, then resumes; the engine keeps generating,
    stall_s              as if the network stalled (tokens arrive in one burst afterwards)
    split_rate           a stream's every SSE frame is written in 2-4 parts cut at random bytes,
    split_pause_s        each part flushed on its own, `split_pause_s` apart, so a reader gets
                         them as separate reads (a proxy or sidecar that re-chunks the stream)
    spaced_rate          a stream's JSON is written with spaces (`"usage": {`, json.dumps's
                         default separators) instead of vLLM's compact JSON
    down_for_s           action, not a setting: stop listening for this many seconds (new
                         connections are refused, ECONNREFUSED), then listen again
    down_drop_inflight   with down_for_s: also abort every request in the engine and reset
                         open connections, and forget the prefix cache, as a crashed and
                         restarted engine would (default true)
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class FaultError(ValueError):
    """A bad admin request; the message names the field."""


@dataclass(frozen=True, slots=True)
class FaultSettings:
    fail_rate: float = 0.0
    drop_rate: float = 0.0
    drop_after_tokens: int = 1
    stall_rate: float = 0.0
    stall_after_tokens: int = 1
    stall_s: float = 0.0
    split_rate: float = 0.0
    split_pause_s: float = 0.002
    spaced_rate: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_RATES = ("fail_rate", "drop_rate", "stall_rate", "split_rate", "spaced_rate")
_COUNTS = ("drop_after_tokens", "stall_after_tokens")
_ACTIONS = ("down_for_s", "down_drop_inflight")


@dataclass(frozen=True, slots=True)
class DownAction:
    seconds: float
    drop_inflight: bool


def parse_update(current: FaultSettings, body: object) -> tuple[FaultSettings, DownAction | None]:
    """Apply an admin JSON object to the settings; raises FaultError naming the bad field."""
    if not isinstance(body, dict):
        raise FaultError("body: expected a JSON object")
    known = {f.name for f in fields(FaultSettings)} | set(_ACTIONS)
    unknown = sorted(set(body) - known)
    if unknown:
        raise FaultError(f"{unknown[0]}: unknown field; expected one of {', '.join(sorted(known))}")
    changes: dict[str, Any] = {}
    for name in _RATES:
        if name in body:
            value = body[name]
            if not _is_number(value) or not 0.0 <= float(value) <= 1.0:
                raise FaultError(f"{name}: must be a number from 0 to 1, got {value!r}")
            changes[name] = float(value)
    for name in _COUNTS:
        if name in body:
            value = body[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise FaultError(f"{name}: must be a non-negative integer, got {value!r}")
            changes[name] = value
    if "stall_s" in body:
        value = body["stall_s"]
        if not _is_number(value) or float(value) < 0:
            raise FaultError(f"stall_s: must be a non-negative number, got {value!r}")
        changes["stall_s"] = float(value)
    if "split_pause_s" in body:
        value = body["split_pause_s"]
        if not _is_number(value) or not 0 <= float(value) <= 1:
            raise FaultError(f"split_pause_s: must be a number of seconds in [0, 1], got "
                             f"{value!r}")
        changes["split_pause_s"] = float(value)
    down: DownAction | None = None
    if "down_for_s" in body:
        value = body["down_for_s"]
        if not _is_number(value) or not 0 < float(value) <= 3600:
            raise FaultError(f"down_for_s: must be a number of seconds in (0, 3600], got {value!r}")
        drop = body.get("down_drop_inflight", True)
        if not isinstance(drop, bool):
            raise FaultError(f"down_drop_inflight: must be true or false, got {drop!r}")
        down = DownAction(float(value), drop)
    elif "down_drop_inflight" in body:
        raise FaultError("down_drop_inflight: only meaningful with down_for_s")
    return replace(current, **changes), down


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class RequestFaults:
    """What happens to one request, decided once when it arrives."""

    fail: bool = False
    drop_after: int | None = None
    stall_after: int | None = None
    stall_s: float = 0.0
    split_seed: int | None = None  # where this stream's frames are cut; None: whole frames
    split_pause_s: float = 0.0
    spaced: bool = False


NO_FAULTS = RequestFaults()


class FaultInjector:
    def __init__(self, settings: FaultSettings, seed: int = 0) -> None:
        self.settings = settings
        self._rng = random.Random(seed ^ 0x5EED)

    def draw(self) -> RequestFaults:
        s = self.settings
        if not (s.fail_rate or s.drop_rate or (s.stall_rate and s.stall_s) or s.split_rate
                or s.spaced_rate):
            return NO_FAULTS  # the common case costs one attribute check
        rng = self._rng.random
        # Each draw only when its rate is set: the other faults' draws repeat as before.
        return RequestFaults(
            fail=s.fail_rate > 0 and rng() < s.fail_rate,
            drop_after=s.drop_after_tokens if s.drop_rate > 0 and rng() < s.drop_rate else None,
            stall_after=(s.stall_after_tokens
                         if s.stall_rate > 0 and s.stall_s > 0 and rng() < s.stall_rate else None),
            stall_s=s.stall_s,
            split_seed=(self._rng.getrandbits(32)
                        if s.split_rate > 0 and rng() < s.split_rate else None),
            split_pause_s=s.split_pause_s,
            spaced=s.spaced_rate > 0 and rng() < s.spaced_rate,
        )


class Wire:
    """How one stream's frames reach the socket: whole and compact, or as the split and spaced
    faults write them. `write` takes whole frames (one or more, each ending in a blank line)."""

    __slots__ = ("_faults", "_rng", "_send")

    def __init__(self, send: Send, faults: RequestFaults) -> None:
        self._send = send
        self._faults = faults
        self._rng = random.Random(faults.split_seed) if faults.split_seed is not None else None

    async def write(self, frames: bytes, more: bool) -> None:
        if self._faults.spaced:
            frames = spaced(frames)
        if self._rng is None:
            await self._send({"type": "http.response.body", "body": frames, "more_body": more})
            return
        for frame in whole(frames):
            for part in cut(frame, self._rng):
                await self._send({"type": "http.response.body", "body": part,
                                  "more_body": True})
                # A pause, so the parts leave as separate segments and arrive as separate reads.
                await asyncio.sleep(self._faults.split_pause_s)
        if not more:
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})


def cut(frame: bytes, rng: random.Random) -> list[bytes]:
    """A frame in 2-4 parts cut at random bytes (any byte: inside a JSON string, between the
    two newlines that end the frame)."""
    if len(frame) < 2:
        return [frame]
    at = sorted(rng.sample(range(1, len(frame)), min(len(frame) - 1, rng.randint(1, 3))))
    return [frame[a:b] for a, b in zip([0, *at], [*at, len(frame)], strict=True)]


def spaced(frames: bytes) -> bytes:
    """Each `data: {...}` frame's JSON written as Python's json.dumps writes it by default,
    with a space after every `:` and `,`."""
    out = []
    for frame in whole(frames):
        if frame.startswith(b"data: {") and frame.endswith(b"\n\n"):
            frame = b"data: " + json.dumps(json.loads(frame[6:-2])).encode() + b"\n\n"
        out.append(frame)
    return b"".join(out)


def whole(frames: bytes) -> list[bytes]:
    """The frames of a write, each with the blank line that ends it (the simulator writes
    whole frames only; anything after the last blank line would come last, as it is)."""
    parts = frames.split(b"\n\n")
    out = [p + b"\n\n" for p in parts[:-1]]
    return [*out, parts[-1]] if parts[-1] else out
