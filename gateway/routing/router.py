"""Request -> pool -> backend: every choice of where a request goes. Plain code; no HTTP.

A pool takes the models it lists and the prompt lengths in its range (`prompt_tokens_min` to
`prompt_tokens_max`), so long-context requests go to a dedicated pool and never stall chat
decode. Among the pools that fit, the first with a healthy backend wins. When a pool has no
healthy backend and names an `overflow_to` pool, its requests go there under that pool's cap
on concurrent overflowed requests; otherwise they are refused with 503.

Within a pool, the backend is chosen by one of three orders, all here: admission places a
reservation on the backend with the most KV headroom (`most_headroom_first`), or, where the
pool routes by prefix and some backend holds part of the prompt (or the session's hash names
one), by `prefix_order`; where nothing is reserved (admission off, the static rule, a retry
after a connect failure) the backend with the fewest requests in flight from this gateway wins
(`least_outstanding`).

`prefix_order` ranks each backend by what taking the request would cost it, in tokens: the
prefill work ahead of the request's first token there (its prefill backlog plus the part of
the prompt it does not hold in its prefix cache) plus a share (`inflight_weight`) of the tokens
in flight there. That is the work a router can see: a backend holding a conversation's history
prefills only the new turn, so it wins until its queue and its decoding load outweigh what it
saves, and then the next turn goes to another backend, which caches the history from then on. A
hot prefix spreads the same way, as it loads the backend holding it (Dynamo's KV router adds
the blocks a worker would prefill, x kv-overlap-score-weight, 1 by default, to the blocks it
holds decoding; llm-d adds a prefix and a load scorer). A hard bound on the imbalance stays
beside it, as SGLang's cache-aware router and consistent hashing with bounded loads keep one:
a backend that would hold more than (1 + epsilon) x the mean in-flight tokens after taking the
request (and more than the mean + a slack) is only tried after every backend within the bound,
unless it is the least loaded itself.

A request no pool can hold (prompt + max output over every pool's `max_model_len`) is refused
with 400 `context_length_exceeded` before any backend sees it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from gateway.errors import InvalidRequest, ModelNotFound, NoBackendAvailable
from gateway.policy import ModelSpec, Policy
from gateway.records import record
from gateway.routing.backends import Backend, Backends
from gateway.signals.blocks import EngineBlocks


class _Loaded(Protocol):
    @property
    def outstanding(self) -> int: ...


class _Roomy(Protocol):
    @property
    def headroom(self) -> int: ...


class _Scored(Protocol):
    """What `prefix_order` reads of a backend (admission's BackendView)."""

    @property
    def headroom(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def inflight_tokens(self) -> int: ...
    @property
    def prefill_tokens(self) -> int: ...
    @property
    def affinity(self) -> bool: ...


L = TypeVar("L", bound=_Loaded)
R = TypeVar("R", bound=_Roomy)
S = TypeVar("S", bound=_Scored)


@dataclass(frozen=True, slots=True)
class PrefixRule:
    """A pool's `routing.prefix` weight and bound, as the decision reads them."""

    inflight_weight: float = 0.25
    epsilon: float = 1.0
    slack_tokens: int = 32768
    act: bool = True  # False in shadow mode: evaluated and counted, never placed by


def least_outstanding(candidates: Iterable[L]) -> L | None:
    """The candidate with the fewest requests in flight (the first of equals).

    Least-outstanding beats round robin for LLM traffic: requests differ in length by orders
    of magnitude, so equal counts of requests are far from equal load.
    """
    return min(candidates, key=lambda c: c.outstanding, default=None)


def most_headroom_first(candidates: Sequence[R]) -> list[R]:
    """Candidates by KV headroom, most first (equals keep their policy order)."""
    return sorted(candidates, key=lambda c: c.headroom, reverse=True)


def prefix_order(candidates: Sequence[S], rule: PrefixRule, ask_tokens: int,
                 prompt_tokens: int) -> list[S]:
    """Candidates within the imbalance bound by prefix cost, least first (equals by headroom),
    then the rest by headroom.

    Where no candidate holds any of the prompt and none is the session's, this is exactly
    `most_headroom_first`: a prompt that never repeats is placed as it always was.
    """
    if not any(c.cached_tokens > 0 or c.affinity for c in candidates):
        return most_headroom_first(candidates)
    loads = [c.inflight_tokens for c in candidates]
    mean = (sum(loads) + ask_tokens) / len(candidates)
    bound = max((1.0 + rule.epsilon) * mean, mean + rule.slack_tokens)
    low = min(loads)
    costs = dict(zip(map(id, candidates), prefix_costs(candidates, rule, prompt_tokens),
                     strict=True))
    within = [c for c in candidates if c.inflight_tokens + ask_tokens <= bound
              or c.inflight_tokens == low]
    kept = set(map(id, within))  # by identity: a dataclass's == compares every field
    over = [c for c in candidates if id(c) not in kept]
    return (sorted(within, key=lambda c: (costs[id(c)], -c.headroom))
            + most_headroom_first(over))


def prefix_costs(candidates: Sequence[S], rule: PrefixRule, prompt_tokens: int) -> list[float]:
    """Each candidate's cost of taking the request, in tokens: its prefill backlog plus the
    part of the prompt not cached there (the session's backend counts as holding it all),
    plus inflight_weight x the tokens in flight there."""
    out = []
    for c in candidates:
        uncached = 0 if c.affinity else max(0, prompt_tokens - c.cached_tokens)
        out.append(c.prefill_tokens + uncached + rule.inflight_weight * c.inflight_tokens)
    return out


@record
class Route:
    model: ModelSpec
    pool: str
    overflow: bool = False  # sent here because its own (long-context) pool is down
    # The largest KV block (tokens) the pool's engines reported, which they allocate whole to
    # each request (gateway/signals/blocks.py); 0 until one has been scraped.
    kv_block: int = 0


class Router:
    def __init__(self, policy: Policy, backends: Backends,
                 blocks: EngineBlocks | None = None) -> None:
        self.policy = policy
        self.backends = backends
        # The engines' block sizes, read by the scrapes (gateway/signals/blocks.py).
        self._engine_blocks = (blocks or EngineBlocks()).pools
        self._models = {m.name: m for m in policy.models}
        self._pools_for = {m.name: policy.pools_for(m.name) for m in policy.models}

    def model(self, name: str) -> ModelSpec:
        spec = self._models.get(name)
        if spec is None:
            raise ModelNotFound(
                f"The model `{name}` does not exist. Models served here: "
                f"{', '.join(self._models)}.", param="model")
        return spec

    def route(self, model: ModelSpec, prompt_tokens: int = 0,
              max_tokens: int | None = None) -> Route:
        pools = self._pools_for[model.name]
        need = prompt_tokens + (max_tokens if max_tokens is not None else 1)
        fits = [p for p in pools if need <= self.policy.pools[p].max_model_len]
        if not fits:
            longest = max(self.policy.pools[p].max_model_len for p in pools)
            asked = (f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                     f"{max_tokens} in the completion)" if max_tokens is not None
                     else f"{prompt_tokens} tokens in the messages")
            raise InvalidRequest(
                f"This model's maximum context length is {longest} tokens. However, you "
                f"requested {asked}. Please reduce the length of the messages or completion.",
                param="messages", code="context_length_exceeded")
        in_range = [p for p in fits if self._in_range(p, prompt_tokens)] or fits
        for pool in in_range:
            if self.backends.healthy(pool):
                return Route(model, pool, kv_block=self._engine_blocks.get(pool, 0))
        for pool in in_range:
            target = self.policy.pools[pool].overflow_to
            if target and target in fits and self.backends.healthy(target):
                return Route(model, target, overflow=True,
                             kv_block=self._engine_blocks.get(target, 0))
        down = "; ".join(f"{b.pool}/{b.name}: {b.public_status(self.backends.clock())}"
                         for pool in in_range for b in self.backends.pools[pool])
        raise NoBackendAvailable(
            f"No healthy backend for the model `{model.name}` at {prompt_tokens} prompt "
            f"tokens ({down}).",
            retry_after_s=max(1, int(self.policy.health.probe_interval_s)))

    def _in_range(self, pool: str, prompt_tokens: int) -> bool:
        spec = self.policy.pools[pool]
        return spec.prompt_tokens_min <= prompt_tokens and (
            spec.prompt_tokens_max is None or prompt_tokens < spec.prompt_tokens_max)

    def pick(self, pool: str, exclude: tuple[Backend, ...] = ()) -> Backend | None:
        """Where to send a request nothing was reserved for, or a retry (not `exclude`)."""
        now = self.backends.clock()
        return least_outstanding(b for b in self.backends.pools[pool]
                                 if b not in exclude and b.available(now))
