"""The proxy benchmark's in-process probe (benchmarks/pipeline_probe.py) runs the pipeline's
stages as `serve` does up to the forward: kept running here, so the benchmark's breakdown does
not rot as the stages change, and it leaves nothing reserved."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import pipeline_probe
from benchmarks.proxy_overhead import FLOOR, MODEL, SHIPPED, policy_text
from tests.servers import Server, run_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp: Path = tmp_path_factory.mktemp("stub")
    with run_server([sys.executable, "benchmarks/stub_engine.py", "--port", "{port}"],
                    "/health", tmp, "stub") as server:
        yield server


@pytest.mark.parametrize("fields", [FLOOR, SHIPPED], ids=["floor", "shipped"])
def test_the_probe_times_the_work_before_upstream(stub: Server, fields: dict[str, str]) -> None:
    r = asyncio.run(pipeline_probe.probe(policy_text(stub.url, fields),
                                         pipeline_probe.chat_body(MODEL, "Say hello."),
                                         gap_s=0.001, hot_n=5, cold_n=2))
    assert 0 < r.hot_us < 1e6 and 0 < r.cold_us < 1e6
