"""The Grafana dashboard and the alerts use only series the server exposes, and the dashboard has the panels
REQUIRED_PANELS names (docs/deploy.md's table). (test_prometheus.py runs every query against a real Prometheus.)"""

from __future__ import annotations

import json

from tests.deploy.metric_names import exposed_series, referenced_series, series_at_load
from tests.deploy.tools import ALERTS, DASHBOARD, load_yaml

REQUIRED_PANELS = {  # title -> a series its queries must read
    "Request rate": "regularlm_request_success_total",
    "End-to-end latency p50 / p99": "regularlm_e2e_request_latency_seconds_bucket",
    "Time to first token p50 / p99": "regularlm_time_to_first_token_seconds_bucket",
    "Time per output token p50 / p99": "regularlm_time_per_output_token_seconds_bucket",
    "Queue": "regularlm_num_requests_waiting",
    "Tokens per second": "regularlm_generation_tokens_total",
    "State-cache hit rate": "regularlm_prefix_cache_hits_total",
}


def dashboard_queries() -> dict[str, list[str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {panel["title"]: [target["expr"] for target in panel["targets"]] for panel in panels}


def test_dashboard_has_the_documented_panels() -> None:
    queries = dashboard_queries()
    for title, series in REQUIRED_PANELS.items():
        assert any(series in referenced_series(expression) for expression in queries[title]), title
    for title in [title for title in queries if "p50 / p99" in title]:
        assert [expression.split(",")[0] for expression in queries[title]] == [
            "histogram_quantile(0.5",
            "histogram_quantile(0.99",
        ]


def test_dashboard_and_alerts_read_only_exposed_series() -> None:
    exposed = exposed_series()
    expressions = [expression for group in dashboard_queries().values() for expression in group]
    expressions += [rule["expr"] for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]
    for expression in expressions:
        referenced = referenced_series(expression)
        assert referenced - exposed == set(), expression
    dashboard = json.loads(DASHBOARD.read_text())
    (variable,) = dashboard["templating"]["list"]
    assert referenced_series(variable["definition"]) <= exposed


def test_what_the_alerts_and_panels_read_exists_at_0_from_load_except_histograms() -> None:
    """The model list, the alerts and every counter and gauge a panel reads have a series before the first
    request; a histogram appears with its model's first observation (at 0 its quantiles are NaN anyway)."""
    expressions = [expression for group in dashboard_queries().values() for expression in group]
    expressions += [rule["expr"] for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]
    (variable,) = json.loads(DASHBOARD.read_text())["templating"]["list"]
    read = set().union(*map(referenced_series, [*expressions, variable["definition"]]))
    histograms = {name for name in read if name.endswith("_bucket")}
    assert "regularlm_num_requests_waiting" in read - histograms  # RegularlmQueueBacklog's
    assert read - histograms <= series_at_load()
    assert not histograms & series_at_load()


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = [
        (panel["gridPos"]["x"] + dx, panel["gridPos"]["y"] + dy)
        for panel in panels
        for dx in range(panel["gridPos"]["w"])
        for dy in range(panel["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells))
