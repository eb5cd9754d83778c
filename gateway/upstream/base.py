"""The seam to the engines: what a client to an engine does, whichever library it stands on.

Two implementations: the gateway's own HTTP/1.1 client for plain `http://` engines
(gateway/upstream/native.py) and aiohttp's for the rest (gateway/upstream/aio.py: https, or a
URL with credentials in it). Both raise the gateway's own exceptions for what an engine did
(gateway/upstream/errors.py) and nothing of their library's, so the forwarder
(gateway/upstream/forward.py) handles one tree.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Protocol

from gateway.upstream.errors import EngineFailure


class Answer(Protocol):
    """An engine's answer, its head in, its body to read."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Looked up by lower-case name."""
        ...

    def readany(self) -> Awaitable[bytes]:
        """What of the body has come since the last read, once something has; b"" at its end.
        Raises EngineFailure."""
        ...

    async def read(self) -> bytes:
        """The whole body, then `release`. Raises EngineFailure."""
        ...

    def release(self) -> None:
        """Done with it: its connection is kept for the next request if the body was read to
        its end, and closed otherwise."""
        ...

    def close(self) -> None:
        """Done with it, and its connection closed whatever was read."""
        ...

    def stop_read_timeout(self) -> bool:
        """Stop the client's own read timeout for the rest of this body, if it can: True when
        it did, and the caller watches the engine's silence itself (`fail` ends a read)."""
        ...

    def fail(self, exc: EngineFailure) -> None:
        """End the body's pending and later reads with `exc`."""
        ...


class Client(Protocol):
    async def post(self, url: str, request_id: str, body: bytes, auth_header: str | None,
                   connect_timeout_s: float, read_timeout_s: float) -> Answer:
        """POST a JSON `body` to `url`: the answer once its head is in. Raises EngineFailure;
        `read_timeout_s` bounds each wait on the engine, its head's included."""
        ...
