"""Warm start: what a request builds on first use is built while the server loads, before /health says ok, so that
the first requests cost what the next ones do. Checked by what gets built during the first requests (numba
compilations, pydantic adapters, structured-output vocabularies, tokenizer tables), not by their time."""

from __future__ import annotations

from pathlib import Path

import pydantic
from fastapi.testclient import TestClient
from numba.core import event

from model.ops.cpu import cpu_decode
from server.api.app import create_app
from server.structured import outputs as structured
from tests.server.helpers import make_settings

# Language models whose decode steps run through the compiled layer steps (batch invariance holds for them: every batch
# size), and a transducer.
SERVED = ("text-lrnn", "text-regulargpt", "parity-lrnn")


def test_the_first_requests_build_nothing(checkpoints_dir: Path, tmp_path: Path, monkeypatch) -> None:
    for model_id in SERVED:
        (tmp_path / model_id).symlink_to(checkpoints_dir / model_id)
    # Fresh kernels, as in a new server process: other tests of this session compiled the layer steps already.
    monkeypatch.setattr(cpu_decode, "_kernels", None)
    built = {"adapters": 0, "vocabularies": 0}

    def counted(kind: str, init):
        def init_counted(self, *args, **kwargs) -> None:
            built[kind] += 1
            init(self, *args, **kwargs)

        return init_counted

    app = create_app(make_settings(tmp_path))
    with TestClient(app) as client:
        engine = app.state.engine
        engine.wait_loaded()
        assert engine.state == "ready", engine.detail
        tokenizers = [engine.models[model_id].tokenizer for model_id in SERVED[:2]]
        assert all("_token_bytes" in vars(tokenizer) for tokenizer in tokenizers)  # the detokenizer's table
        monkeypatch.setattr(pydantic.TypeAdapter, "__init__", counted("adapters", pydantic.TypeAdapter.__init__))
        monkeypatch.setattr(
            structured.ConstraintVocabulary,
            "__init__",
            counted("vocabularies", structured.ConstraintVocabulary.__init__),
        )
        with event.install_recorder("numba:compile") as compiled:
            for model_id in SERVED[:2]:
                greedy = {"model": model_id, "prompt": "It was", "max_tokens": 4, "temperature": 0}
                assert client.post("/v1/generate", json=greedy).status_code == 200
                sampled = {**greedy, "temperature": 1.0, "top_p": 0.9, "seed": 0, "stream": True}
                assert client.post("/v1/generate", json=sampled).status_code == 200
                choice = {**greedy, "structured_outputs": {"choice": ["yes", "no"]}}
                assert client.post("/v1/generate", json=choice).status_code == 200
                two = {"model": model_id, "prompt": ["It was", "The"], "max_tokens": 4, "logprobs": 2}
                assert client.post("/v1/completions", json=two).status_code == 200
            transduce = {"model": "parity-lrnn", "inputs": ["0110", "1"]}
            assert client.post("/v1/transduce", json=transduce).status_code == 200
        assert compiled.buffer == []
        assert built == {"adapters": 0, "vocabularies": 0}
