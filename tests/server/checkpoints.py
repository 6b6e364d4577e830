"""Tiny checkpoint folders for the server and client tests: transducers of parity over "01" and byte-level
language models, one per architecture that the engine treats differently, plus a folder that cannot load."""

from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint import save_checkpoint
from model.config import CheckpointConfig
from tests.model.tiny_models import ARCHITECTURE_OF, build_tiny

TRANSDUCERS = {"parity-lrnn": "lrnn", "parity-regulargpt": "regulargpt-c2", "parity-transformer": "transformer-alibi"}
LANGUAGE_MODELS = {
    "text-lrnn": "lrnn",
    "text-lstm": "lstm",
    "text-transformer": "transformer-alibi",
    "text-regulargpt": "regulargpt-c2",
}
BROKEN = "broken"


def write_checkpoints(directory: Path) -> Path:
    """Save every tiny model into ``directory/<id>`` and a broken folder beside them; returns directory."""
    torch.manual_seed(0)
    for model_id, tiny_id in TRANSDUCERS.items():
        model = build_tiny(tiny_id, vocab_size=2, num_labels=2)
        config = CheckpointConfig(
            architecture=ARCHITECTURE_OF[type(model.config)],
            model=model.config,
            kind="transduce",
            task="parity_check",
            alphabet="01",
            labels=("0", "1"),
        )
        save_checkpoint(model, config, directory / model_id)
    for model_id, tiny_id in LANGUAGE_MODELS.items():
        model = build_tiny(tiny_id, vocab_size=256, num_labels=0)
        config = CheckpointConfig(
            architecture=ARCHITECTURE_OF[type(model.config)], model=model.config, kind="generate", tokenizer="bytes"
        )
        save_checkpoint(model, config, directory / model_id)
    (directory / BROKEN).mkdir()
    (directory / BROKEN / "config.json").write_text("{not json")
    return directory
