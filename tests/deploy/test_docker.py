"""The Dockerfiles without a Docker engine: hadolint, what each stage copies against .dockerignore, the
runtime stage's user, health check, models volume and entry point, and deploy/healthcheck.py against a
live server."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from server.settings import Settings
from tests.deploy.tools import DEPLOY, DOCKERFILES, REPO, run_tool
from tests.server.checkpoints import write_checkpoints
from tests.server.live import serve


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = run_tool("hadolint", "--no-color", dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install torch\n")
    result = run_tool("hadolint", "--no-color", bad)
    assert result.returncode == 1
    assert {"DL3007", "DL3003", "DL3013"} <= set(re.findall(r"DL\d{4}", result.stdout))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1]) for line in lines]


def last_stage(dockerfile: Path) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    start = max(index for index, (name, _) in enumerate(steps) if name == "FROM")
    return steps[start:]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_runtime_stage_runs_the_server_as_a_user_with_models_and_a_health_check(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    assert sum(name == "FROM" for name, _ in steps) >= 2  # multi-stage
    runtime = dict(last_stage(dockerfile))
    assert runtime["USER"] == "10001:10001"
    assert runtime["ENTRYPOINT"] == '["python", "-m", "server"]'
    assert runtime["HEALTHCHECK"].endswith('CMD ["python", "/app/healthcheck.py"]')
    assert runtime["VOLUME"] == '["/models"]'
    assert runtime["EXPOSE"] == "8000"
    copies = [arguments for name, arguments in last_stage(dockerfile) if name == "COPY"]
    assert "checkpoints/ /models/" in copies and "deploy/healthcheck.py /app/healthcheck.py" in copies
    environment = dict(re.findall(r"(REGULARLM_\w+)=(\S+)", runtime["ENV"]))
    assert environment["REGULARLM_MODELS"] == "/models" and environment["REGULARLM_HOST"] == "0.0.0.0"
    assert environment["REGULARLM_SHIPPED_MODELS"] == "false"  # /models holds them: not the package's (none there)
    assert {name.removeprefix("REGULARLM_").lower() for name in environment} <= set(Settings.model_fields)


def test_cpu_image_takes_torch_from_the_cpu_index_and_the_cuda_image_from_a_cuda_base() -> None:
    cpu, cuda = (dict(instructions(path)) for path in DOCKERFILES)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in DOCKERFILES[0].read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:[\d.]+-runtime-", DOCKERFILES[1].read_text(), re.MULTILINE)
    assert "REGULARLM_DEVICE=cpu" in cpu["ENV"] and "REGULARLM_DEVICE=cuda" in cuda["ENV"]


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: index + 1]) for index in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        regex = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex.replace(r"\?", "[^/]"), candidate) for candidate in candidates):
            excluded = not negated
    return excluded


def build_context_sources() -> set[str]:
    sources = set()
    for dockerfile in DOCKERFILES:
        for name, arguments in instructions(dockerfile):
            if name == "COPY" and not arguments.startswith("--from"):
                sources.update(source.rstrip("/") for source in arguments.split()[:-1])
    return sources


def test_every_file_the_images_copy_is_in_the_build_context() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in patterns if line and not line.startswith("#")]
    sources = build_context_sources()
    copied = {"pyproject.toml", "README.md", "model", "automata", "server", "training", "clients", "checkpoints"}
    assert copied <= sources
    for source in sources:
        root = REPO / source
        files = [root] if root.is_file() else [path for path in root.rglob("*") if path.is_file()]
        assert files, f"COPY {source}: nothing there"
        for file in files:
            relative = file.relative_to(REPO).as_posix()
            if "__pycache__" not in relative and not relative.endswith(".pyc"):
                assert not dockerignore_excludes(relative, patterns), f"{relative} is copied but .dockerignore drops it"
    for left_out in (".git/HEAD", "runs/x", "tests/__init__.py", "docs/benchmarks.md", "server/__pycache__/a.pyc"):
        assert dockerignore_excludes(left_out, patterns), left_out


def healthcheck(port: int) -> subprocess.CompletedProcess:
    environment = {**os.environ, "REGULARLM_PORT": str(port)}
    command = [sys.executable, str(DEPLOY / "healthcheck.py")]
    return subprocess.run(command, check=False, env=environment, capture_output=True, text=True, timeout=30)


def test_healthcheck_is_healthy_while_serving_and_not_while_draining(tmp_path: Path) -> None:
    settings = Settings(models=write_checkpoints(tmp_path), shipped_models=False, device="cpu", torch_threads=1)
    with serve(settings) as live:
        port = int(live.url.rsplit(":", 1)[1])
        assert healthcheck(port).returncode == 0
        live.engine.begin_drain()  # what SIGTERM does first: /health answers 503
        result = healthcheck(port)
    assert result.returncode == 1 and "503" in result.stderr


def test_healthcheck_fails_when_nothing_listens() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        result = healthcheck(port)
    assert result.returncode == 1 and "refused" in result.stderr.lower()
