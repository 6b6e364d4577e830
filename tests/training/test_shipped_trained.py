"""The trained transducers shipped under checkpoints/ (docs/results.md): each loads, records how it was trained,
and is still right on fresh strings well past its training lengths (a guard against a stale or broken file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model.checkpoint import load_checkpoint
from training.data.batches import FinalLabelSet, count_correct_final
from training.data.tasks import get_task

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
TRAINED = sorted(
    path
    for path in CHECKPOINTS.iterdir()
    if (path / "config.json").exists() and (path / "train.jsonl").exists() and not path.name.startswith("text-")
)


def test_trained_checkpoints_are_shipped() -> None:
    assert "parity_check-lrnn" in [path.name for path in TRAINED]


@pytest.mark.parametrize("folder", TRAINED, ids=[path.name for path in TRAINED])
def test_a_shipped_trained_checkpoint_extrapolates(folder: Path) -> None:
    """Right on 48 fresh strings of 41-300 symbols; a task with strings whose decisive symbol lies a power of two
    before the end (induction_heads: where RegularGPT's last position reads the mark in one hop, rare among uniform
    draws) is checked on 48 of those as well."""
    loaded = load_checkpoint(folder, device="cpu")
    config = loaded.config
    assert config.kind == "transduce" and folder.name == f"{config.task}-{config.architecture}"
    assert config.metadata["command"].startswith("python -m training train ")
    codes = [config.metadata[key] for key in ("level_codes", "state_codes") if key in config.metadata]
    if codes:  # the training's evaluations were of the model before its codes
        assert codes[0]["command"].startswith("python -m training snap ")
        assert codes[0]["checked"] > 0
    else:
        assert config.metadata["best_eval"]["accuracy"] >= 0.99
    task = get_task(config.task)
    for power_offsets in [False] if task.draw_power_offset is None else [False, True]:
        examples = FinalLabelSet.draw(task, np.random.default_rng(2026), 48, (41, 300), power_offsets=power_offsets)
        correct = count_correct_final(loaded.model.eval(), examples, task.alphabet, batch_size=16)
        assert correct == len(examples), f"power_offsets={power_offsets}"
