"""The server on CUDA answers as it does on the CPU: transduction labels and confidences, greedy generation
(batched across concurrent requests), seeded sampling repeatable on the device. Skipped without CUDA."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

from server.api.app import create_app
from tests.server.checkpoints import LANGUAGE_MODELS, TRANSDUCERS
from tests.server.helpers import make_settings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_client(checkpoints_dir) -> Iterator[TestClient]:
    app = create_app(make_settings(checkpoints_dir, device="cuda"))
    with TestClient(app) as test_client:
        app.state.engine.wait_loaded()
        yield test_client


def post(client: TestClient, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("model_id", sorted(TRANSDUCERS))
def test_transduce_on_cuda_equals_cpu(model_id: str, client, cuda_client) -> None:
    rng = random.Random(0)
    inputs = ["".join(rng.choice("01") for _ in range(length)) for length in (1, 7, 40, 300, 1000)]
    body = {"model": model_id, "inputs": inputs, "outputs": "all"}
    cpu, cuda = post(client, "/v1/transduce", body), post(cuda_client, "/v1/transduce", body)
    for on_cpu, on_cuda in zip(cpu["results"], cuda["results"]):
        assert on_cuda["all"] == on_cpu["all"]
        assert on_cuda["confidence"] == pytest.approx(on_cpu["confidence"], abs=1e-4)


@pytest.mark.parametrize("model_id", sorted(LANGUAGE_MODELS))
def test_greedy_generation_on_cuda_equals_cpu_under_concurrency(model_id: str, client, cuda_client) -> None:
    prompts = [f"Prompt {i}: the quick brown fox" for i in range(8)]

    def generate(test_client: TestClient, prompt: str) -> str:
        body = {"model": model_id, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        return post(test_client, "/v1/generate", body)["text"]

    with ThreadPoolExecutor(8) as pool:
        on_cuda = list(pool.map(lambda prompt: generate(cuda_client, prompt), prompts))
    assert on_cuda == [generate(client, prompt) for prompt in prompts]


def test_seeded_sampling_on_cuda_is_repeatable(cuda_client) -> None:
    body = {"model": "text-lrnn", "prompt": "The cat", "max_tokens": 20, "seed": 11, "temperature": 0.8}
    assert post(cuda_client, "/v1/generate", body)["text"] == post(cuda_client, "/v1/generate", body)["text"]


def test_fixed_state_models_decode_through_cuda_graphs(cuda_client) -> None:
    cards = {card["id"]: card for card in cuda_client.get("/v1/models").json()["data"]}
    for model_id in ["text-lrnn", "text-lstm"]:
        assert cards[model_id]["decode"]["mode"] == "cuda_graphs", cards[model_id]["decode"]
        assert cards[model_id]["decode"]["batch_sizes"][:4] == [1, 2, 4, 8]
    for model_id in ["text-transformer", "text-regulargpt"]:
        decode = cards[model_id]["decode"]
        assert decode["mode"] == "eager" and "grows with the context" in decode["reason"], decode


@pytest.mark.parametrize("model_id", ["text-lrnn", "text-lstm"])
def test_graphed_generation_equals_eager(model_id: str, checkpoints_dir, cuda_client) -> None:
    prompts = [f"Prompt {i}: over the lazy dog" for i in range(5)]  # up to 5 rows a step: graphs of 1-8 rows, padded
    app = create_app(make_settings(checkpoints_dir, device="cuda", cuda_graphs=False))
    with TestClient(app) as eager_client, ThreadPoolExecutor(5) as pool:
        app.state.engine.wait_loaded()
        assert eager_client.get(f"/v1/models/{model_id}").json()["decode"]["mode"] == "eager"
        runs = {}
        body = {"model": model_id, "max_tokens": 24, "temperature": 0}
        for name, test_client in [("graphs", cuda_client), ("eager", eager_client)]:
            runs[name] = list(pool.map(lambda p, c=test_client: post(c, "/v1/generate", body | {"prompt": p}), prompts))
    assert [run["text"] for run in runs["graphs"]] == [run["text"] for run in runs["eager"]]
