"""deploy/k8s/ against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict: unknown fields are
errors; schemas bundled, no cluster, no network) and how the objects refer to one another: selectors,
ports, probes, the autoscaler's target, the ServiceMonitor (a CRD the bundled schemas do not cover)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.settings import Settings
from tests.deploy.tools import K8S, load_yaml, run_tool

MANIFESTS = sorted(K8S.rglob("*.yaml"))
CORE_MANIFESTS = [path for path in MANIFESTS if load_yaml(path)["kind"] != "ServiceMonitor"]
OLDEST_KUBERNETES = "1.27.0"  # the oldest release the manifests are checked against


def objects(kind: str) -> list[dict]:
    return [document for document in map(load_yaml, MANIFESTS) if document["kind"] == kind]


def test_the_manifests_are_the_documented_set() -> None:
    kinds = sorted(load_yaml(path)["kind"] for path in MANIFESTS)
    expected = ["Deployment", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]
    assert kinds == sorted([*expected, "ServiceMonitor"])


@pytest.mark.parametrize("version", [None, OLDEST_KUBERNETES], ids=["newest", OLDEST_KUBERNETES])
def test_core_manifests_validate_strictly(version: str | None) -> None:
    versions = [] if version is None else ["--kubernetes-version", version]
    result = run_tool("kubernetes-validate", "--strict", *versions, *CORE_MANIFESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") == len(CORE_MANIFESTS)


def test_strict_validation_rejects_a_misspelt_field(tmp_path: Path) -> None:
    bad = tmp_path / "deployment.yaml"
    bad.write_text((K8S / "deployment.yaml").read_text().replace("failureThreshold: 3", "failureTreshold: 3"))
    result = run_tool("kubernetes-validate", "--strict", bad)
    assert result.returncode == 1 and "failureTreshold" in result.stdout + result.stderr


def server_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("deployment", objects("Deployment"), ids=lambda document: document["metadata"]["name"])
def test_deployment_probes_health_and_drains_within_its_grace_period(deployment: dict) -> None:
    pod = deployment["spec"]["template"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    container = server_container(deployment)
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert {"requests", "limits"} <= container["resources"].keys()
    environment = {variable["name"]: variable for variable in container["env"]}
    settings = {name.removeprefix("REGULARLM_").lower() for name in environment if name.startswith("REGULARLM_")}
    assert settings <= set(Settings.model_fields)
    drain_s = float(environment["REGULARLM_DRAIN_TIMEOUT_S"]["value"])
    pre_stop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    # past the drain the server answers 503 and exits within 5 s (server/__main__.py)
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop_s + drain_s + 5
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001  # the image's user
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_gpu_variant_asks_for_a_gpu_and_runs_on_cuda() -> None:
    gpu = next(item for item in objects("Deployment") if item["metadata"]["name"] == "regularlm-gpu")
    container = server_container(gpu)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "REGULARLM_DEVICE", "value": "cuda"} in container["env"]
    assert container["image"] == "regularlm:cuda"


def test_service_pdb_and_servicemonitor_select_every_server_pod() -> None:
    (service,) = objects("Service")
    (budget,) = objects("PodDisruptionBudget")
    (monitor,) = objects("ServiceMonitor")
    for deployment in objects("Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(service["spec"]["selector"], labels)
        assert selects(budget["spec"]["selector"]["matchLabels"], labels)
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert service["spec"]["sessionAffinity"] == "ClientIP"  # the state cache is per pod
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"


def test_autoscaler_targets_the_cpu_deployment() -> None:
    (autoscaler,) = objects("HorizontalPodAutoscaler")
    target = autoscaler["spec"]["scaleTargetRef"]
    cpu = next(item for item in objects("Deployment") if item["metadata"]["name"] == target["name"])
    assert target["kind"] == "Deployment" and "replicas" not in cpu["spec"]  # the autoscaler owns the count
    assert 1 <= autoscaler["spec"]["minReplicas"] < autoscaler["spec"]["maxReplicas"]
    assert "cpu" in server_container(cpu)["resources"]["requests"]  # utilization is relative to the request
