"""The dashboards and alerts, proven against a real Prometheus (Debian's package).

Prometheus scrapes two gateway replicas (sharing a Redis) and three simulated engines on
loopback every second, with deploy/prometheus/alerts.yml loaded, and three static engine pages
the simulator does not make: SGLang's names (two DP groups of two TP ranks), a vLLM before 0.9
(the old KV-usage name alone), and an engine whose KV-usage series is gone. A short load
drives the engines into queueing and rejections, and one tenant over its token quota; then one
engine first fails and is then killed, Redis is killed, and one replica is sent a broken policy
to reload. Every dashboard panel's query must then parse and return data (the engine panels for
every engine kind), every rule must parse and evaluate, the alerts for what broke must match
and no others, the renamed gateway metrics' old names must still be served with the same
samples, and the prometheus-adapter rule behind the Kubernetes autoscaler must find its series.

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
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe.metrics import DEPRECATED_NAMES
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
ADAPTER = ROOT / "deploy" / "k8s" / "prometheus-adapter-values.yaml"
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
    return declared_names(http("GET", url + "/metrics").body.decode())


def declared_names(page: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(page):
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
                        "(0 * max by (pool) (gateway_kv_capacity_blocks) + 2)") \
        == {"gateway_kv_capacity_blocks"}
    assert metric_names('sum by (pool, backend) (max by (pool, backend, dp_rank) '
                        '(rate(sglang:num_retracted_requests_total{job="engines"}[1m])))') \
        == {"sglang:num_retracted_requests_total"}


# --- engines the simulator is not ---------------------------------------------------------


def engine_page(families: list[tuple[str, str, list[tuple[dict[str, str], float]]]]) -> str:
    """Prometheus text as prometheus_client writes it (counters named with `_total`)."""
    lines = []
    for name, kind, samples in families:
        full = name + "_total" if kind == "counter" else name
        lines += [f"# HELP {full} {name}.", f"# TYPE {full} {kind}"]
        for labels, value in samples:
            text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{full}{{{text}}} {value}")
    return "\n".join(lines) + "\n"


def sglang_ranks(per_group: dict[str, float]) -> list[tuple[dict[str, str], float]]:
    """One series per scheduler: two DP groups, each of two TP ranks reporting the group's
    value (--enable-metrics-for-all-schedulers), as SGLang labels them."""
    return [({"model_name": "m", "engine_type": "unified", "tp_rank": tp, "pp_rank": "0",
              "dp_rank": dp, "moe_ep_rank": "0"}, per_group[dp])
            for dp in ("0", "1") for tp in ("0", "1")]


# SGLang (python/sglang/srt/metrics/collector.py): its names, ranks per DP group. What the
# panels must read: waiting 3 + 2 (not 10: TP ranks repeat their group's), running 4 + 2, the
# fullest rank's usage 0.4.
SGLANG_PAGE = engine_page([
    ("sglang:num_running_reqs", "gauge", sglang_ranks({"0": 4, "1": 2})),
    ("sglang:num_queue_reqs", "gauge", sglang_ranks({"0": 3, "1": 2})),
    ("sglang:token_usage", "gauge", sglang_ranks({"0": 0.4, "1": 0.2})),
    ("sglang:max_total_num_tokens", "gauge", sglang_ranks({"0": 100000, "1": 100000})),
    ("sglang:num_retracted_requests", "counter", sglang_ranks({"0": 7, "1": 0}))])
SGLANG_WANT = {"sglang:num_queue_reqs": 5.0, "sglang:num_running_reqs": 6.0,
               "sglang:token_usage": 0.4}
# vLLM before 0.9 (V0, 0.8): the KV-usage gauge under its old name alone.
VLLM_OLD_PAGE = engine_page([
    (f"vllm:{name}", "gauge", [({"model_name": "m"}, value)]) for name, value in (
        ("num_requests_running", 1), ("num_requests_waiting", 0),
        ("gpu_cache_usage_perc", 0.3))] + [
    ("vllm:num_preemptions", "counter", [({"model_name": "m"}, 0)])])
# An engine that answers, its KV usage gone (a rename admission does not know yet).
NO_KV_PAGE = engine_page([
    (f"vllm:{name}", "gauge", [({"model_name": "m"}, 0)])
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio")])
# llama.cpp's server --metrics (tools/server/server-task.cpp, to_metrics): no KV series at all
# (its slots come from /props), unlabelled gauges; not an engine without metrics.
LLAMACPP_PAGE = engine_page([
    (f"llamacpp:{name}", "gauge", [({}, value)]) for name, value in (
        ("requests_processing", 3), ("requests_deferred", 0), ("n_busy_slots_per_decode", 2.5))])
STATIC_ENGINES = {"sg-0": SGLANG_PAGE, "vllm-old-0": VLLM_OLD_PAGE, "no-kv-0": NO_KV_PAGE,
                  "llama-0": LLAMACPP_PAGE}


@contextlib.contextmanager
def static_pages(pages: dict[str, str]) -> Iterator[dict[str, str]]:
    """A loopback server for each page, serving it at any path; name -> its host:port."""
    servers = {}
    for name, page in pages.items():
        body = page.encode()

        class Page(BaseHTTPRequestHandler):
            def do_GET(self, body: bytes = body) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[name] = server
    try:
        yield {name: f"127.0.0.1:{srv.server_address[1]}" for name, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.shutdown()
            srv.server_close()


# --- servers ------------------------------------------------------------------------------


def prometheus_config(tmp_path: Path, gateways: list[Server],
                      engines: dict[tuple[str, str], Server], static: dict[str, str]) -> Path:
    """deploy/prometheus/prometheus.yml with loopback targets and a 1 s cadence; the gateways
    labelled with a namespace and pod as a ServiceMonitor's scrape labels them in Kubernetes
    (for the prometheus-adapter rule)."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s",
                        "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROM_DIR / f) for f in config["rule_files"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["gateway"]["static_configs"] = [
        {"targets": [f"127.0.0.1:{gw.port}"], "labels": {"namespace": "llm", "pod": f"gw-{i}"}}
        for i, gw in enumerate(gateways)]
    jobs["engines"]["static_configs"] = [
        {"targets": [f"127.0.0.1:{sim.port}"], "labels": {"pool": pool, "backend": backend}}
        for (pool, backend), sim in engines.items()] + [
        {"targets": [address], "labels": {"pool": "default", "backend": backend}}
        for backend, address in static.items()]
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
        static = stack.enter_context(static_pages(STATIC_ENGINES))
        config = prometheus_config(tmp_path, gateways, engines, static)
        prom = stack.enter_context(run_server(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             "--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            "/-/ready", tmp_path, "prometheus"))

        # Names first: every metric a panel or rule reads is one the gateway or an engine
        # exports, Prometheus's own `up`, or a recording rule of ours.
        recorded = {r["record"] for r in rules() if "record" in r}
        known = (exported_names(gateways[0].url) | exported_names(e0.url) | {"up"} | recorded
                 | {n for page in STATIC_ENGINES.values() for n in declared_names(page)})
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
        for gw in gateways:
            page = http("GET", gw.url + "/metrics").body.decode()
            assert_deprecated_aliases(page)
            assert "_created" not in page  # prometheus_client's, switched off
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
        for backend in STATIC_ENGINES:
            wait_for(prom, f'up{{job="engines", backend="{backend}"}} == 1', backend)
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
        # $pool's values, by the variable's own query.
        (pool_var,) = [v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]
                       if v["name"] == "pool"]
        over = re.fullmatch(r"label_values\((\w+), pool\)", pool_var["definition"])
        assert over, pool_var["definition"]
        pools = series(prom, f"group by (pool) ({over.group(1)})")
        assert {r["metric"]["pool"] for r in pools} == {"default", "long"}

        # Engine panels: every engine kind, each read as the gateway reads it.
        engine_queries = [(t, e) for t, e in dashboard_queries() if "vllm:" in e]
        assert len(engine_queries) == 4, engine_queries
        for title, expr in engine_queries:
            assert "sglang:" in expr, f"{title}: vLLM's names only: {expr}"
            got = {r["metric"]["backend"]: float(r["value"][1]) for r in series(prom, expr)}
            assert {"e0", "long-0", "sg-0", "vllm-old-0"} <= set(got), (title, expr, got)
            for name, want in SGLANG_WANT.items():
                if name in expr:
                    assert got["sg-0"] == want, (title, expr, got)
        usage = next(e for _, e in engine_queries if "gpu_cache_usage_perc" in e)
        assert {r["metric"]["backend"]: float(r["value"][1]) for r in series(prom, usage)
                if r["metric"]["backend"] == "vllm-old-0"} == {"vllm-old-0": 0.3}

        # Money panels keep the currency, so no two currencies are added up.
        for title, expr in dashboard_queries():
            if re.search(r"gateway_(cost|tenant_cost)_", expr):
                assert all(r["metric"].get("currency") == "USD" for r in series(prom, expr)), \
                    (title, expr)

        check_adapter_rule(prom, [f"gw-{i}" for i in range(len(gateways))])

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
        # Only the engine without any KV-usage name: not SGLang's, not an old vLLM's (a
        # vLLM-only rule matched both of them for ever), not llama.cpp's (it has none).
        assert [r["metric"]["backend"] for r in series(prom, alerts["EngineMetricsMissing"])] \
            == ["no-kv-0"]
        vllm_only = 'up{job="engines"} == 1 unless on (pool, backend) vllm:kv_cache_usage_perc'
        assert sorted(r["metric"]["backend"] for r in series(prom, vllm_only)) \
            == ["llama-0", "no-kv-0", "sg-0", "vllm-old-0"]
        # The SLO alerts compare against the policy's targets: with the threshold at 0 they
        # match every pool that has a target and traffic, and only those (`long` has none).
        for name in ("GatewayTTFTOverSLO", "GatewayTPOTOverSLO"):
            assert "> on (pool) max by (pool) (gateway_slo_target_seconds" in alerts[name]
            at_zero = alerts[name].replace("> on (pool)", "> on (pool) 0 *")
            assert [r["metric"]["pool"] for r in series(prom, at_zero)] == ["default"], name
        checked = {"GatewayBackendDown", "EngineMetricsStale", "GatewayStateBackendErrors",
                   "GatewayStateBackendDown", "GatewaySustainedRejections",
                   "GatewayPolicyReloadFailed", "GatewayPoolWithoutBackends",
                   "GatewayReplicaDown", "EngineMetricsMissing", "GatewayTTFTOverSLO",
                   "GatewayTPOTOverSLO"}
        assert set(alerts) == checked, f"say whether these should match: {set(alerts) - checked}"


def assert_deprecated_aliases(page: str) -> None:
    """Each renamed metric's old name is served beside the new one for a release: the same
    samples, its HELP saying what to use instead."""
    families = {f.name: f for f in text_string_to_metric_families(page)}
    for new, old in DEPRECATED_NAMES.items():
        assert families[old].documentation.startswith(f"Deprecated: use {new}."), old
        assert families[old].type == families[new].type
        assert sorted((tuple(sorted(s.labels.items())), s.value)
                      for s in families[old].samples) == \
            sorted((tuple(sorted(s.labels.items())), s.value) for s in families[new].samples)
    assert families["gateway_kv_capacity_blocks"].samples, "no samples to compare"


def check_adapter_rule(prom: Server, pods: list[str]) -> None:
    """prometheus-adapter's rule for the autoscaler, as the adapter runs it: its seriesQuery
    finds the gateways' series, and its metricsQuery, with the templates filled in the way
    the adapter fills them for the HPA's pods, gives one value per pod."""
    (rule,) = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    url = prom.url + "/api/v1/series?" + urllib.parse.urlencode({"match[]": rule["seriesQuery"]})
    found = http("GET", url).json()["data"]
    assert {s["pod"] for s in found} == set(pods), found
    assert {s["__name__"] for s in found} == {rule["name"]["as"]}
    expr = (rule["metricsQuery"].replace("<<.Series>>", rule["name"]["as"])
            .replace("<<.LabelMatchers>>", f'namespace="llm",pod=~"{"|".join(pods)}"')
            .replace("<<.GroupBy>>", "pod"))
    got = series(prom, expr)
    assert sorted(r["metric"]["pod"] for r in got) == sorted(pods), (expr, got)
    assert all(math.isfinite(float(r["value"][1])) for r in got)


def test_money_carries_the_pools_currency() -> None:
    """The cost panels group by `currency`: each money series has the pool's `cost.currency`
    (callers pass the other labels only), and a reload that reprices a pool in another
    currency drops its series in the old one, which would otherwise stay beside the new."""
    from gateway.observe.accounting import Accountant
    from gateway.observe.metrics import GatewayMetrics
    from gateway.policy import parse_policy

    def priced(currency: str) -> str:
        return policy_yaml(["http://127.0.0.1:9"], pool_extra="    cost: {gpu_hour: 2.0, "
                           f"currency: {currency}}}\n", long_backends=["http://127.0.0.1:9"])

    def money(m: GatewayMetrics) -> dict[tuple[str, str], set[str]]:
        out: dict[tuple[str, str], set[str]] = {}
        for family in m.registry.collect():
            for sample in family.samples:
                if "currency" in sample.labels:
                    out.setdefault((sample.name, sample.labels["pool"]), set()).add(
                        sample.labels["currency"])
        return out

    m = GatewayMetrics()
    eur = parse_policy(priced("EUR"))
    m.publish_policy(eur)
    Accountant(eur, m)
    m.tenant_cost.labels("t", "default").inc(1.5)
    m.tenant_cost.labels("t", "long").inc(0)  # a pool without `cost`: the default currency
    assert money(m) == {("gateway_cost_per_hour", "default"): {"EUR"},
                        ("gateway_tenant_cost_total", "default"): {"EUR"},
                        ("gateway_tenant_cost_total", "long"): {"USD"}}
    usd = parse_policy(priced("USD"))
    m.publish_policy(usd)
    Accountant(usd, m)
    assert money(m) == {("gateway_cost_per_hour", "default"): {"USD"},
                        ("gateway_tenant_cost_total", "long"): {"USD"}}
    # Priced in EUR again: its removed series is made anew, not the old child written to
    # unseen (the request path binds children once: gateway/observe/children.py).
    m.publish_policy(eur)
    Accountant(eur, m)
    m.tenant_cost.labels("t", "default").inc(2.0)
    assert ("gateway_tenant_cost_total", "default") in money(m)
    assert m.registry.get_sample_value(
        "gateway_tenant_cost_total", {"tenant": "t", "pool": "default", "currency": "EUR"}) == 2.0


def test_deprecated_aliases_under_workers(tmp_path: Path) -> None:
    """Under `--workers N` /metrics renders the merged multiprocess files, not the app's own
    registry: the old names must be served there too. A fresh interpreter, because
    prometheus_client picks its multiprocess value class at import."""
    script = (
        "from prometheus_client import generate_latest\n"
        "from gateway.observe.metrics import GatewayMetrics, exposition_registry\n"
        "m = GatewayMetrics()\n"
        "m.kv_blocks_capacity.labels('default', 'e0').set(64)\n"
        "m.queue_depth.labels('default', 'normal').set(2)\n"
        "m.prefill_tokens_pending.labels('default', 'e0').set(10)\n"
        "m.kv_blocks_reserved.labels('default', 'e0').set(5)\n"
        "registry = exposition_registry(m.registry)\n"
        "assert registry is not m.registry, 'not the merged files'\n"
        "print(generate_latest(registry).decode())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT,
                         env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.glob("gauge_live*.db")), "no worker files merged"
    assert_deprecated_aliases(out.stdout)
