"""Architecture name -> model class. Imports are deferred so that reading a config needs no model code."""

from __future__ import annotations

import importlib

from model.base import SequenceModel
from model.config import ARCHITECTURE_CONFIGS, BaseModelConfig, ConfigError

MODEL_CLASSES: dict[str, str] = {
    "regulargpt": "model.regulargpt.model:RegularGPT",
    "lrnn": "model.lrnn.model:BlockDiagonalLRNN",
    "diagonal_lrnn": "model.lrnn.diagonal:DiagonalLRNN",
    "transformer": "model.transformer.model:Transformer",
    "lstm": "model.lstm.model:LSTMModel",
    "exact": "model.transformer.exact:ExactTransformer",
}
assert set(MODEL_CLASSES) == set(ARCHITECTURE_CONFIGS)


def model_class(architecture: str) -> type[SequenceModel]:
    try:
        module_name, class_name = MODEL_CLASSES[architecture].split(":")
    except KeyError:
        raise ConfigError(f"unknown architecture {architecture!r}; known: {sorted(MODEL_CLASSES)}") from None
    cls: type[SequenceModel] = getattr(importlib.import_module(module_name), class_name)
    return cls


def build_model(architecture: str, config: BaseModelConfig) -> SequenceModel:
    """A freshly initialised model of ``architecture`` from its hyper-parameters."""
    expected = ARCHITECTURE_CONFIGS[architecture]
    if type(config) is not expected:
        raise ConfigError(f"architecture {architecture!r} needs a {expected.__name__}, got {type(config).__name__}")
    return model_class(architecture)(config)
