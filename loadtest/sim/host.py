"""What the endpoint handlers (endpoints.py and the modules it names) use of the app they serve
in: `Host`, which server.py's `SimApp` keeps, and their options (`EndpointOptions`).

A handler is handed its host, so the handlers know the app only by this protocol, and server.py,
which builds the handlers, imports them without a circle back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.tokens import TokenCounter, Tokenizer
from loadtest.sim.config import ConfigError, EngineSpec
from loadtest.sim.faults import FaultInjector
from loadtest.sim.protocol import ParsedRequest
from loadtest.sim.scheduler import SimRequest


@dataclass(frozen=True, slots=True)
class EndpointOptions:
    # Prompt tokens an image costs: 576 is LLaVA-1.5's 24 x 24 patches of a 336 px image.
    image_tokens: int = 576
    # Dimension of the pseudo-embeddings /v1/embeddings answers with.
    embedding_dim: int = 32
    # Stored responses (store: true): the most recent this many, each for this long after its
    # last update, and at most this many bytes of conversation in all.
    responses_store_max: int = 10_000
    responses_store_ttl_s: float = 3600.0
    responses_store_max_bytes: int = 256 * 2**20
    # usage.prompt_tokens_details.cached_tokens, as vLLM's --enable-prompt-tokens-details
    # (off by default in vLLM; on here, where tests compare it with the gateway's prediction).
    enable_prompt_tokens_details: bool = True

    def check(self) -> None:
        if self.image_tokens < 0:
            raise ConfigError(f"--image-tokens: must be 0 or more, got {self.image_tokens}")
        if self.embedding_dim <= 0:
            raise ConfigError(f"--embedding-dim: must be a positive integer, "
                              f"got {self.embedding_dim}")
        if self.responses_store_max < 0:
            raise ConfigError(f"--responses-store-max: must be 0 or more, "
                              f"got {self.responses_store_max}")
        if not self.responses_store_ttl_s > 0:
            raise ConfigError(f"--responses-store-ttl-s: must be positive, "
                              f"got {self.responses_store_ttl_s}")


class Host(Protocol):
    """One simulated engine replica, as its endpoint handlers see it."""

    @property
    def spec(self) -> EngineSpec: ...

    @property
    def options(self) -> EndpointOptions: ...

    @property
    def faults(self) -> FaultInjector: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def counter(self) -> TokenCounter | None: ...  # set by startup()

    async def enter(self, arrival: float, request_id: str, prompt_tokens: int,
                    hashes: list[int], max_tokens: int, min_tokens: int, ignore_eos: bool,
                    on_progress: Callable[[SimRequest], None],
                    prompt_ids: Sequence[int] = ()) -> SimRequest:
        """A measured request into the engine's waiting queue."""
        ...

    def release(self, request: SimRequest) -> None:
        """Out of the engine if it is still in."""
        ...

    async def measure(self, parsed: ParsedRequest) -> tuple[int, list[int], Sequence[int]]:
        """Prompt tokens, block hashes and, where known, the prompt's token ids."""
        ...

    def cached_tokens(self, request: SimRequest) -> int:
        """usage.prompt_tokens_details.cached_tokens of a request."""
        ...
