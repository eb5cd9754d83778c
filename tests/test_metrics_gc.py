"""GC pauses are noted by the collector's callback and observed later, never inside it."""

from __future__ import annotations

import gc

from gateway.observe.metrics import GatewayMetrics


def test_a_collection_is_noted_and_observed_on_the_next_flush() -> None:
    m = GatewayMetrics()
    m.install_gc_callback()
    try:
        def count() -> float:
            return m.registry.get_sample_value("gateway_gc_pause_seconds_count",
                                               {"generation": "2"}) or 0.0
        before = count()
        gc.collect()
        # Observing inside the callback could wait on prometheus_client's own lock, held by
        # whatever the collection interrupted (a --workers process deadlocked on it).
        assert count() == before
        m.flush_gc_pauses()
        assert count() == before + 1
    finally:
        m.remove_gc_callback()
