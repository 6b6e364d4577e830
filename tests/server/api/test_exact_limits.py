"""A model's own limit on outputs "all" (SequenceModel.max_all_outputs_symbols): the exact transformers re-encode
every prefix, so /v1/transduce refuses longer "all" inputs with 413 and still answers "final" for them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from model.transformer.exact import ExactTransformer
from server.api.app import create_app
from tests.server.helpers import make_settings
from training.data.tasks import get_task
from training.exact_builders import write_checkpoints

LIMIT = ExactTransformer.max_all_outputs_symbols


@pytest.fixture(scope="module")
def exact_client(tmp_path_factory) -> Iterator[TestClient]:
    models = tmp_path_factory.mktemp("exact")
    write_checkpoints(models, tasks=["one"])
    app = create_app(make_settings(models))
    with TestClient(app) as test_client:
        app.state.engine.wait_loaded()
        yield test_client


def transduce(client: TestClient, text: str, outputs: str):
    return client.post("/v1/transduce", json={"model": "one-exact", "inputs": ["0" * 5, text], "outputs": outputs})


def test_all_outputs_over_the_models_limit_are_413(exact_client) -> None:
    text = "1" + "0" * LIMIT
    response = transduce(exact_client, text, "all")
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["type"] == "request_too_large"
    assert error["message"].startswith(
        f"inputs[1] has {LIMIT + 1} symbols; model 'one-exact' admits at most {LIMIT} with outputs \"all\" on this "
        "server (limits.max_all_outputs_symbols in /v1/models"
    )
    assert 'outputs "final" admits up to' in error["message"]
    final = transduce(exact_client, text, "final")
    assert final.status_code == 200, final.text
    assert [result["final"] for result in final.json()["results"]] == ["0", "1"]


def test_all_outputs_up_to_the_limit_are_served(exact_client) -> None:
    text = "0" * (LIMIT - 1) + "1"
    response = transduce(exact_client, text, "all")
    assert response.status_code == 200, response.text
    assert response.json()["results"][1]["all"] == get_task("one").label(text)
