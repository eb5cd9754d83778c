"""The endpoints beyond chat and completions: their options and their routes.

    POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel   responses.py
    POST /v1/embeddings                                                        embeddings.py
    POST /v1/rerank, POST /v1/score, POST /classify, POST /pooling             pooling.py
    POST /tokenize, POST /detokenize                                           tokenization.py
    POST /v1/messages, POST /v1/messages/count_tokens                          messages.py

Image parts of chat and Responses messages cost `image_tokens` prompt tokens each
(multimodal.py). The handlers are handed their app as a `Host` (host.py, with their options).
"""

from __future__ import annotations

import orjson

from loadtest.sim.asgi import Handler, Receive, Scope, Send, respond
from loadtest.sim.embeddings import Embeddings
from loadtest.sim.host import Host
from loadtest.sim.messages import Messages
from loadtest.sim.pooling import Pooling
from loadtest.sim.responses import RESPONSES_PREFIX, Responses
from loadtest.sim.tokenization import Tokenization


class Endpoints:
    """The handlers of one app's extra endpoints."""

    def __init__(self, app: Host) -> None:
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
