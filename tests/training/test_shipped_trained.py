"""The trained transducers shipped under checkpoints/ (docs/results.md): each loads, records how it was trained,
and is still right on fresh strings well past its training lengths (a guard against a stale or broken file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from model.checkpoint import load_checkpoint
from training.data import FinalLabelSet, count_correct_final
from training.tasks import get_task

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
TRAINED = sorted(
    path for path in CHECKPOINTS.iterdir()
    if (path / "config.json").exists() and (path / "train.jsonl").exists()
    and not path.name.startswith("text-")
)


def mark_a_power_of_two_before_the_end(string: str) -> bool:
    """An induction_heads string whose "#" lies 2**k before the final one (training/tasks.py, draw_power_offset)."""
    offset = len(string) - 1 - string.index("#")
    return offset & (offset - 1) == 0


# The strings a shipped checkpoint is known to miss some of (docs/results.md says which and how often), left out of
# the check below: induction_heads-regulargpt misses ~1/3 of those whose mark its final position reads in one hop
# (2.7% of all strings at 64 symbols, fewer as strings grow), pre-norm and post-norm alike.
KNOWN_MISSES = {"induction_heads-regulargpt": mark_a_power_of_two_before_the_end}


def test_trained_checkpoints_are_shipped() -> None:
    assert "parity_check-lrnn" in [path.name for path in TRAINED]


@pytest.mark.parametrize("folder", TRAINED, ids=[path.name for path in TRAINED])
def test_a_shipped_trained_checkpoint_extrapolates(folder: Path) -> None:
    loaded = load_checkpoint(folder, device="cpu")
    config = loaded.config
    assert config.kind == "transduce" and folder.name == f"{config.task}-{config.architecture}"
    assert config.metadata["command"].startswith("python -m training train ")
    assert config.metadata["best_eval"]["accuracy"] >= 0.99
    task = get_task(config.task)
    examples = FinalLabelSet.draw(task, np.random.default_rng(2026), 48, (41, 300))
    known = KNOWN_MISSES.get(folder.name)
    if known is not None:
        kept = [i for i, string in enumerate(examples.strings) if not known(string)]
        assert len(kept) >= 40  # the check still covers most of the draw
        examples = FinalLabelSet(tuple(examples.strings[i] for i in kept), tuple(examples.final_labels[i] for i in kept))
    correct = count_correct_final(loaded.model.eval(), examples, task.alphabet, batch_size=16)
    assert correct == len(examples)
