"""What the transport hands the pipeline (gateway/pipeline/): the request as it arrived
(`Inbound`) and the caller (`Client`: read the body, answer an error, whether it has gone).
Nothing here speaks ASGI; gateway/api/openai.py is the one transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.errors import GatewayError
from gateway.records import record
from gateway.upstream.forward import Send
from gateway.wire.openai import Endpoint

Headers = Mapping[bytes, bytes]


class Client(Protocol):
    """The caller, as the transport presents it to the pipeline."""

    send: Send  # where the forwarder writes the engine's answer

    @property
    def gone(self) -> bool:
        """The caller disconnected."""

    async def read_body(self, limit: int, timeout_s: float) -> bytes:
        """The whole body; BodyTooLarge, RequestTimeout or ClientGone otherwise."""

    async def reply_error(self, err: GatewayError, response_started: bool) -> int:
        """Answer with `err` unless the answer has started or the caller has gone; return
        its HTTP status either way."""

    def watch(self) -> None:
        """From here on (the body is read) a disconnect cancels the request's task."""

    def linger(self, seconds: float) -> None:
        """From here on a disconnect does not cut the request at once, but `seconds` later."""

    def detach(self) -> None:
        """Stop listening for a disconnect: from here on only the release is left to do."""


@record
class Inbound:
    """What arrived, before anything is read: the request line and the headers we read."""

    endpoint: Endpoint | None  # None: told by the body (`/gateway/estimate`)
    request_id: str
    arrival: float  # loop time
    started: float  # STAGE_CLOCK's time, beside it
    headers: Headers
