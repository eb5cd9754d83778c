"""`gateway serve --workers N`: N processes on one port whose /metrics adds up all of them."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from tests.conftest import StartGateway, StartSim, metric, policy_yaml, scrape
from tests.servers import gateway_cmd

REQUESTS = 40


def chat(url: str) -> str:
    """One request on a new connection (so the kernel may hand it to any worker)."""
    body = {"model": "test-model", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return resp.headers["x-request-id"]


def test_workers_share_one_metrics_page(start_sim: StartSim, start_gateway: StartGateway,
                                        redis_url: str) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    with start_sim() as sim, \
            start_gateway(policy_yaml([sim.url]), "--workers", "2", "--redis-url", redis_url,
                          "--state-prefix", prefix) as gw:
        with cf.ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(lambda _: chat(gw.url), range(REQUESTS)))
        # Generated ids are `gw-<process>-<n>`: both workers answered some.
        workers = {i.rsplit("-", 1)[0] for i in ids}
        assert len(workers) == 2, f"one worker served everything: {sorted(set(ids))[:5]}"
        blocks = _engine_blocks(sim.url)
        # Each scrape lands on either worker and still counts every request once.
        for _ in range(6):
            s = scrape(gw.url)
            assert metric(s, "gateway_requests_total", status="200") == REQUESTS
            assert metric(s, "gateway_request_duration_seconds_count") == REQUESTS
            assert metric(s, "gateway_admission_decisions_total") == REQUESTS
            # Gauges combine by their multiprocess_mode: not doubled by two workers.
            assert metric(s, "gateway_backend_up", backend="e0") == 1
            assert metric(s, "gateway_inflight_requests") == 0
            assert metric(s, "gateway_kv_blocks_capacity", backend="e0") == blocks
        # SIGHUP to the parent reloads the policy in every worker.
        gw.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while metric(scrape(gw.url), "gateway_policy_reloads_total", result="ok") < 2:
            assert time.monotonic() < deadline, gw.log()
            time.sleep(0.1)
        assert metric(scrape(gw.url), "gateway_policy_reloads_total", result="ok") == 2
    assert gw.process.returncode == 0, gw.log()


def _engine_blocks(url: str) -> float:
    s = scrape(url)
    (labels,) = [dict(ls) for (n, ls) in s if n == "vllm:cache_config_info"]
    return float(labels["num_gpu_blocks"])


def test_workers_without_redis_is_refused_with_the_reason(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml(["http://127.0.0.1:9"]))
    out = subprocess.run(gateway_cmd("serve", "--policy", str(policy), "--workers", "2"),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert out.stderr.startswith("gateway serve: --workers 2 needs --redis-url: each worker "
                                 "process admits requests on its own"), out.stderr
    out = subprocess.run(gateway_cmd("serve", "--policy", str(policy), "--workers", "0"),
                         capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stderr.strip()) == (
        2, "gateway serve: --workers must be at least 1, got 0")
