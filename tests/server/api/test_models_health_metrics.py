"""/v1/models, /health, /metrics and the settings."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from server.api.app import create_app
from server.settings import SHIPPED_CHECKPOINTS, Settings
from tests.server.checkpoints import BROKEN, LANGUAGE_MODELS, TRANSDUCERS
from tests.server.helpers import make_settings


def test_models_lists_what_loaded_and_reports_what_did_not(client, checkpoints_dir) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    cards = {card["id"]: card for card in body["data"]}
    assert set(cards) == set(TRANSDUCERS) | set(LANGUAGE_MODELS)
    assert cards["parity-lrnn"] | {"parameters": 0, "limits": {}} == {
        "id": "parity-lrnn",
        "object": "model",
        "owned_by": "regularlm",
        "kind": "transduce",
        "architecture": "lrnn",
        "task": "parity_check",
        "alphabet": "01",
        "labels": ["0", "1"],
        "tokenizer": None,
        "vocab_size": 2,
        "parameters": 0,
        "limits": {},
        "decode": None,
    }
    assert "serving_notes" not in cards["parity-lrnn"]  # model.for_serving's notes: in the server's log, at DEBUG
    assert cards["parity-lrnn"]["limits"]["max_input_symbols"] > 0  # tests/server/engine/test_engine.py
    assert cards["text-lstm"]["kind"] == "generate" and cards["text-lstm"]["tokenizer"] == "bytes"
    for model_id in LANGUAGE_MODELS:  # model/cuda_graphs.py: graphs on CUDA only (tests/server/test_cuda.py)
        decode = cards[model_id]["decode"]
        assert decode["mode"] == "eager" and "CUDA graphs need a CUDA device" in decode["reason"], decode
    (failure,) = client.app.state.engine.load_failures
    assert failure.startswith(str(checkpoints_dir / BROKEN)) and "not valid JSON" in failure


def test_health(client) -> None:
    """200 while serving; "degraded", naming the folder, as the broken one was skipped (tests/server/api/test_http_edges.py
    has "ok")."""
    response = client.get("/health")
    assert response.status_code == 200 and response.json() == {
        "status": "degraded",
        "detail": f"1 checkpoint folder was skipped at load and not served: {BROKEN} (the server's log says why)",
    }


def test_metrics_use_vllm_names(client) -> None:
    client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0110", "1"]})
    client.post("/v1/generate", json={"model": "text-lrnn", "prompt": "abc", "max_tokens": 5})
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in [
        "regularlm_e2e_request_latency_seconds_bucket",
        "regularlm_request_queue_time_seconds_bucket",
        "regularlm_time_to_first_token_seconds_bucket",
        "regularlm_time_per_output_token_seconds_bucket",
        "regularlm_inter_token_latency_seconds_bucket",
        "regularlm_model_execute_time_seconds_bucket",
        "regularlm_prompt_tokens_total",
        "regularlm_generation_tokens_total",
        "regularlm_transduced_symbols_total",
        "regularlm_num_requests_running",
        "regularlm_num_requests_waiting",
        "regularlm_prefix_cache_queries_total",
    ]:
        assert f"{name}{{" in text, name
    assert 'regularlm_transduced_symbols_total{model_name="parity-lrnn"} 5.0' in text
    assert 'regularlm_time_to_first_token_seconds_bucket{le="0.001",model_name="text-lrnn"}' in text
    assert 'regularlm_num_requests_running{model_name="text-lrnn"} 0.0' in text


def test_every_models_counters_and_gauges_exist_at_zero_from_load_its_histograms_once_it_serves(
    checkpoints_dir,
) -> None:
    app = create_app(make_settings(checkpoints_dir))
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        text = client.get("/metrics").text
        client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": ["0110"]})
        served = client.get("/metrics").text
    assert "regularlm_e2e_request_latency_seconds_count{" not in text
    assert 'regularlm_e2e_request_latency_seconds_count{model_name="parity-lrnn"} 1.0' in served
    for model in sorted(TRANSDUCERS) + sorted(LANGUAGE_MODELS):
        assert f'regularlm_generation_tokens_total{{model_name="{model}"}} 0.0' in text
        assert f'regularlm_num_requests_waiting{{model_name="{model}"}} 0.0' in text
        for reason in ("stop", "length", "abort", "error"):
            assert f'regularlm_request_success_total{{finished_reason="{reason}",model_name="{model}"}} 0.0' in text


def test_settings_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("REGULARLM_PORT", "9123")
    monkeypatch.setenv("REGULARLM_CORS_ORIGINS", '["https://a.example"]')
    settings = Settings()
    assert settings.port == 9123 and settings.cors_origins == ["https://a.example"]
    assert Settings(port=1).port == 1
    assert settings.models == [] and settings.shipped_models  # the shipped ones alone (tests/server/test_main.py)
    assert settings.model_folders == [SHIPPED_CHECKPOINTS] == [Path(__file__).resolve().parents[3] / "checkpoints"]
