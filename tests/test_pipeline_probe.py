"""The proxy benchmark's in-process probe (benchmarks/pipeline_probe.py) runs the pipeline's
stages as `serve` does up to the forward: kept running here, so the benchmark's breakdown does
not rot as the stages change, and it leaves nothing reserved. And every gateway the proxy
benchmark starts has a policy the gateway takes: a switch removed goes with its target."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import harness, pipeline_probe, proxy_overhead
from gateway.policy.loader import parse_policy
from tests.servers import Server, run_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("stub")
    with run_server([sys.executable, "benchmarks/stub_engine.py", "--port", "{port}"],
                    "/health", tmp, "stub") as server:
        yield server


@pytest.mark.parametrize("variant", ["floor", "shipped"])
def test_the_probe_times_the_work_before_upstream(stub: Server, variant: str) -> None:
    r = asyncio.run(pipeline_probe.probe(proxy_overhead.target_policy(stub.url, variant),
                                         pipeline_probe.chat_body(harness.STUB_MODEL, "Say hello."),
                                         gap_s=0.001, hot_n=5, cold_n=2))
    assert 0 < r.hot_us < 1e6 and 0 < r.cold_us < 1e6


@pytest.mark.parametrize("variant", sorted(proxy_overhead.VARIANTS))
def test_every_gateway_target_of_the_proxy_benchmark_has_a_valid_policy(variant: str) -> None:
    parse_policy(proxy_overhead.target_policy("http://127.0.0.1:9", variant))
