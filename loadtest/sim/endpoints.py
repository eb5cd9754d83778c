"""The endpoints beyond chat and completions: their options and their routes.

    POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel   responses.py
    POST /v1/embeddings                                                        embeddings.py
    POST /v1/rerank, POST /v1/score, POST /classify, POST /pooling             pooling.py
    POST /tokenize, POST /detokenize                                           tokenization.py
    POST /v1/messages, POST /v1/messages/count_tokens                          messages.py

Image parts of chat and Responses messages cost `image_tokens` prompt tokens each
(multimodal.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from loadtest.sim.asgi import Handler, Receive, Scope, Send, respond
from loadtest.sim.config import ConfigError
from loadtest.sim.embeddings import Embeddings
from loadtest.sim.messages import Messages
from loadtest.sim.pooling import Pooling
from loadtest.sim.responses import RESPONSES_PREFIX, Responses
from loadtest.sim.tokenization import Tokenization

if TYPE_CHECKING:
    from loadtest.sim.server import SimApp


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


class Endpoints:
    """The handlers of one app's extra endpoints."""

    def __init__(self, app: SimApp) -> None:
        self.responses = Responses(app)
        self.embeddings = Embeddings(app)
        self.tokenization = Tokenization(app)
        self.messages = Messages(app)
        self.pooling = Pooling(app, self.embeddings.measure)
        self.routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/responses"): self.responses.create,
            ("POST", "/v1/embeddings"): self.embeddings.create,
            ("POST", "/v1/rerank"): self.pooling.rerank,
            ("POST", "/v1/score"): self.pooling.score,
            ("POST", "/classify"): self.pooling.classify,
            ("POST", "/pooling"): self.pooling.pooling,
            ("POST", "/tokenize"): self.tokenization.tokenize,
            ("POST", "/v1/messages"): self.messages.create,
            ("POST", "/v1/messages/count_tokens"): self.messages.count_tokens,
            ("POST", "/detokenize"): self.tokenization.detokenize,
        }

    def match(self, method: str, path: str) -> Handler | None:
        """The handler of a path with an id in it (/v1/responses/{id}[/cancel])."""
        if not path.startswith(RESPONSES_PREFIX):
            return None
        rest = path[len(RESPONSES_PREFIX):]
        if rest.endswith("/cancel") and rest.count("/") == 1 and len(rest) > len("/cancel"):
            return self.responses.cancel if method == "POST" else _method_not_allowed
        if rest and "/" not in rest:
            return self.responses.retrieve if method == "GET" else _method_not_allowed
        return None

    def close(self) -> None:
        self.responses.close()


async def _method_not_allowed(scope: Scope, receive: Receive, send: Send) -> None:
    await respond(send, 405, orjson.dumps({"detail": "Method Not Allowed"}))
