"""The log writer: batches off the event loop, keeps order, renders mutable arguments at once,
and loses nothing at exit."""

from __future__ import annotations

import io
import logging
import threading
import time

from gateway.observe.accesslog import BatchingHandler


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
