"""The request path's batched histogram observations (gateway/observe/batched.py) must read, once
flushed, as observing each value on the histogram does: the same buckets and count exactly, the
same sum but for float rounding (added in partial sums)."""

from __future__ import annotations

import math
import random

from prometheus_client import CollectorRegistry, Histogram

from gateway.observe.batched import BatchedObserve, batched
from gateway.observe.metrics import STAGE_BUCKETS, GatewayMetrics


def _histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram("t_seconds", "t", ["stage"], buckets=STAGE_BUCKETS, registry=registry)


def test_flushed_batches_read_as_each_value_observed() -> None:
    rng = random.Random(21)
    # Bounds themselves, between them, past the last finite one, zero and a negative (which
    # the client puts in the first bucket).
    values = [rng.choice([*STAGE_BUCKETS, 0.0, -0.001, 9.0]) * rng.choice([1.0, 0.999, 1.001])
              for _ in range(5_000)]
    direct, batches_registry = CollectorRegistry(), CollectorRegistry()
    expected, got = _histogram(direct), _histogram(batches_registry)
    batches: list[BatchedObserve] = []
    observe = batched(got.labels("parse"), batches)
    assert len(batches) == 1  # this client's values were found
    for i, v in enumerate(values):
        expected.labels("parse").observe(v)
        observe(v)
        if i % 97 == 0:
            batches[0].flush()
    batches[0].flush()
    batches[0].flush()  # an empty flush adds nothing
    want, have = _samples(direct), _samples(batches_registry)
    assert want.keys() == have.keys()
    for key, value in want.items():
        if key[0].endswith("_sum"):
            assert math.isclose(have[key], value, rel_tol=1e-9), key
        else:
            assert have[key] == value, key


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("le", "")): s.value for metric in registry.collect()
            for s in metric.samples if not s.name.endswith("_created")}


def test_a_child_without_the_expected_values_is_observed_directly() -> None:
    class Other:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, amount: float) -> None:
            self.seen.append(amount)

    child, batches = Other(), []
    observe = batched(child, batches)
    observe(0.25)
    assert child.seen == [0.25] and not batches


def test_the_gateway_metrics_flush_what_the_stages_counted() -> None:
    m = GatewayMetrics()
    observe = m.stage_observer("count")
    assert m.stage_observer("count") is observe  # bound once per stage
    observe(0.0002)
    observe(0.003)
    child = m.request_stage.labels("count")

    def count() -> float:
        return sum(s.value for metric in m.request_stage.collect() for s in metric.samples
                   if s.name.endswith("_count") and s.labels["stage"] == "count")

    assert count() == 0  # counted, not yet added
    m.flush_batched()
    assert count() == 2 and abs(child._sum.get() - 0.0032) < 1e-12
