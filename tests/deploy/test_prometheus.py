"""A real Prometheus (Debian's package, installed by .ci/run) against the deployment files and a live
server: promtool checks the config, the alerts (with their unit tests) and the server's /metrics; a
Prometheus process scrapes a server on loopback every second and its query API returns the request counter
and answers every query of the Grafana dashboard. Bounded: DEADLINE_S for the live test, its own port,
config and storage folder; the process is killed in a finally. Skipped, with the reason, where the
prometheus and promtool binaries are absent."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from server.settings import Settings
from tests.deploy.tools import ALERTS, DASHBOARD, PROMETHEUS_CONFIG, PROMETHEUS_MISSING, run_tool
from tests.server.checkpoints import LANGUAGE_MODELS, TRANSDUCERS, write_checkpoints
from tests.server.live import serve

pytestmark = PROMETHEUS_MISSING

DEADLINE_S = 60.0
TRANSDUCE_REQUESTS = 3
GENERATE_REQUESTS = 2  # the same long prompt twice: the second finds it in the state cache
PROMPT = "The state cache keeps this prompt's recurrent state."  # longer than state_cache_min_tokens


def test_promtool_accepts_the_config_and_its_alerts() -> None:
    result = run_tool("promtool", "check", "config", PROMETHEUS_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout
    result = run_tool("promtool", "check", "rules", ALERTS)
    assert result.returncode == 0 and "SUCCESS: 3 rules found" in result.stdout, result.stdout + result.stderr


def test_alerts_fire_as_their_unit_tests_expect() -> None:
    result = run_tool("promtool", "test", "rules", Path(__file__).with_name("alerts_test.yml"))
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        pytest.fail(f"the Prometheus test ran past its {DEADLINE_S:.0f} s bound")
    return left


@contextmanager
def prometheus(target: str, folder: Path, deadline: float) -> Iterator[str]:
    """A Prometheus scraping ``target`` (host:port) every second; yields its URL once it is ready."""
    config = folder / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: regularlm\n    static_configs:\n      - targets: ['{target}']\n"
    )
    address = f"127.0.0.1:{free_port()}"
    log = (folder / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            shutil.which("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={address}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=folder,
    )
    url = f"http://{address}"
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"prometheus exited with {process.returncode}: {(folder / 'prometheus.log').read_text()}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            remaining(deadline)
            time.sleep(0.1)
        yield url
    finally:
        process.kill()
        process.wait(timeout=10)
        log.close()


def query(url: str, expression: str) -> list[dict]:
    """The result vector of an instant query; fails on any error of the query API."""
    response = httpx.get(f"{url}/api/v1/query", params={"query": expression}, timeout=5.0)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expression, body)
    assert body["data"]["resultType"] == "vector"
    return body["data"]["result"]


def wait_for(url: str, expression: str, accept, deadline: float) -> list[dict]:
    while True:
        result = query(url, expression)
        if accept(result):
            return result
        remaining(deadline)
        time.sleep(0.2)


def grafana_to_promql(expression: str) -> str:
    """What Grafana sends for the dashboard's variables: every model, and a rate window that spans the whole test
    (DEADLINE_S), so that on a loaded machine, where the second round of requests and the panels' queries take
    longer, the window cannot slide past the round's observations (a 10 s window gave a panel NaN once, at load 5)."""
    return expression.replace("$__rate_interval", f"{DEADLINE_S:.0f}s").replace('"$model"', '".*"')


def send_requests(server_url: str) -> None:
    with httpx.Client(base_url=server_url, timeout=30.0) as client:
        for index in range(TRANSDUCE_REQUESTS):
            response = client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0110" * (index + 1)]})
            assert response.status_code == 200, response.text
        for _ in range(GENERATE_REQUESTS):
            body = {"model": "text-lrnn", "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
            response = client.post("/v1/generate", json=body)
            assert response.status_code == 200, response.text


def is_number(value: str) -> bool:
    return value not in ("NaN", "+Inf", "-Inf")


def test_promtool_lints_the_live_metrics_and_prometheus_scrapes_them(tmp_path: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    settings = Settings(
        models=write_checkpoints(tmp_path / "checkpoints"), shipped_models=False, device="cpu", torch_threads=1
    )
    with serve(settings) as server:
        send_requests(server.url)  # before the first scrape: every series exists from then on
        exposition = httpx.get(f"{server.url}/metrics", timeout=5.0).text

        # promtool parses and lints the exposition: no problem at all (names without ':', units, suffixes)
        lint = run_tool("promtool", "check", "metrics", stdin=exposition)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        assert not (lint.stdout + lint.stderr).strip(), lint.stdout + lint.stderr

        (tmp_path / "prometheus").mkdir()
        with prometheus(server.url.removeprefix("http://"), tmp_path / "prometheus", deadline) as url:
            counter = 'sum(regularlm_request_success_total{job="regularlm"})'
            per_round = TRANSDUCE_REQUESTS + GENERATE_REQUESTS
            wait_for(url, counter, lambda result: result and float(result[0]["value"][1]) == per_round, deadline)
            send_requests(server.url)  # between scrapes this time, so that rates and quantiles move
            wait_for(url, counter, lambda result: float(result[0]["value"][1]) == 2 * per_round, deadline)
            by_model = query(url, "sum by (model_name) (regularlm_request_success_total)")
            counts = {item["metric"]["model_name"]: float(item["value"][1]) for item in by_model}
            assert {model: count for model, count in counts.items() if count} == {
                "parity-lrnn": 2 * TRANSDUCE_REQUESTS,
                "text-lrnn": 2 * GENERATE_REQUESTS,
            }
            assert set(counts) == set(TRANSDUCERS) | set(LANGUAGE_MODELS)  # every model's series, at 0 from load
            assert [item["value"][1] for item in query(url, 'up{job="regularlm"}')] == ["1"]

            # every dashboard query is valid PromQL for a real Prometheus, and each panel shows a number
            panels = json.loads(DASHBOARD.read_text())["panels"]
            request_rate = grafana_to_promql(panels[0]["targets"][0]["expr"])
            wait_for(url, request_rate, lambda result: any(float(item["value"][1]) > 0 for item in result), deadline)
            for panel in panels:
                values = [
                    item["value"][1]
                    for target in panel["targets"]
                    for item in query(url, grafana_to_promql(target["expr"]))
                ]
                assert any(map(is_number, values)), f"panel {panel['title']!r}: {values}"
