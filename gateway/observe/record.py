"""What is known of a request once it has been forwarded: what observation reads at its end."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.upstream.forward import Relay
from gateway.wire.openai import PREFILL_ENDPOINTS


@dataclass(slots=True)
class Record:
    """The request as the pipeline sent it, and what the engine did with it (`relay`)."""

    request_id: str
    endpoint: str
    model: str
    pool: str
    tenant: str
    stream: bool
    arrival: float  # loop time
    estimated_prompt_tokens: int  # the gateway's own count
    relay: Relay
    status: int = 0  # the answer's HTTP status; 0 until the pipeline knows it
    error: str = ""  # why it failed, when the pipeline refused or failed it


def usage_of(endpoint: str, stream: bool, estimated_prompt: int,
             relay: Relay | None) -> tuple[int, int, int] | None:
    """(prompt, cached, output) tokens the engine spent; None when it never took the request.

    The engine's `usage` when it sent one (the gateway asks every stream for it); for a
    stream cut short, the prompt as counted here and one output token per streamed event
    (after the role event that opens a chat stream; a Responses stream counts its deltas).
    """
    if relay is None or not relay.response_started or relay.status not in (200, 499, 502):
        return None
    if relay.prompt_tokens is not None and relay.completion_tokens is not None:
        return relay.prompt_tokens, relay.cached_tokens or 0, relay.completion_tokens
    if relay.prompt_tokens is not None and endpoint in PREFILL_ENDPOINTS:
        return relay.prompt_tokens, relay.cached_tokens or 0, 0  # its usage has no output
    if not stream or relay.first_byte is None:
        return None
    opening = 1 if endpoint == "chat" else 0
    return estimated_prompt, 0, max(0, relay.sse_events - opening)


def tokens_used(record: Record | None) -> int | None:
    if record is None:
        return None
    used = usage_of(record.endpoint, record.stream, record.estimated_prompt_tokens,
                    record.relay)
    return None if used is None else used[0] + used[2]


def charge_of(record: Record | None, taken: int, gone: bool) -> int | None:
    """Tokens to charge the tenant: the engine's usage; everything reserved (`taken`) when the
    engine took the request but no usage could be read (a non-streaming answer cut after its
    caller left); nothing (None: a full refund) when no engine took it."""
    used = tokens_used(record)
    if used is None and gone and record is not None and not record.stream \
            and record.relay.attempts and record.relay.status in (0, 200):
        return taken
    return used
