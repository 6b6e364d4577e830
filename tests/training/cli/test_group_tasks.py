"""The group word problems s5_generators and a5_generators outside their definition (that is
tests/automata/test_group_tasks.py): the shipped checkpoints/a5_generators-lrnn-compiled is ``compile --task``'s
output, ``compile`` reads the Cayley graph file, RegularGPT's construction is refused with exit 2, the ``hard`` eval
protocol reaches 5000 symbols, and the server names the position of a symbol outside the alphabet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from automata.task_automata import AUTOMATA_DIR
from model.checkpoint import load_checkpoint, read_config, read_weights
from server.api.app import create_app
from server.settings import Settings
from training.cli.main import main
from training.data.batches import FinalLabelSet, count_correct_final
from training.data.tasks import get_task
from training.evaluation.evaluate import Band, protocol_bands

REPOSITORY = Path(__file__).resolve().parents[3]
SHIPPED = REPOSITORY / "checkpoints" / "a5_generators-lrnn-compiled"
SHIPPED_REGULARGPT = REPOSITORY / "checkpoints" / "a5_generators-regulargpt-compiled"


def same_weights(first: Path, second: Path) -> bool:
    one, other = read_weights(first / "model.safetensors"), read_weights(second / "model.safetensors")
    return sorted(one) == sorted(other) and all(torch.equal(one[name], other[name]) for name in one)


def test_shipped_a5_checkpoint_equals_a_fresh_task_compilation(tmp_path: Path) -> None:
    """checkpoints/a5_generators-lrnn-compiled is ``compile --task a5_generators --arch lrnn``'s output, and so is
    the compilation of the Cayley graph file automata/tasks/a5_generators.json."""
    assert main(["compile", "--task", "a5_generators", "--arch", "lrnn", "--out", str(tmp_path / "task")]) == 0
    assert read_config(SHIPPED).to_dict() == read_config(tmp_path / "task").to_dict()
    assert same_weights(SHIPPED, tmp_path / "task")
    source = str(AUTOMATA_DIR / "a5_generators.json")
    assert main(["compile", source, "--arch", "lrnn", "--out", str(tmp_path / "file")]) == 0
    assert read_config(tmp_path / "file").to_dict() == read_config(SHIPPED).to_dict()
    assert same_weights(SHIPPED, tmp_path / "file")
    config = read_config(SHIPPED)
    assert config.task == "a5_generators" and config.labels == get_task("a5_generators").labels


def test_shipped_a5_checkpoint_is_right_on_the_hard_lengths() -> None:
    """Final labels of the task's own strings up to 5000 symbols, through the cache in chunks (``eval
    --chunk-symbols``), and of 200 short ones through final_logits."""
    loaded = load_checkpoint(SHIPPED, device="cpu")
    task = get_task("a5_generators")
    long = FinalLabelSet.draw(task, np.random.default_rng(16), 4, (2001, 5000))
    assert count_correct_final(loaded.model, long, task.alphabet, batch_size=2, chunk_symbols=1024) == 4
    short = FinalLabelSet.draw(task, np.random.default_rng(17), 200, (1, 100))
    assert count_correct_final(loaded.model, short, task.alphabet, batch_size=50) == 200


def test_shipped_a5_regulargpt_is_a_fresh_compilation_over_the_group_and_right_on_the_task_s_strings(
    tmp_path: Path,
) -> None:
    """60 states, past MAX_REGULARGPT_STATES: checkpoints/a5_generators-regulargpt-compiled is ``compile --task
    a5_generators --arch regulargpt``'s output, the construction over the group's 60 elements (d_model 120)."""
    assert main(["compile", "--task", "a5_generators", "--arch", "regulargpt", "--out", str(tmp_path / "rg")]) == 0
    assert read_config(SHIPPED_REGULARGPT).to_dict() == read_config(tmp_path / "rg").to_dict()
    assert same_weights(SHIPPED_REGULARGPT, tmp_path / "rg")
    loaded = load_checkpoint(SHIPPED_REGULARGPT, device="cpu")
    assert loaded.config.task == "a5_generators" and loaded.config.model.d_model == 120
    task = get_task("a5_generators")
    strings = FinalLabelSet.draw(task, np.random.default_rng(18), 40, (1, 600))
    assert count_correct_final(loaded.model, strings, task.alphabet, batch_size=20) == 40


@pytest.mark.parametrize("name", ["s5_generators", "a5_generators"])
def test_the_hard_protocol_adds_2001_to_5000_for_the_groups(name: str) -> None:
    bands = protocol_bands(get_task(name), "hard", 2, 100)
    lengths = [(501, 1250), (1251, 2000), (2001, 3500), (3501, 5000)]
    assert bands == [Band(band, p_one) for p_one in (None, 0.1, 0.9) for band in lengths]
    papers = protocol_bands(get_task(name), "papers", 2, 100)
    assert [band.lengths for band in papers] == [(41, 270), (271, 500)]


def test_the_server_names_the_position_of_a_symbol_outside_the_group_alphabet(tmp_path: Path) -> None:
    """The usual 422 (docs/api.md, Errors), and the labels of a valid input are the group's elements."""
    models = tmp_path / "models"
    assert main(["compile", "--task", "a5_generators", "--arch", "lrnn", "--out", str(models / "a5")]) == 0
    settings = Settings(models=models, shipped_models=False, device="cpu", torch_threads=1, batch_wait_ms=2.0)
    app = create_app(settings)
    with TestClient(app) as client:
        app.state.engine.wait_loaded()
        response = client.post("/v1/transduce", json={"model": "a5", "inputs": ["erc", "ertc"]})
        assert response.status_code == 422, response.text
        message = response.json()["error"]["message"]
        assert all(fragment in message for fragment in ("inputs[1]", "'t'", "position 2", "'erc'")), message
        response = client.post("/v1/transduce", json={"model": "a5", "inputs": ["rrc", "e"], "outputs": "all"})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        task = get_task("a5_generators")
        assert [result["all"] for result in results] == [task.label("rrc"), task.label("e")]
        assert [result["final"] for result in results] == ["01342", "01234"]
