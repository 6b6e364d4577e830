"""Runtime models: POST /v1/models compiles a regular expression or a DFA and serves it without a restart;
DELETE /v1/models/{id} removes it; shipped models stay; limits, conflicts and bad input get clear errors."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from automata.samples import symmetric
from automata.task_automata import AUTOMATA_DIR
from server.api.app import create_app
from server.models import runtime as runtime_models
from tests.server.helpers import make_settings

MULTIPLE_OF_3 = "(0|1(01*0)*1)*"


@pytest.fixture(scope="module")
def runtime_client(checkpoints_dir) -> Iterator[TestClient]:
    app = create_app(make_settings(checkpoints_dir, runtime_models_max=3, runtime_model_max_states=40))
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        yield client


def add(client: TestClient, **body) -> dict:
    response = client.post("/v1/models", json=body)
    return {"status": response.status_code, **response.json()}


def transduce(client: TestClient, model: str, inputs: list[str], outputs: str = "all") -> list:
    response = client.post("/v1/transduce", json={"model": model, "inputs": inputs, "outputs": outputs})
    assert response.status_code == 200, response.text
    return [result["all"] if outputs == "all" else result["final"] for result in response.json()["results"]]


@pytest.mark.parametrize("architecture", ["lrnn", "regulargpt"])
def test_a_regex_becomes_a_served_model_that_labels_every_prefix_like_re_fullmatch(runtime_client, architecture):
    model_id = f"mult3-{architecture}"
    card = add(runtime_client, id=model_id, regex=MULTIPLE_OF_3, alphabet="01", architecture=architecture)
    assert card["status"] == 201, card
    assert card["id"] == model_id and card["kind"] == "transduce" and card["alphabet"] == "01"
    assert card["architecture"] == architecture and card["limits"]["max_input_symbols"] > 0
    assert model_id in [entry["id"] for entry in runtime_client.get("/v1/models").json()["data"]]
    assert runtime_client.get(f"/v1/models/{model_id}").json()["id"] == model_id
    rng = np.random.default_rng(0)
    inputs = ["".join(rng.choice(["0", "1"], size=length)) for length in (1, 7, 40, 300)]
    for string, labels in zip(inputs, transduce(runtime_client, model_id, inputs), strict=True):
        assert labels == [
            "1" if re.fullmatch(MULTIPLE_OF_3, string[:end]) else "0" for end in range(1, len(string) + 1)
        ]
    long = "".join(rng.choice(["0", "1"], size=20_000))
    assert transduce(runtime_client, model_id, [long], "final") == [str(int(int(long, 2) % 3 == 0))]
    assert runtime_client.delete(f"/v1/models/{model_id}").json() == {
        "id": model_id,
        "object": "model",
        "deleted": True,
    }


def test_a_dfa_becomes_a_served_model_and_deleting_it_stops_serving_it(runtime_client):
    dfa = json.loads((AUTOMATA_DIR / "tomita4.json").read_text())
    assert add(runtime_client, id="t4", dfa=dfa)["status"] == 201
    metrics = runtime_client.get("/metrics").text
    assert 'regularlm_request_success_total{finished_reason="stop",model_name="t4"} 0.0' in metrics
    assert transduce(runtime_client, "t4", ["0001", "0010"], "final") == ["0", "1"]  # tomita4: no "000"
    assert 'regularlm_e2e_request_latency_seconds_count{model_name="t4"} 1.0' in runtime_client.get("/metrics").text
    assert runtime_client.delete("/v1/models/t4").status_code == 200
    response = runtime_client.post("/v1/transduce", json={"model": "t4", "inputs": ["01"]})
    assert response.status_code == 404
    assert runtime_client.delete("/v1/models/t4").status_code == 404
    assert 'model_name="t4"' not in runtime_client.get("/metrics").text


def test_conflicts_limits_and_bad_input(runtime_client):
    assert add(runtime_client, id="dup", regex="a*", alphabet="ab")["status"] == 201
    taken = add(runtime_client, id="dup", regex="b*", alphabet="ab")
    assert taken["status"] == 409 and "exists already" in taken["error"]["message"]
    shipped = runtime_client.get("/v1/models").json()["data"][0]["id"]
    refused = runtime_client.delete(f"/v1/models/{shipped}")
    assert refused.status_code == 409 and "only models added with POST /v1/models" in refused.json()["error"]["message"]
    cases = [
        ({"id": "x", "regex": "(a", "alphabet": "ab"}, 422, "invalid regular expression"),
        ({"id": "x", "regex": "(a)\\1", "alphabet": "ab"}, 422, "back-references"),
        ({"id": "x", "regex": "a"}, 422, "needs 'alphabet'"),
        ({"id": "x", "alphabet": "ab"}, 422, "exactly one of 'regex'"),
        ({"id": "x", "dfa": {"name": "bad"}}, 422, "missing"),
        ({"id": "bad id!", "regex": "a", "alphabet": "a"}, 422, "id"),
        ({"id": "x", "regex": "(a|b)*a(a|b){6}", "alphabet": "ab"}, 413, "runtime_model_max_states"),
        ({"id": "x", "dfa": symmetric(17), "architecture": "regulargpt"}, 413, "MAX_REGULARGPT_MONOID = 128"),
    ]
    for body, status, message in cases:
        answer = add(runtime_client, **body)
        assert answer["status"] == status and message in answer["error"]["message"], (body, answer)
    assert add(runtime_client, id="two", regex="b", alphabet="ab")["status"] == 201
    assert add(runtime_client, id="three", regex="ab", alphabet="ab")["status"] == 201
    over = add(runtime_client, id="four", regex="ba", alphabet="ab")
    assert over["status"] == 413 and "runtime_models_max" in over["error"]["message"]
    for model_id in ("dup", "two", "three"):
        assert runtime_client.delete(f"/v1/models/{model_id}").status_code == 200


def test_the_api_key_guards_the_routes(checkpoints_dir):
    app = create_app(make_settings(checkpoints_dir, api_key="secret"))
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        assert client.post("/v1/models", json={"id": "a", "regex": "a", "alphabet": "a"}).status_code == 401
        assert client.delete("/v1/models/a").status_code == 401
        headers = {"Authorization": "Bearer secret"}
        body = {"id": "a", "regex": "a", "alphabet": "a"}
        assert client.post("/v1/models", json=body, headers=headers).status_code == 201
        assert client.delete("/v1/models/a", headers=headers).status_code == 200


def test_runtime_models_can_be_turned_off(checkpoints_dir):
    app = create_app(make_settings(checkpoints_dir, runtime_models_max=0))
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        response = client.post("/v1/models", json={"id": "a", "regex": "a", "alphabet": "a"})
        assert response.status_code == 413 and "turned off" in response.json()["error"]["message"]


def test_a_compile_past_the_time_limit_is_refused_and_the_server_goes_on(checkpoints_dir, monkeypatch):
    """A compile that cannot end before the limit (it waits until the test lets it go: no race with the machine's
    speed) is refused; its thread ends on its own and its model is not served."""
    release, compile_runtime_model = threading.Event(), runtime_models.compile_runtime_model

    def blocked(*args, **kwargs):
        release.wait(60)
        return compile_runtime_model(*args, **kwargs)

    monkeypatch.setattr(runtime_models, "compile_runtime_model", blocked)
    app = create_app(make_settings(checkpoints_dir, runtime_compile_timeout_s=0.05))
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        response = client.post("/v1/models", json={"id": "slow", "regex": "(a|b)*a(a|b){5}", "alphabet": "ab"})
        release.set()
        assert response.status_code == 413 and "runtime_compile_timeout_s" in response.json()["error"]["message"]
        assert "slow" not in [entry["id"] for entry in client.get("/v1/models").json()["data"]]
        shipped = client.get("/v1/models").json()["data"][0]
        assert client.get(f"/v1/models/{shipped['id']}").status_code == 200
