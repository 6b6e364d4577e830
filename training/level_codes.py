"""``python -m training snap``: give a trained RegularGPT transducer level codes (model/config.py,
``RegularGPTConfig.level_codes``), so that every thick layer hands the next one the code of the label it reads instead
of its own output, and small errors cannot build up with depth (docs/models.md, "Level codes").

A label's code is the mean output of the thick layers over the windows of that label, on strings of the task's
longest training length: after thick layer l, position m holds the window of C^(l+1) symbols ending at m (its prefix
near the start), and a window's label is the task's label of the window read as a string of its own. That is what the
next layer is given when the labels say all a window carries (a group's word problem: the label is the window's
element); the model is checked at every position of fresh strings of the training lengths, without codes and with them,
and refused when it is wrong anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.base import SequenceModel
from model.checkpoint import LoadedCheckpoint, save_checkpoint
from model.config import CheckpointConfig, RegularGPTConfig
from model.registry import build_model
from model.regulargpt.cache import adaptive_depth
from model.regulargpt.model import RegularGPT
from training.data.tasks import Task

# Strings of the training lengths the model must read right at every position, with its codes and without.
CHECK_STRINGS = 256


class SnapError(ValueError):
    """The checkpoint cannot take level codes; the message says why."""


@dataclass(frozen=True)
class Snapped:
    """The model with its codes, its checkpoint config, and a line on where the codes came from."""

    model: SequenceModel
    config: CheckpointConfig
    summary: str  # e.g. "codes from 5,120 windows"


def window_labels(task: Task, string: str, width: int) -> list[str]:
    """The label of the window of ``width`` symbols ending at each position of ``string`` (its prefix where shorter),
    the window read as a string of its own."""
    return [task.label(string[max(0, end - width + 1) : end + 1])[-1] for end in range(len(string))]


def snap(loaded: LoadedCheckpoint, task: Task, strings: int, seed: int, command: str) -> Snapped:
    """Level codes for ``loaded`` (a RegularGPT transducer of ``task`` without them) from ``strings`` strings of the
    task's longest training length, checked on :data:`CHECK_STRINGS` more; SnapError where it cannot have them.
    ``command``: the command line, kept in the metadata."""
    model, config = loaded.model, loaded.config
    if not isinstance(model, RegularGPT) or config.kind != "transduce":
        raise SnapError(
            f"{loaded.path}: level codes are for RegularGPT transducers, not a {config.architecture} {config.kind} model"
        )
    assert isinstance(config.model, RegularGPTConfig)  # a RegularGPT's
    if config.model.level_codes:
        raise SnapError(f"{loaded.path} has level codes already")
    rng = np.random.default_rng(seed)
    checks = fitted_checks(loaded, task, rng)
    high = task.train_lengths[1]
    labels = {label: index for index, label in enumerate(task.labels)}
    sums = torch.zeros(len(task.labels), config.model.d_model, dtype=torch.float64)
    counts = torch.zeros(len(task.labels), dtype=torch.long)
    chunk = config.model.chunk_size
    with torch.no_grad():
        for string in (task.sample(rng, high) for _ in range(strings)):
            x = model.embedding(torch.tensor([[task.alphabet.index(symbol) for symbol in string]]))  # (1, T, d)
            for level in range(adaptive_depth(len(string) - 1, chunk)):
                x = model._thick_layer(x, chunk**level)  # no codes yet: the layer's own output
                index = torch.tensor([labels[label] for label in window_labels(task, string, chunk ** (level + 1))])
                sums.index_add_(0, index, x[0].double())
                counts += torch.bincount(index, minlength=len(task.labels))
    unseen = [task.labels[index] for index in torch.nonzero(counts == 0)[:, 0].tolist()]
    if unseen:
        raise SnapError(f"label(s) {unseen[:5]} never end a window of {high}-symbol strings; draw more with --strings")
    codes = (sums / counts[:, None]).to(model.dtype)  # (labels, d)
    model_config = dataclasses.replace(config.model, level_codes=True)
    snapped = build_model("regulargpt", model_config).to(model.dtype)  # stored as the model was
    assert isinstance(snapped, RegularGPT)
    snapped.load_state_dict({**model.state_dict(), "level_codes": codes})
    snapped.eval()
    with torch.no_grad():
        read = snapped._logits(codes).argmax(dim=-1)  # (labels,)
    unread = [task.labels[index] for index in torch.nonzero(read != torch.arange(len(codes)))[:, 0].tolist()]
    if unread:
        raise SnapError(f"the head does not read label(s) {unread[:5]} from their own codes")
    misread = misreading(snapped, task, checks)
    if misread:
        raise SnapError(
            f"with level codes the model misreads {misread} of the training lengths (it reads them right without): "
            f"{task.name}'s labels do not say all a window carries"
        )
    positions = sum(map(len, checks))
    metadata = {**config.metadata, "level_codes": {"command": command, "from": str(loaded.path), "checked": positions}}
    summary = f"codes from {int(counts.sum()):,} windows"
    return Snapped(snapped, dataclasses.replace(config, model=model_config, metadata=metadata), summary)


def fitted_checks(loaded: LoadedCheckpoint, task: Task, rng: np.random.Generator) -> list[str]:
    """:data:`CHECK_STRINGS` fresh strings of the training lengths, which ``loaded`` reads right at every position
    before any codes; SnapError where it does not."""
    low, high = max(task.train_lengths[0], task.shortest_length), task.train_lengths[1]
    checks = [task.sample(rng, int(rng.integers(low, high + 1))) for _ in range(CHECK_STRINGS)]
    misread = misreading(loaded.model, task, checks)
    if misread:
        raise SnapError(
            f"{loaded.path} misreads {misread} of the training lengths before any codes: it has not fit them"
        )
    return checks


def misreading(model: SequenceModel, task: Task, strings: list[str]) -> str:
    """Where ``model`` first misreads one of ``strings``, every position checked: "" when nowhere, else, e.g., "3 of
    25 positions of a 25-symbol string"."""
    with torch.no_grad():
        for string in strings:
            want = torch.tensor([task.labels.index(label) for label in task.label(string)])
            got = model(torch.tensor([[task.alphabet.index(symbol) for symbol in string]]))[0].argmax(dim=-1)
            wrong = int((got != want).sum())
            if wrong:
                return f"{wrong} of {len(string)} positions of a {len(string)}-symbol string"
    return ""


def write(snapped: Snapped, out: Path) -> Path:
    """The snapped checkpoint folder at ``out``."""
    return save_checkpoint(snapped.model, snapped.config, out)
