"""One structured line per request, written off the event loop.

Records wait in a deque (an append is atomic under the GIL: no lock, no wake-up) and one
writer thread drains it every FLUSH_S, all waiting lines in one write. A slow terminal or disk
never stalls the streams, and the loop pays no thread hand-off per request: with a queue and
a listener thread, every record woke the listener, a GIL hand-off taken from the event loop
(py-spy, 100 streams: 12% of the gateway's samples sat in the access log, most in
`QueueHandler.enqueue`). Prompt text is never logged; only ids, routing, status, token counts
and timings.

An access line is a ready-made string, so where that handler alone would receive it (the
server's own configuration) it goes into the deque as it is: a `logging` call builds a
LogRecord (the time, the thread, the process, the caller's frame) and walks the handlers,
17 us a line here against 0.1 us for the append, on every request. Any other configuration (a
test's capture, a filter, another handler) gets the line through `logging` as before.
"""

from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
from typing import TextIO

import orjson

from gateway.observe.record import Record
from gateway.tokens.threads import below_the_loop

access = logging.getLogger("gateway.access")

FLUSH_S = 0.05  # how late a line may reach the log; 20 writes a second at most


class BatchingHandler(logging.Handler):
    """Collects records on any thread; one writer thread formats and writes them in batches.

    The thread is started and stopped apart from the handler's `close()`, as QueueListener's
    is: uvicorn applies its logging config at start-up, and `logging.config.dictConfig` closes
    every handler it finds, ours included."""

    def __init__(self, stream: TextIO, interval: float = FLUSH_S) -> None:
        super().__init__()
        # Records, or access lines already rendered (`write_line`).
        self._records: collections.deque[logging.LogRecord | str] = collections.deque()
        self._stream = stream
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-log-writer",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write what is waiting and end the thread (at exit)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.drain()

    def emit(self, record: logging.LogRecord) -> None:
        if record.args or record.exc_info:
            # Render now what could change or die before the writer runs (QueueHandler's
            # prepare does the same); access lines are ready-made strings and skip this.
            try:
                record.msg = self.format(record)
            except Exception:
                self.handleError(record)
                return
            record.args, record.exc_info, record.exc_text = None, None, None
        self._records.append(record)

    def write_line(self, line: str) -> None:
        """Queue a line as it is, with no record: what `emit` would queue for a message
        logged at INFO with no arguments, under a "%(message)s" format."""
        self._records.append(line)

    def _run(self) -> None:
        below_the_loop()  # never ahead of the loop, in a process run at a real-time priority
        while not self._stop.wait(self._interval):
            self.drain()
        self.drain()

    def drain(self) -> None:
        """Write every waiting record now (the writer thread calls it; so may a test)."""
        records, lines = self._records, []
        while records:
            record = records.popleft()
            if isinstance(record, str):
                lines.append(record)
                continue
            try:
                lines.append(self.format(record))
            except Exception:
                self.handleError(record)
        if not lines:
            return
        try:
            self._stream.write("\n".join(lines) + "\n")
            self._stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: losing lines beats dying
            pass


_MESSAGE_ONLY = logging.Formatter("%(message)s")
_direct: BatchingHandler | None = None  # the handler configure_logging installed


def configure_logging(level: str = "info") -> None:
    """Route all gateway logs through one batching handler; its thread does the writing."""
    global _direct
    handler = BatchingHandler(sys.stderr)
    handler.setFormatter(_MESSAGE_ONLY)
    handler.start()
    atexit.register(handler.stop)
    root = logging.getLogger("gateway")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    _direct = handler


def _sink() -> BatchingHandler | None:
    """The installed batching handler where an access line logged at INFO would reach it
    alone, unfiltered and rendered as its message; None otherwise."""
    handler = _direct
    if handler is None or access.handlers or access.filters or not access.propagate:
        return None
    parent = access.parent
    if parent is None or parent.filters or len(parent.handlers) != 1 \
            or parent.handlers[0] is not handler or parent.propagate:
        return None
    if handler.filters or handler.formatter is not _MESSAGE_ONLY or handler.level > logging.INFO:
        return None
    return handler


def _write(line: str) -> None:
    sink = _sink()
    if sink is not None:
        sink.write_line(line)
    else:
        access.info(line)


def log_record(rec: Record, client_gone: bool) -> None:
    if not access.isEnabledFor(logging.INFO):
        return
    ex = rec.relay
    end = ex.finished if ex.finished is not None else rec.arrival
    line = {
        "event": "request",
        "id": rec.request_id,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "pool": rec.pool,
        "tenant": rec.tenant,
        "backend": ex.backend.name if ex.backend else None,
        "status": rec.status,
        "stream": rec.stream,
        "attempts": ex.attempts,
        "prompt_tokens": ex.prompt_tokens,
        "prompt_tokens_estimated": rec.estimated_prompt_tokens,
        "completion_tokens": ex.completion_tokens,
        "ttft_ms": round((ex.first_byte - rec.arrival) * 1000, 1) if ex.first_byte else None,
        "duration_ms": round((end - rec.arrival) * 1000, 1),
    }
    if client_gone:
        line["client_disconnected"] = True
    error = rec.error or ex.error
    if error:
        line["error"] = error
    _write(orjson.dumps(line).decode())


def log_rejection(request_id: str, endpoint: str, status: int, message: str) -> None:
    """A request refused before it was routed (bad body, unknown model...)."""
    if access.isEnabledFor(logging.INFO):
        _write(orjson.dumps({"event": "request", "id": request_id, "endpoint": endpoint,
                             "status": status, "error": message}).decode())
