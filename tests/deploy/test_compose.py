"""deploy/docker-compose*.yml against the Compose Specification's JSON schema (vendored in check-jsonschema,
no network), and what the files point at: build files, mounted folders, the scrape target, the Grafana
data source and dashboard folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.settings import Settings
from tests.deploy.tools import COMPOSE_FILES, DASHBOARD, DEPLOY, PROMETHEUS_CONFIG, load_yaml, run_tool

GRAFANA = DEPLOY / "grafana"


@pytest.mark.parametrize("compose_file", COMPOSE_FILES, ids=lambda path: path.name)
def test_compose_file_is_valid_against_the_compose_spec(compose_file: Path) -> None:
    result = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", compose_file)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_rejects_an_unknown_key(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE_FILES[0].read_text().replace("stop_grace_period:", "stop_grace_perod:"))
    result = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", bad)
    assert result.returncode == 1 and "stop_grace_perod" in result.stdout


def host_path(volume: str) -> Path:
    """The host side of a "HOST:CONTAINER[:MODE]" bind mount, with ${VAR:-default} at its default."""
    host = volume.split(":/", 1)[0]
    if host.startswith("${"):
        host = host.split(":-", 1)[1].rstrip("}")
    return (DEPLOY / host).resolve()


def test_compose_builds_and_mounts_what_the_repository_has() -> None:
    services = load_yaml(COMPOSE_FILES[0])["services"]
    build = services["regularlm"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert (context / build["dockerfile"]).is_file()
    gpu_build = load_yaml(COMPOSE_FILES[1])["services"]["regularlm"]["build"]
    assert (context / gpu_build["dockerfile"]).is_file()
    mounts = [volume for service in services.values() for volume in service.get("volumes", []) if ":/" in volume]
    bind_mounts = [volume for volume in mounts if volume.startswith((".", "$"))]
    assert len(bind_mounts) == 4
    for volume in bind_mounts:
        assert host_path(volume).exists(), volume
    assert host_path(services["regularlm"]["volumes"][0]) == (DEPLOY.parent / "checkpoints").resolve()
    environment = services["regularlm"]["environment"]
    assert {name.removeprefix("REGULARLM_").lower() for name in environment} <= set(Settings.model_fields)


def test_prometheus_scrapes_the_compose_service() -> None:
    services = load_yaml(COMPOSE_FILES[0])["services"]
    (job,) = load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["regularlm:8000"]}]
    assert "8000:8000" in services["regularlm"]["ports"]  # the image's REGULARLM_PORT
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


def test_grafana_provisions_the_data_source_and_dashboard_the_dashboard_uses() -> None:
    grafana = load_yaml(COMPOSE_FILES[0])["services"]["grafana"]
    (source,) = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    (provider,) = load_yaml(GRAFANA / "provisioning" / "dashboards" / "regularlm.yml")["providers"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    dashboard = json.loads(DASHBOARD.read_text())
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    used = {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    used |= {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert used == {source["uid"]}
