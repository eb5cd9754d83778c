"""Request traces: prompt and output lengths (and arrival times) of real traffic.

Two public formats (the repository's traces/README.md has both traces):
  Azure LLM inference CSV   TIMESTAMP,ContextTokens,GeneratedTokens   (wall-clock timestamps)
  Mooncake JSONL            {"timestamp": ms, "input_length", "output_length", "hash_ids"}
Either may be compressed, chosen by suffix: `.xz` (as traces/ ships them) or `.gz`.
Both become `TraceRequest`s with arrival times in seconds from the first request. The capacity
planner samples their lengths; the load tester replays their arrivals. A bad line is an error that
names the file and the line, never a silently skipped request.
"""

from __future__ import annotations

import csv
import gzip
import json
import lzma
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Literal

TraceFormat = Literal["azure", "mooncake"]
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
COMPRESSED = (".xz", ".gz")


class TraceError(ValueError):
    """A trace that cannot be read: the message starts with `file:line:`."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds since the trace's first request
    prompt_tokens: int
    output_tokens: int
    # Mooncake: ids of the prompt's 512-token blocks; equal leading ids mean a shared prefix.
    block_hashes: tuple[int, ...] = ()


def open_trace(path: str | Path) -> IO[str]:
    """The trace file as text, decompressed by its suffix (`.xz`, `.gz`; else plain)."""
    path = Path(path)
    suffix = path.suffix.lower()
    # newline="": the csv module reads the line endings itself; JSON lines do not mind.
    if suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8", newline="")
    if suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open(encoding="utf-8", newline="")


def detect_format(path: Path) -> TraceFormat:
    """By extension (under a compression suffix), else by the first non-blank character (`{`
    is JSON lines)."""
    name = path.name.lower()
    for compressed in COMPRESSED:
        name = name.removesuffix(compressed)
    suffix = Path(name).suffix
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    try:
        with open_trace(path) as f:
            head = f.read(256).lstrip()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return "mooncake" if head.startswith("{") else "azure"


def _count(value: Any, where: str, field: str) -> int:
    # Lengths arrive as JSON numbers or CSV text; 12.0 is accepted, 12.5 and -1 are not.
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TraceError(
            f"{where}: {field} must be a non-negative integer, got {value!r}"
        ) from None
    if number < 0 or number != int(number):
        raise TraceError(f"{where}: {field} must be a non-negative integer, got {value!r}")
    return int(number)


def _iter_azure(path: Path) -> Iterator[TraceRequest]:
    with open_trace(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}:1: empty file; expected header {','.join(AZURE_COLUMNS)}")
        names = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in names]
        if missing:
            raise TraceError(
                f"{path}:1: missing column(s) {', '.join(missing)}; "
                f"expected header {','.join(AZURE_COLUMNS)}"
            )
        i_ts, i_in, i_out = (names.index(c) for c in AZURE_COLUMNS)
        first: datetime | None = None
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(names):
                raise TraceError(f"{where}: expected {len(names)} fields, got {len(row)}")
            try:
                stamp = datetime.fromisoformat(row[i_ts].strip())
            except ValueError:
                raise TraceError(f"{where}: TIMESTAMP is not a date-time: {row[i_ts]!r}") from None
            first = first or stamp
            yield TraceRequest(
                arrival_s=(stamp - first).total_seconds(),
                prompt_tokens=_count(row[i_in], where, "ContextTokens"),
                output_tokens=_count(row[i_out], where, "GeneratedTokens"),
            )


def _iter_mooncake(path: Path) -> Iterator[TraceRequest]:
    first: float | None = None
    with open_trace(path) as f:
        for number, line in enumerate(f, start=1):
            where = f"{path}:{number}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in obj:
                    raise TraceError(f"{where}: missing field {key!r}")
            stamp = obj["timestamp"]
            if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
                raise TraceError(f"{where}: timestamp must be a number (ms), got {stamp!r}")
            first = stamp if first is None else first
            hashes = obj.get("hash_ids", [])
            if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            yield TraceRequest(
                arrival_s=(stamp - first) / 1000.0,
                prompt_tokens=_count(obj["input_length"], where, "input_length"),
                output_tokens=_count(obj["output_length"], where, "output_length"),
                block_hashes=tuple(hashes),
            )


def iter_trace(path: str | Path, fmt: TraceFormat | None = None) -> Iterator[TraceRequest]:
    """Requests of a trace file in order, read lazily."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    try:
        kind = fmt or detect_format(path)
        yield from (_iter_mooncake(path) if kind == "mooncake" else _iter_azure(path))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except (EOFError, lzma.LZMAError, zlib.error, gzip.BadGzipFile) as exc:
        raise TraceError(f"{path}: cannot decompress: {exc}") from None


def read_trace(path: str | Path, fmt: TraceFormat | None = None) -> list[TraceRequest]:
    """All requests of a trace file; raises TraceError naming the file and line of a bad one."""
    requests = list(iter_trace(path, fmt))
    if not requests:
        raise TraceError(f"{path}: trace has no requests")
    return requests
