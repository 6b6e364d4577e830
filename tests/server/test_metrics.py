"""ServerMetrics' per-step token accounting (the same exposition as one ``observe`` per token) and which series a
model has before and after it serves."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from server.metrics import TOKEN_LATENCY_BUCKETS, RequestTimes, ServerMetrics, observe_many


def exposition_lines(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")]


def test_observe_many_is_observe_repeated() -> None:
    values = [(0.0, 3), (0.001, 2), (0.0011, 5), (0.0025, 1), (80.0, 4), (81.0, 2), (1e9, 1), (0.3, 7)]
    registries = [CollectorRegistry(), CollectorRegistry()]
    one, many = (
        Histogram("gap_seconds", "doc", ["model_name"], registry=registry, buckets=TOKEN_LATENCY_BUCKETS)
        for registry in registries
    )
    for value, count in values:
        for _ in range(count):
            one.labels("m").observe(value)
        observe_many(many.labels("m"), value, count)
    repeated, counted = (exposition_lines(registry) for registry in registries)
    buckets = [line for line in counted if "_sum{" not in line and "_created{" not in line]
    assert [line for line in repeated if "_sum{" not in line and "_created{" not in line] == buckets  # buckets, count
    assert (
        'gap_seconds_bucket{le="+Inf",model_name="m"} 25.0' in buckets
        and 'gap_seconds_count{model_name="m"} 25.0' in buckets
    )
    sums = [float(line.split()[-1]) for lines in (repeated, counted) for line in lines if "_sum{" in line]
    assert math.isclose(*sums, rel_tol=1e-12)  # a product against repeated additions: the last digits may differ


def test_tokens_counts_first_tokens_gaps_and_totals() -> None:
    metrics = ServerMetrics()
    metrics.register_models(["m"])
    joining, running = RequestTimes("m"), RequestTimes("m")
    metrics.tokens("m", [running])
    metrics.tokens("m", [running, joining])  # joining: its first token; running: one gap
    metrics.tokens("m", [running, joining])  # two gaps, the same one
    assert (running.generated, joining.generated) == (3, 2)
    assert running.first_token is not None and running.last_token == joining.last_token
    lines = exposition_lines(metrics.registry)
    assert 'regularlm_time_to_first_token_seconds_count{model_name="m"} 2.0' in lines
    assert 'regularlm_inter_token_latency_seconds_count{model_name="m"} 3.0' in lines
    assert 'regularlm_generation_tokens_total{model_name="m"} 5.0' in lines


def model_lines(metrics: ServerMetrics, model: str) -> list[str]:
    return [line for line in exposition_lines(metrics.registry) if f'model_name="{model}"' in line]


def test_a_models_counters_and_gauges_exist_from_load_its_histograms_from_its_first_observation() -> None:
    metrics = ServerMetrics()
    metrics.register_models(["served", "idle"])
    at_load = model_lines(metrics, "idle")
    assert len(at_load) == 20  # 5 counters and 4 finish reasons (_total, _created), 2 gauges; was 174
    assert not any(
        line.startswith(("regularlm_e2e_request_latency", "regularlm_time_to_first_token")) for line in at_load
    )
    for line in [line for line in at_load if "_created{" not in line]:
        assert line.endswith(" 0.0"), line
    assert 'regularlm_num_requests_waiting{model_name="idle"} 0.0' in at_load
    assert 'regularlm_request_success_total{finished_reason="error",model_name="idle"} 0.0' in at_load

    times = RequestTimes("served")
    metrics.queued([times])
    metrics.scheduled(times)
    metrics.tokens("served", [times])
    metrics.model_executed("served", 0.002)
    metrics.finished(times, "stop")
    served = model_lines(metrics, "served")
    for name in (
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "time_to_first_token_seconds",
        "model_execute_time_seconds",
    ):
        assert f'regularlm_{name}_count{{model_name="served"}} 1.0' in served, name
    assert not any(line.startswith("regularlm_time_per_output_token") for line in served)  # one token: no TPOT yet
    assert model_lines(metrics, "idle") == at_load

    metrics.unregister_model("served")
    metrics.unregister_model("idle")
    assert model_lines(metrics, "served") == model_lines(metrics, "idle") == []
