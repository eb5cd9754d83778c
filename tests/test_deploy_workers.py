"""`gateway serve --workers N`: N processes on one port whose /metrics adds up all of them."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import signal
import subprocess
import time
import uuid
from pathlib import Path

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import Server, bearer, gateway_cmd, http, metric, poll_metric, scrape

REQUESTS = 40
ADMIN_KEY = "test-admin-key"
# The admin API needs an admin key: its SHA-256 in the policy, as in production.
ADMIN = f"""
auth:
  admin_keys: ["{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"]
"""


def chat(url: str) -> str:
    """One request on a new connection (so the kernel may hand it to any worker)."""
    body = {"model": "test-model", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    reply = http("POST", url + "/v1/chat/completions", body, timeout=30)
    assert reply.status == 200
    return reply.headers["x-request-id"]


def test_workers_share_one_metrics_page(start_sim: StartSim, start_gateway: StartGateway,
                                        redis_url: str, tmp_path: Path) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    with start_sim() as sim, \
            start_gateway(policy_yaml([sim.url], extra=ADMIN), "--workers", "2",
                          "--redis-url", redis_url,
                          "--state-prefix", prefix) as gw:
        # Generated ids are `gw-<process>-<n>`: send until both workers answered some. The
        # port answers once one worker is up; on a busy machine the other may still be
        # importing, so one batch can all land on the first.
        ids: list[str] = []
        deadline = time.monotonic() + 20
        with cf.ThreadPoolExecutor(8) as pool:
            while len({i.rsplit("-", 1)[0] for i in ids}) < 2:
                assert time.monotonic() < deadline, \
                    f"one worker served everything: {sorted(set(ids))[:5]}"
                ids += pool.map(lambda _: chat(gw.url), range(REQUESTS))
        sent = len(ids)
        blocks = _engine_blocks(sim.url)
        # Each scrape lands on either worker and still counts every request once.
        for _ in range(6):
            s = scrape(gw.url)
            assert metric(s, "gateway_requests_total", status="200") == sent
            assert metric(s, "gateway_request_duration_seconds_count") == sent
            assert metric(s, "gateway_admission_decisions_total") == sent
            # Gauges combine by their multiprocess_mode: not doubled by two workers.
            assert metric(s, "gateway_backend_up", backend="e0") == 1
            assert metric(s, "gateway_inflight_requests") == 0
            assert metric(s, "gateway_kv_blocks_capacity", backend="e0") == blocks
        # POST /admin/reload reaches one worker, which checks the file and has the parent
        # SIGHUP them all: every worker reloads, not only the one that answered.
        assert _admin_reload(gw.url) == 200
        _wait_reloads(gw, ok=2)
        # A broken file is refused by the worker that checked it; none reloads.
        (policy_file,) = tmp_path.glob("policy-*.yaml")
        good = policy_file.read_text()
        policy_file.write_text(good.replace("max_model_len: 8192", "max_model_len: -1"))
        assert _admin_reload(gw.url) == 400
        s = scrape(gw.url)
        assert metric(s, "gateway_policy_reloads_total", result="invalid") == 1
        assert metric(s, "gateway_policy_reloads_total", result="ok") == 2
        # SIGHUP to the parent reloads the policy in every worker too.
        policy_file.write_text(good)
        gw.process.send_signal(signal.SIGHUP)
        _wait_reloads(gw, ok=4)
    assert gw.process.returncode == 0, gw.log()


def _admin_reload(url: str) -> int:
    return http("POST", url + "/admin/reload", b"", headers=bearer(ADMIN_KEY)).status


def _wait_reloads(gw: Server, ok: int) -> None:
    """Until the merged metrics count `ok` successful reloads; then they stay there."""
    poll_metric(gw.url, "gateway_policy_reloads_total", lambda v: v >= ok, 10, result="ok")
    assert metric(scrape(gw.url), "gateway_policy_reloads_total", result="ok") == ok


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
