"""The series names the server exposes, read from ``server/metrics.py``'s registry (all it can carry, and those
a loaded model has before its first request), and the names a PromQL expression or a Grafana query refers to."""

from __future__ import annotations

import re

from server.metrics import PREFIX, ServerMetrics

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"), "gauge": ("",)}
NAME = re.compile(re.escape(PREFIX) + r"[a-zA-Z0-9_:]+")


def exposed_series() -> set[str]:
    """Every series name /metrics can carry, e.g. ``regularlm_request_success_total``."""
    return {family.name + suffix for family in ServerMetrics().registry.collect() for suffix in SUFFIXES[family.type]}


def series_at_load() -> set[str]:
    """The series names /metrics carries once a model is loaded, before any request."""
    metrics = ServerMetrics()
    metrics.register_models(["m"])
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def referenced_series(expression: str) -> set[str]:
    return set(NAME.findall(expression))
