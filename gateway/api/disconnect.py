"""The disconnect notice: how a server tells the transport at once that a caller has gone.

ASGI tells an app of a disconnect only through `receive()`, which a streaming app stops
calling once the body is read. A server may put a notice in the scope under DISCONNECT_KEY
(the gateway's own does: gateway/serving/http_protocol.py) that calls a listener the moment the
connection is lost; without one, the transport watches `receive()` instead
(gateway/api/openai.py).
"""

from __future__ import annotations

from typing import Protocol

# A key of the scope's own rather than one of ASGI's `extensions` dict: one dict fewer per
# request.
DISCONNECT_KEY = "gateway.disconnect"


class Listener(Protocol):
    def lost(self) -> None:
        """The caller's connection was lost before its response was complete."""


class DisconnectNotice(Protocol):
    def watch(self, listener: Listener | None) -> None:
        """Call `listener.lost()` on a disconnect from now on (None: no more)."""
