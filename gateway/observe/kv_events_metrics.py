"""The KV-events subscription's metrics (precise prefix mode), registered in GatewayMetrics.

Set from each backend's `Follower` state when it changes (once per event batch, a few dozen a
second per engine at most), with label children bound once per backend.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.prefix.events import FAULTS, Follower

BLOCK_EVENTS = ("stored", "removed", "orphaned", "skipped", "clamped")


class KVEventMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        labels = ["pool", "backend"]
        self.connected = Gauge(
            "gateway_kv_events_connected", "1 while the gateway's SUB socket is connected to "
            "the engine's KV event publisher.", labels, registry=r, multiprocess_mode="livemin")
        self.precise = Gauge(
            "gateway_kv_events_precise", "1 while the backend's prefix index follows its "
            "engine's events; 0 while it has fallen back to approximate.", labels,
            registry=r, multiprocess_mode="livemin")
        self.last_sequence = Gauge(
            "gateway_kv_events_last_sequence", "Sequence number of the last event batch "
            "applied.", labels, registry=r, multiprocess_mode="livemax")
        self.batches = Counter(
            "gateway_kv_events_batches_total", "Event batches applied.", labels, registry=r)
        self.blocks = Counter(
            "gateway_kv_events_blocks_total", "Blocks named by events, by what became of them: "
            "stored, removed, orphaned (stored after a parent the gateway never saw), skipped "
            "(a LoRA, images or another medium: not hashable as the engine did), clamped "
            "(past the index's capacity).", [*labels, "event"], registry=r)
        self.gaps = Counter(
            "gateway_kv_events_gaps_total", "Sequence gaps, by outcome: recovered (the replay "
            "socket filled them) or lost.", [*labels, "outcome"], registry=r)
        self.fallbacks = Counter(
            "gateway_kv_events_fallbacks_total", "Times the backend's index fell back to "
            "approximate, by reason: " + ", ".join(FAULTS) + ".", [*labels, "reason"],
            registry=r)

    def bind(self, pool: str, backend: str) -> Callable[[Follower], None]:
        """The follower's `on_change`: counters advance by what changed since the last call."""
        connected = self.connected.labels(pool, backend)
        precise = self.precise.labels(pool, backend)
        last_sequence = self.last_sequence.labels(pool, backend)
        batches = self.batches.labels(pool, backend)
        blocks = {e: self.blocks.labels(pool, backend, e) for e in BLOCK_EVENTS}
        gaps = {o: self.gaps.labels(pool, backend, o) for o in ("recovered", "lost")}
        fallbacks = {f: self.fallbacks.labels(pool, backend, f) for f in FAULTS}
        seen: dict[str, int] = {}

        def advance(counter: Counter, key: str, value: int) -> None:
            delta = value - seen.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            seen[key] = value

        def update(follower: Follower) -> None:
            s = follower.state
            connected.set(1 if s.connected else 0)
            precise.set(1 if s.precise else 0)
            last_sequence.set(s.last_seq)
            advance(batches, "batches", s.batches)
            index = follower.index
            for event, value in (("stored", s.blocks_stored), ("removed", s.blocks_removed),
                                 ("orphaned", s.orphans), ("skipped", s.skipped),
                                 ("clamped", index.clamped if index is not None else 0)):
                advance(blocks[event], event, value)
            advance(gaps["recovered"], "recovered", s.gaps_recovered)
            advance(gaps["lost"], "lost", s.gaps_lost)
            for reason, value in s.fallbacks.items():
                advance(fallbacks[reason], "fallback:" + reason, value)

        precise.set(1)
        return update
