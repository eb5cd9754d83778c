"""The dashboards and alerts, proven against a real Prometheus (Debian's package).

Prometheus scrapes two gateway replicas (sharing a Redis) and three simulated engines on
loopback every second, with deploy/prometheus/alerts.yml loaded. A short load drives the
engines into queueing and rejections, and one tenant over its token quota; then one engine
first fails and is then killed, Redis is killed, and one replica is sent a broken policy to
reload. Every dashboard panel's query must then parse and return data, every rule must parse
and evaluate, and the alerts for what broke must match.

prometheus and promtool are installed with apt-get when missing and the suite runs as root;
otherwise the test fails saying how to get them. It never skips.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import (
    ROOT,
    Server,
    http,
    metric,
    openai_client,
    poll_metric,
    redis_server,
    run_server,
    scrape,
)

PROM_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "gateway.json"
# What Grafana would put in the queries: all pools, and a rate window over the whole test.
GRAFANA_VARS = {"$pool": ".*", "$__rate_interval": "1m"}
SMALL_ENGINE = ("--num-gpu-blocks", "64", "--block-size", "16")


# --- tools --------------------------------------------------------------------------------


def ensure_prometheus() -> tuple[str, str]:
    """Paths of prometheus and promtool; installs Debian's package when root and missing."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom and tool:
        return prom, tool
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=300,
                       capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                        "prometheus"], check=True, env=env, timeout=300, capture_output=True)
        prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prom and tool):
        pytest.fail("prometheus and promtool are needed for the dashboard and alert tests: "
                    "Debian/Ubuntu `sudo apt-get install prometheus` (run as root, the suite "
                    "installs it), or put both binaries from prometheus.io on PATH")
    return prom, tool


@pytest.fixture(scope="session")
def prometheus_bins() -> tuple[str, str]:
    return ensure_prometheus()


def test_promtool_accepts_the_rules_and_the_config(prometheus_bins: tuple[str, str]) -> None:
    _, promtool = prometheus_bins
    for args in (["check", "rules", str(PROM_DIR / "alerts.yml")],
                 ["check", "config", str(PROM_DIR / "prometheus.yml")]):
        out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"


# --- queries and the metric names in them -------------------------------------------------


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables filled in) for every panel target."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            out.append((panel["title"], expr))
    return out


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "by", "without", "on", "ignoring", "group_left",
    "group_right", "and", "or", "unless", "bool", "offset", "rate", "irate", "increase",
    "histogram_quantile", "vector", "label_replace", "absent", "time", "timestamp", "le",
    "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (strings, label matchers and groupings removed)."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names: set[str] = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = m.group()
        after = expr[m.end():].lstrip()
        if word.lower() in PROMQL_WORDS or after.startswith("("):
            continue
        names.add(word)
    return names


def exported_names(url: str) -> set[str]:
    """Every series name a /metrics page declares, even families with no samples yet."""
    names: set[str] = set()
    for family in text_string_to_metric_families(http("GET", url + "/metrics").body.decode()):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count", "")}.get(family.type, ("",))
        names.update(family.name + s for s in suffixes)
        names.update(s.name for s in family.samples)
    return names


def test_metric_names_are_read_as_expected() -> None:
    assert metric_names('sum by (pool, le) (rate(gateway_ttft_seconds_bucket{pool=~".*"}[1m]))'
                        ) == {"gateway_ttft_seconds_bucket"}
    assert metric_names('up{job="engines"} == 1 unless on (pool, backend) '
                        'vllm:kv_cache_usage_perc') == {"up", "vllm:kv_cache_usage_perc"}
    assert metric_names('label_replace(vector(10), "pool", "long", "", "") or on (pool) '
                        "(0 * max by (pool) (gateway_kv_blocks_capacity) + 2)") \
        == {"gateway_kv_blocks_capacity"}


# --- servers ------------------------------------------------------------------------------


def prometheus_config(tmp_path: Path, gateways: list[Server],
                      engines: dict[tuple[str, str], Server]) -> Path:
    """deploy/prometheus/prometheus.yml with loopback targets and a 1 s cadence."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s",
                        "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROM_DIR / f) for f in config["rule_files"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["gateway"]["static_configs"] = [
        {"targets": [f"127.0.0.1:{gw.port}" for gw in gateways]}]
    jobs["engines"]["static_configs"] = [
        {"targets": [f"127.0.0.1:{sim.port}"], "labels": {"pool": pool, "backend": backend}}
        for (pool, backend), sim in engines.items()]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def query(prom: Server, expr: str) -> dict[str, Any]:
    """Prometheus's answer, an error included: it says what was wrong with `expr`."""
    url = prom.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    return http("GET", url).json()  # type: ignore[no-any-return]


def series(prom: Server, expr: str) -> list[dict[str, Any]]:
    answer = query(prom, expr)
    assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
    return answer["data"]["result"]  # type: ignore[no-any-return]


def wait_for(prom: Server, expr: str, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not series(prom, expr):
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus never saw {what} ({expr})")
        time.sleep(0.25)


def post_json(url: str, body: dict[str, Any]) -> None:
    assert http("POST", url, body).status == 200


# A tenant with a quota small enough that two threads of the load spend it in seconds, so the
# quota panels have data; everyone else is the anonymous tenant (no keys required).
QUOTA_TENANT, QUOTA_KEY = "batch", "test-batch-key"


def policy(e0: Server, e1: Server, long0: Server) -> str:
    # Prompts of 2048 tokens or more go to `long`, which has no latency targets: the SLO
    # alerts and lines must leave that pool out.
    digest = hashlib.sha256(QUOTA_KEY.encode()).hexdigest()
    return policy_yaml(
        [e0.url, e1.url],
        pool_extra="    admission: {kv_usage_max: 0.9, queue_size: 2, queue_wait_max_s: 2,\n"
                   "                ttft_p99_max_s: 2, tpot_p99_max_s: 0.1}\n"
                   "    cost: {gpu_hour: 2.5, window_s: 60}\n",
        long_backends=[long0.url], long_from=2048,
        long_extra="    cost: {per_gpu_hour: {hardware: 1.4, power: 0.35, operations: 0.75},"
                   " window_s: 60}\n",
        extra=f"tenants:\n  - {{name: {QUOTA_TENANT}, api_keys: [\"{digest}\"], "
              "tokens_per_minute: 600}\n")


class Load:
    """Streams from a few threads, alternating between the gateways, until stopped. Threads
    1 and 2 call as the quota tenant: soon refused with 429, so the other ten keep the
    default pool queueing and rejecting."""

    QUOTA_THREADS = (1, 2)

    def __init__(self, gateways: list[Server], threads: int = 12) -> None:
        self.clients = {key: [openai_client(gw.url, api_key=key) for gw in gateways]
                        for key in ("anonymous", QUOTA_KEY)}
        self.stop = threading.Event()
        self.outcomes: dict[str, int] = {}
        self.lock = threading.Lock()
        self.pool = cf.ThreadPoolExecutor(threads)
        self.futures = [self.pool.submit(self.run, i) for i in range(threads)]

    def run(self, i: int) -> None:
        n = 0
        clients = self.clients[QUOTA_KEY if i in self.QUOTA_THREADS else "anonymous"]
        while not self.stop.is_set():
            n += 1
            client = clients[(i + n) % len(clients)]
            long = i == 0 and n % 2 == 0  # one thread sometimes sends long prompts
            content = "capacity " * 2300 if long else f"Tell me a story, {i}-{n}."
            try:
                stream = client.chat.completions.create(
                    model="test-model", messages=[{"role": "user", "content": content}],
                    max_tokens=20 if long else 120, stream=True,
                    extra_body={"ignore_eos": True})
                for _ in stream:
                    pass
                outcome = "ok"
            except openai.APIStatusError as exc:
                outcome = str(exc.status_code)
                if exc.status_code == 429:
                    time.sleep(0.1)  # over quota answers at once: don't spin on the CPUs
            except openai.APIError as exc:
                outcome = type(exc).__name__
            with self.lock:
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def finish(self) -> dict[str, int]:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=60)
        self.pool.shutdown()
        return self.outcomes


# --- the test -----------------------------------------------------------------------------


def test_dashboards_and_alerts_against_a_real_prometheus(
        prometheus_bins: tuple[str, str], start_sim: StartSim, start_gateway: StartGateway,
        tmp_path: Path) -> None:
    prometheus, _ = prometheus_bins
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_server(tmp_path))
        e0 = stack.enter_context(start_sim(*SMALL_ENGINE, "--seed", "1"))
        e1 = stack.enter_context(start_sim(*SMALL_ENGINE, "--seed", "2"))
        long0 = stack.enter_context(start_sim("--max-model-len", "32768"))
        gateways = [stack.enter_context(start_gateway(policy(e0, e1, long0), "--redis-url",
                                                      redis.url, "--state-prefix", prefix))
                    for _ in range(2)]
        engines = {("default", "e0"): e0, ("default", "e1"): e1, ("long", "long-0"): long0}
        config = prometheus_config(tmp_path, gateways, engines)
        prom = stack.enter_context(run_server(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             "--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            "/-/ready", tmp_path, "prometheus"))

        # Names first: every metric a panel or rule reads is one the gateway or an engine
        # exports, Prometheus's own `up`, or a recording rule of ours.
        recorded = {r["record"] for r in rules() if "record" in r}
        known = exported_names(gateways[0].url) | exported_names(e0.url) | {"up"} | recorded
        for title, expr in dashboard_queries():
            unknown = metric_names(expr) - known
            assert not unknown, f"panel {title!r} reads metrics nobody exports: {unknown}"
        for rule in rules():
            unknown = metric_names(rule["expr"]) - known
            assert not unknown, f"rule {rule.get('alert') or rule['record']}: {unknown}"

        load = Load(gateways)
        time.sleep(5)
        # e1 fails for a while (upstream errors), then dies (backend down, scrape down).
        post_json(e1.url + "/admin/faults", {"fail_rate": 1.0})
        time.sleep(1.5)
        post_json(e1.url + "/admin/faults", {"fail_rate": 0.0})
        e1.stop(signal.SIGKILL)
        time.sleep(1.5)
        # Redis dies: the gateways count state errors and admit on their own share.
        redis.kill()
        time.sleep(2)
        outcomes = load.finish()
        # A broken policy file: the first replica refuses it, the second reloads it fixed.
        (policy_file,) = tmp_path.glob("policy-*.yaml")
        good = policy_file.read_text()
        policy_file.write_text(good.replace("max_model_len: 8192", "max_model_len: -1"))
        gateways[0].process.send_signal(signal.SIGHUP)
        poll_metric(gateways[0].url, "gateway_policy_reloads_total", lambda v: v > 0, 10,
                    result="invalid")
        policy_file.write_text(good)
        gateways[1].process.send_signal(signal.SIGHUP)
        poll_metric(gateways[1].url, "gateway_policy_reloads_total", lambda v: v > 0, 10,
                    result="ok")

        samples = [scrape(gw.url) for gw in gateways]
        total = {what: sum(metric(s, name, **labels) for s in samples)
                 for what, name, labels in (
                     ("queued", "gateway_admission_decisions_total", {"decision": "queued"}),
                     ("rejected", "gateway_admission_decisions_total", {"decision": "rejected"}),
                     ("upstream errors", "gateway_upstream_errors_total", {}),
                     ("state errors", "gateway_state_errors_total", {}),
                     ("quota rejections", "gateway_quota_rejections_total",
                      {"tenant": QUOTA_TENANT}),
                     ("tenant tokens", "gateway_tokens_total", {"tenant": QUOTA_TENANT}),
                     ("tenant spend", "gateway_tenant_cost_total", {"tenant": QUOTA_TENANT}))}
        assert all(total.values()), f"the load did not cause everything: {total}, {outcomes}"
        assert outcomes.get("503") and outcomes.get("429"), outcomes

        wait_for(prom, 'up{job="engines", backend="e1"} == 0', "e1 down")
        # The series exist from 0, so wait for errors counted by both replicas.
        wait_for(prom, "count(sum by (instance) (gateway_state_errors_total) > 0) == 2",
                 "state errors on both replicas")
        # Every replica, not just the first to notice: the alert takes the max over replicas.
        wait_for(prom, 'max(gateway_backend_up{backend="e1"}) == 0', "e1 out of rotation")
        gw0 = gateways[0]
        wait_for(prom, f'gateway_policy_reloads_total{{result="invalid", '
                 f'instance="127.0.0.1:{gw0.port}"}} == 1', "the refused reload")

        # Every panel: parses and returns data with at least one number in it.
        empty = []
        for title, expr in dashboard_queries():
            result = series(prom, expr)
            if not any(math.isfinite(float(r["value"][1])) for r in result):
                empty.append(f"{title}: {expr} -> {result}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
        pools = series(prom, "group by (pool) (gateway_kv_blocks_capacity)")
        assert {r["metric"]["pool"] for r in pools} == {"default", "long"}  # $pool's values

        # Every rule: parses, and Prometheus itself evaluates it without error.
        for rule in rules():
            series(prom, rule["expr"])
        deadline = time.monotonic() + 10
        while True:
            loaded = [r for g in http("GET", prom.url + "/api/v1/rules").json()["data"]["groups"]
                      for r in g["rules"]]
            if len(loaded) == len(rules()) and all(r["health"] == "ok" for r in loaded):
                break
            assert time.monotonic() < deadline, [(r["name"], r["health"], r.get("lastError"))
                                                  for r in loaded]
            time.sleep(0.5)

        # The alerts for what broke match now (they fire once their `for:` has passed).
        alerts = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
        assert [r["metric"]["backend"] for r in series(prom, alerts["GatewayBackendDown"])] \
            == ["e1"]
        assert [r["metric"]["backend"] for r in series(prom, alerts["EngineMetricsStale"])] \
            == ["e1"]
        instances = sorted(f"127.0.0.1:{gw.port}" for gw in gateways)
        # Redis is dead: both replicas fail on it, and keep failing (the page).
        assert sorted({r["metric"]["instance"] for r in
                       series(prom, alerts["GatewayStateBackendErrors"])}) == instances
        assert sorted(r["metric"]["instance"] for r in
                      series(prom, alerts["GatewayStateBackendDown"])) == instances
        assert [r["metric"]["pool"] for r in series(prom, alerts["GatewaySustainedRejections"])] \
            == ["default"]
        assert [r["metric"]["instance"] for r in
                series(prom, alerts["GatewayPolicyReloadFailed"])] == [f"127.0.0.1:{gw0.port}"]
        assert not series(prom, alerts["GatewayPoolWithoutBackends"])
        assert not series(prom, alerts["GatewayReplicaDown"])
        assert not series(prom, alerts["EngineMetricsMissing"])
        # The SLO alerts compare against the policy's targets: with the threshold at 0 they
        # match every pool that has a target and traffic, and only those (`long` has none).
        for name in ("GatewayTTFTOverSLO", "GatewayTPOTOverSLO"):
            assert "> on (pool) max by (pool) (gateway_slo_target_seconds" in alerts[name]
            at_zero = alerts[name].replace("> on (pool)", "> on (pool) 0 *")
            assert [r["metric"]["pool"] for r in series(prom, at_zero)] == ["default"], name
