"""The log writer: batches off the event loop, keeps order, renders mutable arguments at once,
and loses nothing at exit."""

from __future__ import annotations

import atexit
import io
import json
import logging
import sys
import threading
import time

import pytest

from gateway.observe import accesslog
from gateway.observe.accesslog import BatchingHandler
from gateway.observe.record import Record
from gateway.upstream.forward import Relay


def _logger(handler: BatchingHandler) -> logging.Logger:
    handler.start()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger(f"test.accesslog.{id(handler)}")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def test_lines_from_many_threads_arrive_whole_and_in_each_threads_order() -> None:
    out = io.StringIO()
    handler = BatchingHandler(out, interval=0.01)
    log = _logger(handler)

    def write(t: int) -> None:
        for i in range(500):
            log.info(f"t{t} {i}")

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handler.close()  # what logging.config does to every handler: the writer goes on
    log.info("t0 500")
    handler.stop()  # at exit: flushes what is still waiting

    lines = out.getvalue().splitlines()
    assert len(lines) == 2001
    assert [int(x.split()[1]) for x in lines if x.startswith("t0 ")] == list(range(501))
    for t in range(1, 4):
        assert [int(x.split()[1]) for x in lines if x.startswith(f"t{t} ")] == list(range(500))


def test_arguments_are_rendered_when_logged_not_when_written() -> None:
    out = io.StringIO()
    handler = BatchingHandler(out, interval=60)  # the writer would wait a minute
    log = _logger(handler)
    state = {"n": 1}
    log.info("state %s", state)
    state["n"] = 2  # changed before the writer runs: the line keeps what was logged
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    assert out.getvalue() == ""  # nothing written on the caller's thread
    handler.drain()
    text = out.getvalue()
    assert text.startswith("state {'n': 1}\nfailed\nTraceback")
    assert "ValueError: boom" in text
    handler.stop()


class ClosableStream(io.StringIO):
    """While `shut`, writes fail as a closed file's do; opened again, the test can see
    whether the writer still writes (a closed StringIO cannot be read back)."""

    def __init__(self) -> None:
        super().__init__()
        self.shut = False
        self.refused = threading.Event()

    def write(self, s: str) -> int:
        if self.shut:
            self.refused.set()
            raise ValueError("I/O operation on closed file.")
        return super().write(s)


def test_a_closed_stream_does_not_kill_the_writer() -> None:
    out = ClosableStream()
    handler = BatchingHandler(out, interval=0.01)
    log = _logger(handler)
    out.shut = True
    log.info("lost")
    assert out.refused.wait(5)  # the writer thread met the closed stream
    out.shut = False
    log.info("kept")
    # Written by the writer thread, still alive: stop() would drain on this thread instead.
    deadline = time.monotonic() + 5
    while "kept" not in out.getvalue():
        assert time.monotonic() < deadline, "the writer died on the closed stream"
        time.sleep(0.01)
    handler.stop()
    assert out.getvalue() == "kept\n"  # what was logged while it was closed is dropped


def _record(request_id: str) -> Record:
    relay = Relay()
    relay.status, relay.finished, relay.completion_tokens = 200, 2.5, 7
    return Record(request_id, "chat", "m", "default", "anonymous", True, 1.0, 12, relay)


def test_access_lines_skip_logging_where_the_batching_handler_alone_receives_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the server configures it: the line goes into the writer's deque as a string (no
    LogRecord), and is written exactly as logging would have written it."""
    gateway_log = logging.getLogger("gateway")
    monkeypatch.setattr(gateway_log, "handlers", [])
    monkeypatch.setattr(gateway_log, "propagate", True)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setattr(accesslog, "_direct", None)
    monkeypatch.setattr(atexit, "register", lambda f: f)
    level = gateway_log.level
    accesslog.configure_logging("info")
    handler = accesslog._direct
    assert handler is not None
    try:
        accesslog.log_record(_record("gw-direct-1"), client_gone=False)
        accesslog.log_rejection("gw-direct-2", "chat", 400, "bad")
        assert list(map(type, handler._records)) == [str, str]  # no LogRecord made
        # Through logging, for the same record: the text written is the same.
        accesslog.access.info(handler._records[0])
        handler.drain()
        lines = out.getvalue().splitlines()
        assert len(lines) == 3 and lines[0] == lines[2]
        assert json.loads(lines[0])["id"] == "gw-direct-1"
        assert json.loads(lines[1]) == {"event": "request", "id": "gw-direct-2",
                                        "endpoint": "chat", "status": 400, "error": "bad"}

        # Anyone else listening (a test's capture, a second handler): through logging.
        seen: list[logging.LogRecord] = []
        capture = logging.Handler()
        capture.emit = seen.append  # type: ignore[method-assign]
        accesslog.access.addHandler(capture)
        try:
            accesslog.log_record(_record("gw-direct-3"), client_gone=True)
        finally:
            accesslog.access.removeHandler(capture)
        assert [json.loads(r.getMessage())["id"] for r in seen] == ["gw-direct-3"]
        assert json.loads(seen[0].getMessage())["client_disconnected"] is True
        # ... and a level above INFO on the gateway's logger still silences it.
        gateway_log.setLevel(logging.WARNING)
        accesslog.log_record(_record("gw-direct-4"), client_gone=False)
        handler.drain()
        assert "gw-direct-4" not in out.getvalue() and "gw-direct-3" in out.getvalue()
    finally:
        handler.stop()
        gateway_log.setLevel(level)  # setLevel, not an attribute: loggers cache their answer
