"""Prefix routing's side of admission: what each backend holds of a request's prompt, the
session's backend, and keeping every backend's prefix index (gateway/prefix/index.py).

Per request and backend the view carries the predicted cached tokens (the index's leading
blocks x block size, at most the prompt less one token: an engine always computes the last
token to get its logits, rounded down to the engine's own block, the grain it caches by) and
the blocks requests in flight there already hold (not reserved twice; whole engine blocks).
On admission the prompt's blocks go into the chosen backend's index (approximate mode: what
the gateway sent is what the engine will hold) and are held until release.

Session affinity is rendezvous hashing (highest random weight) over all of the pool's
backends: a backend that goes away moves only its own sessions, and every gateway replica
picks the same one. blake2b, not Python's salted str hash, so replicas agree.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import Sequence

from gateway.admission.decision import PoolView
from gateway.admission.pool import Ask, PoolState, Ticket
from gateway.observe.metrics import GatewayMetrics
from gateway.policy.model import PoolSpec
from gateway.prefix import IndexMode, PrefixIndex, PrefixIndexes
from gateway.routing.router import PrefixRule, prefix_order
from gateway.signals.engines import EngineSample

# A ticket's `held` while its blocks wait to be held (a distinct empty object, unlike ()).
_PENDING: Sequence[int] = array("q")
HASHED_MODES = ("approximate", "precise", "shadow")  # modes that read a prompt's block hashes


def rule_of(spec: PoolSpec) -> PrefixRule | None:
    p = spec.routing.prefix
    if p.mode == "off":
        return None
    return PrefixRule(p.inflight_weight, p.imbalance_epsilon, p.imbalance_slack_tokens,
                      act=p.mode != "shadow")


def hash_block_size(pools: Sequence[PoolSpec]) -> int | None:
    """The block size a model's prompts are hashed at: its first pool that reads hashes."""
    return next((p.block_size for p in pools if p.routing.prefix.mode in HASHED_MODES), None)


class PrefixPlacement:
    def __init__(self, indexes: PrefixIndexes, metrics: GatewayMetrics) -> None:
        self.indexes = indexes
        self.metrics = metrics.prefix
        self._counters: dict[tuple[str, str], tuple[float, float]] = {}  # last scraped
        # Each engine's own KV block, scraped (gateway/signals/blocks.py): what it caches.
        self._engine_block: dict[tuple[str, str], int] = {}

    def configure(self, ps: PoolState) -> None:
        """Each backend's index at its capacity and mode (after start and every reload)."""
        p = ps.spec.routing.prefix
        if p.mode not in HASHED_MODES:
            return
        for b in ps.spec.backends:
            precise = p.mode == "precise" and b.kv_events is not None
            mode = IndexMode.PRECISE if precise else IndexMode.APPROXIMATE
            old = self.indexes.mode(ps.name, b.name)
            if precise and old is IndexMode.FELL_BACK:
                mode = old  # the subscriber says when its events are good again
            self.indexes.configure(ps.name, b.name, p.capacity_blocks or ps.capacity[b.name],
                                   mode)

    def on_sample(self, ps: PoolState, backend: str, sample: EngineSample) -> None:
        """An engine's scrape: its prefix-cache counters exported, its KV capacity (just
        learnt by Capacity) the index's, and a restart (its counters fell) forgets it."""
        if sample.block_size:
            self._engine_block[ps.name, backend] = sample.block_size
        index = self.indexes.get(ps.name, backend)
        if index is not None and ps.spec.routing.prefix.capacity_blocks is None \
                and backend in ps.capacity:
            index.resize(ps.capacity[backend])
        if sample.cache_hit_rate is not None:
            self.metrics.engine_hit_rate.labels(ps.name, backend).set(sample.cache_hit_rate)
        if sample.prefix_queries is None or sample.prefix_hits is None:
            return
        key = (ps.name, backend)
        last = self._counters.get(key)
        self._counters[key] = (sample.prefix_queries, sample.prefix_hits)
        if last is None:
            return  # the first sample only sets the baseline: its totals predate us
        queries, hits = sample.prefix_queries - last[0], sample.prefix_hits - last[1]
        if queries < 0 or hits < 0:  # a new process: its cache starts empty
            self.forget(ps.name, backend, "restarted")
            queries, hits = sample.prefix_queries, sample.prefix_hits
        self.metrics.engine_queries.labels(ps.name, backend).inc(queries)
        self.metrics.engine_hits.labels(ps.name, backend).inc(hits)

    def _index(self, ps: PoolState, ask: Ask, backend: str) -> PrefixIndex | None:
        if not ask.hashes or ask.hash_block != ps.spec.block_size:
            return None
        return self.indexes.get(ps.name, backend)

    def at(self, ps: PoolState, ask: Ask, backend: str, own: Ticket | None = None
           ) -> tuple[int, int]:
        """(predicted cached tokens, blocks held by requests in flight) of `ask` there; with
        `own`, the ticket of `ask` itself, by requests other than it."""
        index = self._index(ps, ask, backend)
        if index is None:
            return 0, 0
        block = ps.spec.block_size
        mine = len(own.held) if own is not None and own.held is not _PENDING else 0
        held = index.held(ask.hashes, mine)
        match = index.match(ask.hashes)
        if own is not None:
            # Its own first blocks were learnt there when it was placed: the engine had what
            # was predicted then, and more only where that was every block it knew.
            known = mine or len(own.holding)
            if own.cached_tokens < known * block:
                match = min(match, own.cached_tokens // block)
        # Blocks that requests in flight there hold count as cached: in precise mode the
        # events name a block only once the engine has computed it, while a request sent
        # behind one still prefilling its prefix is scheduled after it and hits. The engine
        # computes the last prompt token whatever it holds (its logits are needed): a hit is
        # at most the full blocks before it (vLLM's get_computed_blocks).
        cached = min(max(match, held),
                     max(0, ask.prompt_tokens - 1) // block) * block
        # The engine caches and shares whole blocks of its own size: of a prefix matched to
        # the middle of one of its blocks it serves (and holds once) only the blocks before.
        engine = self._engine_block.get((ps.name, backend), block)
        if engine > block:
            cached -= cached % engine
            held -= held % (engine // block) if engine % block == 0 else held
        return cached, held

    def affinity(self, ps: PoolState, ask: Ask) -> str | None:
        """The backend the request's session hashes to, where the pool uses affinity."""
        p = ps.spec.routing.prefix
        if ask.session is None or not (p.session_affinity or p.mode == "session"):
            return None
        key = ask.session.encode()
        return max((b.name for b in ps.spec.backends),
                   key=lambda name: hashlib.blake2b(key + b"\0" + name.encode(),
                                                    digest_size=8).digest())

    def admitted(self, ps: PoolState, ask: Ask, ticket: Ticket, by: str) -> None:
        """The request is placed on `ticket.backend`: learn and hold its blocks there."""
        self.metrics.child(self.metrics.placements, ps.name, by).inc()
        self.hold(ps, ask, ticket)

    def hold(self, ps: PoolState, ask: Ask, ticket: Ticket) -> None:
        """Learn and hold `ask`'s blocks on `ticket.backend` (soon: see below)."""
        name = ticket.backend.name
        index = self._index(ps, ask, name)
        if index is None:
            return
        # Learning and holding the blocks is two dict operations a block (~0.2 ms for a 16K-token
        # prompt hot, ~0.8 ms on a CPU whose caches went cold while the loop was idle), so it runs
        # once this request's bytes are on their way upstream, not before. Two hops of the loop: the
        # gateway's own client (gateway/upstream/native.py) writes the request at once, but
        # aiohttp's (https engines; before Python 3.12's eager tasks) writes the body in a task it
        # makes when the request is sent, which runs in the iteration after that, and one hop ran
        # there first: the engine got a 16K-token request 0.8 ms late, and its first token with it.
        # Nothing is lost by waiting: the engine has cached none of it yet, and a request decided in
        # between sees these blocks as not shared and reserves them again (the safe side). The
        # engine's answer may come first (a refusal at once): if it got the backend ejected, and its
        # index forgotten, meanwhile, these blocks are not learnt there either.
        ticket.held = _PENDING
        ticket.holding = ask.hashes
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._hold, ps.name, name, index,
                       self.indexes.learns_from_traffic(ps.name, name), ticket, index.forgets)

    def _hold(self, pool: str, name: str, index: PrefixIndex, learn: bool, ticket: Ticket,
              forgets: int) -> None:
        hashes, ticket.holding = ticket.holding, ()
        if learn and index.forgets == forgets:
            index.store(hashes)
            self.metrics.child(self.metrics.index_blocks, pool, name).set(len(index))
        if ticket.held is _PENDING:  # not released already (a request over before this ran)
            index.acquire(hashes)
            ticket.held = hashes

    def observed(self, ticket: Ticket, prompt_tokens: int | None,
                 engine_cached: int | None) -> None:
        """The engine's usage came back: its cached tokens against the prediction, counted
        over the same requests (those whose usage was read) in pools that route by prefix."""
        pool = ticket.pool
        if prompt_tokens is None or ticket.lease is None \
                or self.indexes.mode(pool, ticket.backend.name) is None:
            return
        name = ticket.backend.name
        m = self.metrics
        m.child(m.prompt_tokens, pool, name).inc(prompt_tokens)
        m.child(m.predicted_cached, pool, name).inc(ticket.cached_tokens)
        m.child(m.engine_cached, pool, name).inc(engine_cached or 0)

    def shadow(self, view: PoolView, ask: Ask, chosen: str) -> None:
        """routing.prefix.mode shadow: count whether the prefix router would have agreed."""
        available = [b for b in view.backends if b.available]
        would = prefix_order(available, view.prefix, ask.tokens, ask.prompt_tokens) \
            if view.prefix is not None else available
        if would:
            self.metrics.shadow.labels(view.name, str(would[0].name == chosen).lower()).inc()
            self.metrics.shadow_cached.labels(view.name).inc(would[0].cached_tokens)

    def released(self, ticket: Ticket) -> None:
        if ticket.held is _PENDING:
            ticket.held = ()  # `_hold` will not acquire what nothing would release
        elif ticket.held:
            index = self.indexes.get(ticket.pool, ticket.backend.name)
            if index is not None:
                index.release(ticket.held)
            ticket.held = ()

    def forget(self, pool: str, backend: str, why: str) -> None:
        if self.indexes.get(pool, backend) is not None:
            self.indexes.forget(pool, backend)
            self.metrics.index_forgotten.labels(pool, backend, why).inc()
            self.metrics.index_blocks.labels(pool, backend).set(0)
