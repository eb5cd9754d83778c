"""One structured line per request, written off the event loop.

Lines go through a QueueHandler to a listener thread, so a slow terminal or disk never stalls
the streams. Prompt text is never logged; only ids, routing, status, token counts and timings.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import sys

import orjson

from gateway.proxy import Exchange

access = logging.getLogger("gateway.access")


def configure_logging(level: str = "info") -> None:
    """Route all gateway logs through one queue; the listener thread does the writing."""
    q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(logging.Formatter("%(message)s"))
    listener = logging.handlers.QueueListener(q, stream, respect_handler_level=False)
    listener.start()
    atexit.register(listener.stop)
    root = logging.getLogger("gateway")
    root.handlers[:] = [logging.handlers.QueueHandler(q)]
    root.setLevel(level.upper())
    root.propagate = False


def log_exchange(ex: Exchange, client_gone: bool) -> None:
    if not access.isEnabledFor(logging.INFO):
        return
    end = ex.finished if ex.finished is not None else ex.arrival
    line = {
        "event": "request",
        "id": ex.request_id,
        "endpoint": ex.endpoint,
        "model": ex.model,
        "pool": ex.pool,
        "tenant": ex.tenant,
        "backend": ex.backend.name if ex.backend else None,
        "status": ex.status,
        "stream": ex.stream,
        "attempts": ex.attempts,
        "prompt_tokens": ex.prompt_tokens,
        "prompt_tokens_estimated": ex.estimated_prompt_tokens,
        "completion_tokens": ex.completion_tokens,
        "ttft_ms": round((ex.first_byte - ex.arrival) * 1000, 1) if ex.first_byte else None,
        "duration_ms": round((end - ex.arrival) * 1000, 1),
    }
    if client_gone:
        line["client_disconnected"] = True
    if ex.error:
        line["error"] = ex.error
    access.info(orjson.dumps(line).decode())


def log_rejection(request_id: str, endpoint: str, status: int, message: str) -> None:
    """A request refused before it was routed (bad body, unknown model...)."""
    if access.isEnabledFor(logging.INFO):
        access.info(orjson.dumps({"event": "request", "id": request_id, "endpoint": endpoint,
                                  "status": status, "error": message}).decode())
