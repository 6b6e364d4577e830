"""``python -m training snap`` (training/level_codes.py, training/state_codes.py): a RegularGPT of a group's word
problem gets level codes that every path hands on and stays right; a block-diagonal LRNN gets state codes and stays
right; a task whose labels do not say what a window carries, another architecture, a checkpoint that has codes, codes
too coarse to stay right and bad flags are refused with exit code 2 and one line on stderr."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import CheckpointConfig, LRNNConfig, RegularGPTConfig
from model.regulargpt.model import RegularGPT
from training.cli.main import main
from training.data.batches import FinalLabelSet, count_correct_final
from training.data.tasks import get_task
from training.level_codes import window_labels

CHECKPOINTS = Path(__file__).resolve().parents[3] / "checkpoints"


def snap(*argv: str) -> int:
    return main(["snap", "--strings", "16", "--threads", "1", *argv])


@pytest.fixture
def trained(tmp_path: Path) -> str:
    """The shipped parity_check-regulargpt as trained, before its level codes: a folder under tmp_path."""
    loaded = load_checkpoint(CHECKPOINTS / "parity_check-regulargpt", device="cpu")
    model_config = dataclasses.replace(loaded.config.model, level_codes=False)
    model = RegularGPT(model_config)
    model.load_state_dict({name: value for name, value in loaded.model.state_dict().items() if name != "level_codes"})
    metadata = {name: value for name, value in loaded.config.metadata.items() if name != "level_codes"}
    config = dataclasses.replace(loaded.config, model=model_config, metadata=metadata)
    return str(save_checkpoint(model, config, tmp_path / "trained"))


def test_window_labels_read_each_window_from_the_start() -> None:
    task = get_task("parity_check")
    assert window_labels(task, "1101", 2) == ["1", "0", "1", "1"]  # "1", "11", "10", "01"
    assert window_labels(task, "1101", 8) == task.label("1101")  # every window a prefix


def test_a_group_task_gets_codes_and_stays_right(trained: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "snapped"
    assert snap("--checkpoint", trained, "--out", str(out)) == 0
    assert "right at every position of 256 strings of the training lengths" in capsys.readouterr().out
    loaded = load_checkpoint(out, device="cpu")
    assert loaded.config.model.level_codes is True
    assert loaded.config.metadata["level_codes"]["command"].startswith("python -m training snap ")
    codes = loaded.model.level_codes
    assert codes is not None and codes.shape == (2, loaded.config.model.d_model)
    task = get_task("parity_check")
    examples = FinalLabelSet.draw(task, np.random.default_rng(5), 32, (200, 700))
    assert count_correct_final(loaded.model, examples, task.alphabet, batch_size=8) == 32
    tokens = torch.tensor([[task.alphabet.index(symbol) for symbol in examples.strings[0]]])
    with torch.no_grad():  # each output is the head's reading of one of the two codes
        read = loaded.model._logits(codes)
        outputs = loaded.model(tokens)[0]
    assert all(any(torch.allclose(row, code) for code in read) for row in outputs)


def test_the_codes_keep_the_checkpoints_dtype(trained: str, tmp_path: Path) -> None:
    loaded = load_checkpoint(trained, device="cpu")
    wide = save_checkpoint(loaded.model.double(), loaded.config, tmp_path / "float64")
    assert snap("--checkpoint", str(wide), "--out", str(tmp_path / "out")) == 0
    snapped = load_checkpoint(tmp_path / "out", device="cpu").model
    assert {parameter.dtype for parameter in snapped.parameters()} == {torch.float64}


@pytest.mark.parametrize(
    ("checkpoint", "extra", "message"),
    [
        ("even_pairs-regulargpt", [], "even_pairs's labels do not say all a window carries"),
        ("first-exact", [], "level codes are for RegularGPT transducers, not a exact transduce model"),
        ("parity_check-regulargpt", ["--radius", "0.1"], "--radius and --every are for block-diagonal LRNN"),
        ("even_pairs-lrnn", ["--radius", "100"], "misreads"),
        ("even_pairs-lrnn", ["--every", "0"], "--every"),
        ("parity_check-lrnn", [], "has state codes already"),
        ("text-regulargpt", [], "is a text model"),
        ("missing-folder", [], "missing-folder"),
        ("sum_mod5-regulargpt", [], "has level codes already"),
        ("parity_check-regulargpt", ["--strings", "0"], "--strings"),
    ],
)
def test_what_cannot_have_codes_is_refused(checkpoint: str, extra: list[str], message: str, tmp_path, capsys) -> None:
    code = snap("--checkpoint", str(CHECKPOINTS / checkpoint), "--out", str(tmp_path / "out"), *extra)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_an_lrnn_gets_state_codes_and_stays_right(tmp_path: Path, capsys) -> None:
    out = tmp_path / "snapped"
    assert snap("--checkpoint", str(CHECKPOINTS / "even_pairs-lrnn"), "--out", str(out), "--every", "2") == 0
    assert "codes per block from the states of 16 strings; right at every position" in capsys.readouterr().out
    loaded = load_checkpoint(out, device="cpu")
    config = loaded.config.model
    assert isinstance(config, LRNNConfig) and config.state_codes > 0 and config.snap_every == 2
    assert loaded.config.metadata["state_codes"]["command"].startswith("python -m training snap ")
    assert snap("--checkpoint", str(out), "--out", str(tmp_path / "twice")) == 2
    assert "has state codes already" in capsys.readouterr().err
    task = get_task("even_pairs")
    examples = FinalLabelSet.draw(task, np.random.default_rng(5), 32, (200, 700))
    assert count_correct_final(loaded.model, examples, task.alphabet, batch_size=8) == 32


def test_writing_over_a_checkpoint_is_refused_without_overwrite(trained: str, tmp_path: Path, capsys) -> None:
    once = tmp_path / "once"
    assert snap("--checkpoint", trained, "--out", str(once)) == 0
    assert snap("--checkpoint", trained, "--out", trained) == 2
    assert "--out must be another folder than --checkpoint" in capsys.readouterr().err
    before = (once / "model.safetensors").read_bytes()
    assert snap("--checkpoint", trained, "--out", str(once), "--seed", "1") == 2
    assert "already holds a checkpoint; pass --overwrite" in capsys.readouterr().err
    assert (once / "model.safetensors").read_bytes() == before
    assert snap("--checkpoint", trained, "--out", str(once), "--overwrite", "--seed", "1") == 0


def test_a_model_that_has_not_fit_its_training_lengths_is_refused(tmp_path: Path, capsys) -> None:
    task = get_task("parity_check")
    config = RegularGPTConfig(vocab_size=2, num_labels=2, d_model=8, n_heads=2, d_ff=16)
    checkpoint = CheckpointConfig(
        architecture="regulargpt", model=config, kind="transduce", task=task.name, alphabet="01", labels=task.labels
    )
    torch.manual_seed(0)
    folder = save_checkpoint(RegularGPT(config), checkpoint, tmp_path / "random")
    assert snap("--checkpoint", str(folder), "--out", str(tmp_path / "out")) == 2
    assert "before any codes: it has not fit them" in capsys.readouterr().err
