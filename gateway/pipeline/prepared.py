"""What the stages before admission find of a request (gateway/pipeline/prepare.py runs them)."""

from __future__ import annotations

from typing import Any

from gateway.admission.pool import Ask
from gateway.cost import RequestCost
from gateway.cost.profiles import ModelProfile, get_model
from gateway.pipeline.prompts import Prompt
from gateway.policy import ModelSpec
from gateway.policy.model import TenantSpec
from gateway.records import record
from gateway.routing.affinity import Held
from gateway.routing.router import Route
from gateway.wire.openai import EmbeddingsRequest, Endpoint, ParsedRequest
from gateway.wire.pooling import ClassifyRequest, RerankRequest, ScoreRequest

_FALLBACK_PROFILE = "llama-3-8b"  # models without an architecture: blocks are nominal


@record
class Caller:
    tenant: TenantSpec
    priority: int
    deadline_s: float | None  # the caller's own limit on queueing


@record
class Work:
    """The token and KV work a request brings (not money: gateway/cost/pricing.py is money)."""

    cost: RequestCost
    sequences: int  # prompts x n: the engine runs each as its own sequence

    @property
    def blocks(self) -> int:
        return self.cost.kv_blocks_reserved * self.sequences

    def blocks_at(self, engine_block: int) -> int:
        """`blocks` as an engine of `engine_block`-token blocks allocates them: whole blocks of
        its size, counted in the pool's (a 40-token request holds one 128-token block of a CPU
        vLLM, 8 of the pool's 16, not 3)."""
        cost = self.cost
        if engine_block <= cost.block_size:
            return self.blocks
        tokens = cost.prompt_tokens + cost.expected_output_tokens
        whole = -(-tokens // engine_block) * engine_block
        return -(-whole // cost.block_size) * self.sequences

    @property
    def tokens(self) -> int:
        """Tokens admission expects the request to hold (prompt + the learned output)."""
        return (self.cost.prompt_tokens + self.cost.expected_output_tokens) * self.sequences

    @property
    def quota_tokens(self) -> int:
        """Tokens the tenant's quota reserves: what the request may use (prompt + its
        `max_tokens`, or the pool's default), not what others' traffic suggests, so that a
        burst of parallel requests cannot pass the bucket."""
        return (self.cost.prompt_tokens + self.cost.max_output_tokens) * self.sequences


@record
class Prepared:
    """A request read, counted, routed and estimated: everything admission is asked about."""

    caller: Caller
    endpoint: Endpoint
    model: ModelSpec
    data: dict[str, Any]
    parsed: ParsedRequest
    prompt: Prompt
    route: Route
    work: Work
    held: Held | None = None  # the stored response it continues, and where it lives
    read_at: float = 0.0  # loop time the body was read: the gateway's own work starts here
    session: str | None = None  # for session affinity: the pool's session header, or `user`

    def ask(self, now: float | None = None) -> Ask:
        """What admission is asked; `now` (loop time): the time since the body was read (the
        gateway's reading of it, counting, waiting for the tokenizer) counts as time waited."""
        t = self.caller.tenant
        return Ask(self.route.pool, self.work.blocks_at(self.route.kv_block), self.work.tokens,
                   priority=self.caller.priority, caller=t.name,
                   deadline_s=self.caller.deadline_s, overflow=self.route.overflow,
                   tenant=t.name, tenant_share=t.max_kv_share, tenant_shadow=t.shadow,
                   prompt_tokens=self.prompt.tokens,
                   backend=self.held.backend if self.held else None,
                   waited_s=0.0 if now is None else max(0.0, now - self.read_at),
                   hashes=self.prompt.hashes, hash_block=self.prompt.hash_block,
                   session=self.session)


@record
class Sent:
    """What the pipeline reads of a request once its answer is over (usage, learning, where a
    stored response lives): all a stream keeps of it. The whole `Prepared` (its parsed body,
    messages, cost, prompt hashes) would be walked by every full collection for the stream's
    life, and a long prompt makes it hundreds of kilobytes."""

    endpoint: Endpoint
    model: ModelSpec
    tenant: str
    prompt_tokens: int
    exact: bool  # the prompt counted by the model's tokenizer, not estimated
    chars: int
    store: bool  # the caller did not ask `store: false`: its response id is remembered

    @classmethod
    def of(cls, p: Prepared) -> Sent:
        return cls(p.endpoint, p.model, p.caller.tenant.name, p.prompt.tokens, p.prompt.exact,
                   p.prompt.chars, p.data.get("store") is not False)


def profile_of(model: ModelSpec) -> ModelProfile:
    return model.architecture.resolve() if model.architecture else get_model(_FALLBACK_PROFILE)


def is_embedding(parsed: ParsedRequest) -> bool:
    """Prefill work only (an embedding, a rerank, a score, a classification)."""
    return isinstance(parsed, EmbeddingsRequest | RerankRequest | ScoreRequest | ClassifyRequest)
