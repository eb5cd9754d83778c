"""How much each backend can take: KV capacity, overbooking, the engines' own reports, and
each backend's prefill backlog.

Capacity starts from the ledger (model, GPU, TP) or the policy's `kv_blocks`, and is replaced
by the engine's own number once it reports one. Reservations are estimates; when an engine
reports less KV in use than this gateway has reserved there, the overbooking ratio learned
from that lets reservations exceed the raw capacity (up to `overbook_max`), and the engine's
own usage then stays the hard line. Blocks in use that no reservation of ours accounts for
(other traffic, another gateway) are taken off the limit.

A slot engine (llama.cpp's server) is different: it runs `-np` slots, each with a context of
its own, and defers what finds none free. Its capacity is its slots' blocks, every request
reserves a whole slot, and the limit is the capacity itself (no KV fraction, no overbooking: a
slot is held whole while it runs), so the gateway never sends it more than it has slots and
queues the rest where priority, fairness and early rejection apply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.admission.pool import PoolState
from gateway.cost.profiles import ledger, roofline_gpu
from gateway.observe.metrics import GatewayMetrics
from gateway.policy.model import Policy, PoolSpec
from gateway.signals.blocks import disagreement
from gateway.signals.engines import EngineSample, EngineScraper

log = logging.getLogger("gateway.admission")

UNKNOWN_CAPACITY_BLOCKS = 1 << 40  # no architecture and no engine report: only tokens bound
# Learn the overbooking ratio only from samples where reservations hold a fair share of the
# backend: an idle engine says nothing about how much reservations overestimate.
OVERBOOK_MIN_LOAD = 0.3
OVERBOOK_SMOOTHING = 0.2
# The static rule's lines where the policy sets none (the rule most gateways ship).
STATIC_WAITING_MAX = 5
STATIC_KV_USAGE_MAX = 0.8


class Capacity:
    def __init__(self, policy: Policy, scraper: EngineScraper, metrics: GatewayMetrics,
                 replicas: Callable[[], int]) -> None:
        self.policy = policy
        self.scraper = scraper
        self.metrics = metrics
        self.replicas = replicas  # replicas alive: each takes its share of per-replica counts
        self._said: dict[str, dict[str, int]] = {}  # the block sizes last warned of, by pool

    def planned_blocks(self, spec: PoolSpec) -> int:
        if spec.kv_blocks is not None:
            return spec.kv_blocks
        model = self.policy.model(spec.models[0])
        gpu = roofline_gpu(spec.gpu)  # None on CPUs: no ledger, the engines say
        if model is None or model.architecture is None or gpu is None:
            return UNKNOWN_CAPACITY_BLOCKS
        led = ledger(model.architecture.resolve(), gpu, spec.tp, model.dtype,
                     model.kv_cache_dtype, block_size=spec.block_size)
        return max(1, led.num_gpu_blocks)

    @staticmethod
    def _capacity_tokens(ps: PoolState) -> float:
        kv = ps.thresholds.kv_usage_max.value or 1.0
        return sum(ps.capacity.values()) * ps.spec.block_size * kv

    def static_tokens(self, ps: PoolState) -> float | None:
        """The static in-flight token limit, where one binds. The planner's is computed from
        the ledger's KV capacity; on engines that report less (or with a policy's kv_blocks)
        it may exceed the pool's KV budget, and then the KV budget binds, with overbooking,
        as without one."""
        th = ps.thresholds.inflight_tokens_max
        if th.value is None or (th.source == "planner" and th.value >= self._capacity_tokens(ps)):
            return None
        return float(th.value)

    def rescale_guard(self, ps: PoolState) -> None:
        static = self.static_tokens(ps)
        capacity_tokens = self._capacity_tokens(ps)
        ceiling = static if static is not None else capacity_tokens
        ps.guard.rescale(ceiling, floor=min(ceiling, 0.05 * ceiling))
        self.metrics.latency_guard_limit.labels(ps.name).set(ps.guard.limit)

    @staticmethod
    def engine_blocks(ps: PoolState, sample: EngineSample) -> int | None:
        """The engine's own KV capacity in blocks of the pool's `block_size`, which is what
        reservations count (ceil(tokens / block_size) per request)."""
        size = ps.spec.block_size
        if sample.slots and sample.slot_tokens:  # llama.cpp: whole slots, never a part of one
            return sample.slots * max(1, sample.slot_tokens // size)
        # Tokens first: vLLM's kv_cache_size_tokens is group-aware, right for hybrid models where
        # num_gpu_blocks x block_size is not (their block_size is enlarged to match Mamba pages).
        if sample.max_tokens:
            return sample.max_tokens // size
        if sample.num_gpu_blocks:
            # The engine's blocks are of its own size, not necessarily the pool's.
            return sample.num_gpu_blocks * (sample.block_size or size) // size
        return None

    def on_engine_sample(self, ps: PoolState, backend: str, sample: EngineSample) -> None:
        if sample.block_size and self.scraper.blocks.report(ps.name, backend,
                                                             sample.block_size):
            self._block_size_changed(ps, backend, sample.block_size)
        if sample.slot_tokens:
            ps.slot_blocks[backend] = max(1, sample.slot_tokens // ps.spec.block_size)
            if sample.slots is not None:
                self.metrics.engine_slots.labels(ps.name, backend).set(sample.slots)
        for state, value in (("running", sample.running), ("waiting", sample.waiting)):
            if value is not None:
                self.metrics.engine_requests.labels(ps.name, backend, state).set(value)
        blocks = self.engine_blocks(ps, sample)
        if blocks and ps.spec.kv_blocks is None and ps.capacity.get(backend) != blocks:
            ps.capacity[backend] = blocks  # the engine's own number beats the ledger's
            self.metrics.kv_blocks_capacity.labels(ps.name, backend).set(blocks)
            self.rescale_guard(ps)
        if sample.kv_usage is not None:
            self.metrics.engine_kv_usage.labels(ps.name, backend).set(sample.kv_usage)
            self._learn_overbook(ps, backend, sample.kv_usage)

    def _block_size_changed(self, ps: PoolState, backend: str, size: int) -> None:
        """An engine's KV block size, first scraped or changed (a restart): exported, and
        said once in the log where the pool's engines or its `block_size` disagree (`gateway
        check` cannot know: it reads the policy, never the engines)."""
        self.metrics.engine_kv_block_size.labels(ps.name, backend).set(size)
        engines = self.scraper.blocks.reported(ps.name)
        said = disagreement(ps.spec.block_size, engines)
        if said is not None and self._said.get(ps.name) != engines:
            self._said[ps.name] = engines
            log.warning("pool %s: %s", ps.name, said)

    def _learn_overbook(self, ps: PoolState, backend: str, kv_usage: float) -> None:
        """How much our reservations exceed the blocks the engine really holds."""
        limit = ps.spec.admission.overbook_max
        capacity = ps.capacity[backend]
        reserved = ps.reserved.get(backend, 0)
        if limit <= 1.0 or capacity >= UNKNOWN_CAPACITY_BLOCKS or \
                reserved < OVERBOOK_MIN_LOAD * capacity or kv_usage <= 0:
            return
        ratio = min(limit, max(1.0, reserved / (kv_usage * capacity)))
        old = ps.overbook.get(backend, 1.0)
        ps.overbook[backend] = (1 - OVERBOOK_SMOOTHING) * old + OVERBOOK_SMOOTHING * ratio
        self.metrics.kv_overbook.labels(ps.name, backend).set(ps.overbook[backend])

    def max_blocks(self, ps: PoolState, backend: str) -> int:
        """Blocks our reservations may take on `backend`, engine-reported usage considered."""
        capacity = ps.capacity[backend]
        if backend in ps.slot_blocks and capacity < UNKNOWN_CAPACITY_BLOCKS:
            return capacity  # a slot engine: all its slots, each held whole while it runs
        overbook = ps.overbook.get(backend, 1.0)
        limit = int(capacity * (ps.thresholds.kv_usage_max.value or 1.0) * overbook)
        sample = self.scraper.fresh(ps.name, backend)
        known = capacity < UNKNOWN_CAPACITY_BLOCKS
        if sample is not None and sample.kv_usage is not None and known:
            # Blocks in use that we did not reserve (other traffic, another gateway) are taken.
            external = sample.kv_usage * capacity - ps.reserved.get(backend, 0) / overbook
            if external > 0:
                limit -= int(external * overbook)
        return max(0, limit)

    def kv_budget(self, ps: PoolState) -> int:
        """The pool's KV blocks under `kv_usage_max`, for tenants' shares of it."""
        return sum(int(c * (ps.thresholds.kv_usage_max.value or 1.0))
                   for c in ps.capacity.values())

    def engine_full(self, ps: PoolState, backend: str) -> str | None:
        """Why the engine's own report rules this backend out now, if it does."""
        sample = self.scraper.fresh(ps.name, backend)
        # Unknown (stale or never scraped) is not "idle": the reservation limit still holds.
        if sample is None:
            return None
        waiting_max = ps.thresholds.waiting_max.value
        if waiting_max is not None and sample.waiting is not None \
                and sample.waiting > waiting_max:
            return "engine_waiting"
        # Overbooked reservations rest on averages; the engine's own usage is the hard line.
        kv_max = ps.thresholds.kv_usage_max.value or 1.0
        if ps.overbook.get(backend, 1.0) > 1.0 and sample.kv_usage is not None \
                and sample.kv_usage > kv_max:
            return "engine_kv"
        return None

    def static_lines(self, ps: PoolState) -> tuple[float, float]:
        """(waiting, KV usage) above which the static rule turns an engine away."""
        waiting_max = ps.thresholds.waiting_max.value
        th = ps.thresholds.kv_usage_max
        kv_max = th.value if th.source != "default" and th.value is not None \
            else STATIC_KV_USAGE_MAX
        return (STATIC_WAITING_MAX if waiting_max is None else waiting_max), kv_max

    def over_static_rule(self, ps: PoolState, backend: str) -> bool:
        s = self.scraper.fresh(ps.name, backend)
        if s is None:
            return False
        waiting_max, kv_max = self.static_lines(ps)
        return (s.waiting or 0) > waiting_max or (s.kv_usage or 0) > kv_max

    def prefill_full(self, ps: PoolState, backend: str, prompt_tokens: int) -> bool:
        """Would `prompt_tokens` more push the backend's prefill backlog over its limit?

        The backlog is this replica's own count (it sees each stream's first byte), so each
        replica takes its share of the limit, as it does of the budget when Redis is down. An
        idle backend takes any prompt: one longer than the limit must still run somewhere.
        """
        limit = ps.thresholds.prefill_tokens_max.value
        pending = ps.prefill.get(backend, 0)
        return limit is not None and pending > 0 and \
            pending + prompt_tokens > limit / max(1, self.replicas())

    def ruled_out(self, ps: PoolState, backend: str, prompt_tokens: int) -> str | None:
        """Why `backend` takes no request of `prompt_tokens` now: the engine's own report, or
        its prefill backlog; None when neither rules it out."""
        full = self.engine_full(ps, backend)
        if full is None and self.prefill_full(ps, backend, prompt_tokens):
            return "prefill_tokens"
        return full

    def prefill_add(self, ps: PoolState, backend: str, tokens: int) -> None:
        ps.prefill[backend] = ps.prefill.get(backend, 0) + tokens
        m = self.metrics
        m.child(m.prefill_tokens_pending, ps.name, backend).set(ps.prefill[backend])

    def prefill_remove(self, ps: PoolState, backend: str, tokens: int) -> None:
        ps.prefill[backend] = max(0, ps.prefill.get(backend, 0) - tokens)
        m = self.metrics
        m.child(m.prefill_tokens_pending, ps.name, backend).set(ps.prefill[backend])
