"""What an engine did, as the gateway's own exceptions: one tree for both clients.

The clients behind the seam (gateway/upstream/native.py, gateway/upstream/aio.py) raise these
and nothing else for what an engine or the network did; aiohttp's exceptions are mapped once,
where aiohttp is called, mid-stream too. The forwarder decides from the class alone whether
another backend may take the request (`retry_elsewhere`: the engine cannot have started on it)
and what the caller is told (`public`: words that name no address and carry no exception
text; the details go to the log and /admin/state):

    EngineFailure                    kind (gateway_upstream_errors_total)
      +-- Unreachable                connect     refused or unreachable; nothing was sent
      |     |                                    (retry elsewhere)
      |     +-- ConnectTimeout       timeout     no connection in time (retry elsewhere)
      +-- ClosedBeforeAnswer         connect     a kept-alive connection the engine had closed;
      |                                          the request never reached it (retry elsewhere)
      +-- BrokeOff                   disconnect  reset or closed after the request went out:
      |                                          the engine may have started on it
      +-- Silent                     timeout     no answer, or no next read, within the read
      |                                          timeout (a 504 before the answer's head)
      +-- CutBody                    disconnect  the answer ended before its end
      +-- Malformed                  protocol    not an answer the gateway reads: a bad head,
                                                 past the head limits, bytes past its end
"""

from __future__ import annotations


class EngineFailure(Exception):
    """Something an engine, or the network to it, did to a request."""

    kind = "disconnect"
    retry_elsewhere = False
    default_public = "connection error"

    def __init__(self, detail: str, public: str | None = None) -> None:
        super().__init__(detail)
        self.public = public or self.default_public


class Unreachable(EngineFailure):
    kind = "connect"
    retry_elsewhere = True
    default_public = "connection refused or unreachable"


class ConnectTimeout(Unreachable):
    kind = "timeout"
    default_public = "connect timeout"


class ClosedBeforeAnswer(EngineFailure):
    kind = "connect"
    retry_elsewhere = True
    default_public = "the engine closed the connection"


class BrokeOff(EngineFailure):
    default_public = "connection error"


class Silent(EngineFailure):
    kind = "timeout"
    default_public = "timed out"


class CutBody(EngineFailure):
    default_public = "the answer was cut off"


class Malformed(EngineFailure):
    kind = "protocol"
    default_public = "a malformed answer"


def describe(exc: BaseException) -> str:
    """The details for the log: the class and what it says."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
