"""What is known of a request once it has been forwarded: what observation reads at its end."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.proxy import Relay


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
