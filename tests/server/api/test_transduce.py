"""/v1/transduce: the labels of every architecture, both output modes, batching across requests."""

from __future__ import annotations

import pytest

from tests.server import reference
from tests.server.checkpoints import TRANSDUCERS

INPUTS = ["0", "1", "0110", "1" * 7, "0101100111" * 5, "1" + "0" * 60]


@pytest.mark.parametrize("model_id", sorted(TRANSDUCERS))
def test_labels_match_the_model(model_id: str, client, checkpoints_dir) -> None:
    response = client.post("/v1/transduce", json={"model": model_id, "inputs": INPUTS, "outputs": "all"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == model_id and body["usage"] == {"symbols": sum(map(len, INPUTS))}
    for text, result in zip(INPUTS, body["results"]):
        expected = [str(label) for label in reference.labels(checkpoints_dir / model_id, text)]
        assert result["all"] == expected
        assert result["final"] == expected[-1]
        assert 0.5 <= result["confidence"] <= 1.0


def test_final_is_the_default_and_all_is_absent(client) -> None:
    all_outputs = client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": INPUTS, "outputs": "all"}).json()
    final = client.post("/v1/transduce", json={"model": "parity-lrnn", "inputs": INPUTS}).json()
    for with_all, without in zip(all_outputs["results"], final["results"]):
        assert set(without) == {"final", "confidence"}
        assert without["final"] == with_all["final"]
        assert without["confidence"] == pytest.approx(with_all["confidence"], abs=1e-5)
