"""Which backend holds a stored Responses API response, so that the calls that name it reach it.

An engine keeps the responses it stored in its own memory (vLLM: `store: true`), so
`GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and a new response that continues
it (`previous_response_id`) must go to the backend that created it. The gateway remembers
which, with the tokens its conversation has reached (the next turn's engine prepends them), for
`upstream.responses_ttl_s`, in the state backend: with Redis, every replica knows.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.observe.metrics import GatewayMetrics
from gateway.state import StateBackend, StateError


@dataclass(frozen=True, slots=True)
class Held:
    pool: str
    backend: str
    tokens: int  # the conversation so far: its input and output


class Affinity:
    def __init__(self, state: StateBackend, ttl_s: float, metrics: GatewayMetrics) -> None:
        self.state = state
        self.ttl_s = ttl_s
        self.metrics = metrics

    async def recall(self, response_id: str) -> Held | None:
        try:
            raw = await self.state.recall(_key(response_id))
        except StateError:
            self.metrics.state_errors.labels("remember").inc()
            return None
        if raw is None:
            return None
        pool, backend, tokens = raw.split("\t")
        return Held(pool, backend, int(tokens))

    async def remember(self, response_id: str, held: Held) -> None:
        try:
            await self.state.remember(_key(response_id),
                                      f"{held.pool}\t{held.backend}\t{held.tokens}", self.ttl_s)
        except StateError:  # the follow-up calls then reach any backend, which may not know it
            self.metrics.state_errors.labels("remember").inc()


def _key(response_id: str) -> str:
    return f"response:{response_id}"
