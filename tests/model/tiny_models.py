"""Tiny configurations of every architecture, for tests that hold across all of them."""

from __future__ import annotations

import pytest
import torch

from model.config import (
    ARCHITECTURE_CONFIGS,
    BaseModelConfig,
    DiagonalLRNNConfig,
    LRNNConfig,
    LSTMConfig,
    RegularGPTConfig,
    TransformerConfig,
)
from model.registry import build_model


def tiny_configs(vocab_size: int, num_labels: int) -> dict[str, BaseModelConfig]:
    """One small model per architecture (and per position handling), keyed by a readable id."""
    common = {"vocab_size": vocab_size, "num_labels": num_labels, "d_model": 16}
    configs: dict[str, BaseModelConfig] = {
        "regulargpt-c2": RegularGPTConfig(**common, n_heads=2, d_ff=32, chunk_size=2, out_of_range="mask"),
        "regulargpt-c2-null": RegularGPTConfig(**common, n_heads=2, d_ff=32, chunk_size=2, out_of_range="null"),
        "regulargpt-c3-k2": RegularGPTConfig(**common, n_heads=2, d_ff=32, chunk_size=3, thickness=2),
        # C 5: windows whose runs hold fewer than C - 1 positions until the room grows (ring_slot)
        "regulargpt-c5": RegularGPTConfig(**common, n_heads=2, d_ff=32, chunk_size=5, out_of_range="null"),
        "lrnn": LRNNConfig(**common, n_layers=2, block_size=4, num_blocks=2, d_ff=32),
        "lrnn-spectral-b2": LRNNConfig(
            **common, n_layers=2, block_size=2, num_blocks=4, d_ff=32, transition_norm="spectral"
        ),
        "lrnn-spectral-b3": LRNNConfig(
            **common, n_layers=1, block_size=3, num_blocks=2, d_ff=32, transition_norm="spectral"
        ),
        "lrnn-rank3": LRNNConfig(**common, n_layers=2, block_size=4, num_blocks=2, d_ff=32, transition_rank=3),
        "lrnn-stochastic": LRNNConfig(
            **common, n_layers=2, block_size=3, num_blocks=2, d_ff=32, transition_norm="stochastic"
        ),
        "lrnn-orthogonal": LRNNConfig(
            **common, n_layers=2, block_size=3, num_blocks=2, d_ff=32, transition_norm="orthogonal"
        ),
        "lrnn-stochastic-rank2": LRNNConfig(
            **common, n_layers=2, block_size=3, num_blocks=2, d_ff=32, transition_norm="stochastic", transition_rank=2
        ),
        "lrnn-delta": LRNNConfig(**common, n_layers=2, block_size=3, num_blocks=2, d_ff=32, transition_norm="delta"),
        "lrnn-delta-sequential": LRNNConfig(
            **common, n_layers=2, block_size=3, num_blocks=2, d_ff=32, transition_norm="delta", scan_impl="sequential"
        ),
        "lrnn-delta-conv": LRNNConfig(
            **common, n_layers=2, block_size=3, num_blocks=2, d_ff=32, transition_norm="delta", short_conv=4
        ),
        "diagonal_lrnn": DiagonalLRNNConfig(**common, n_layers=2, state_size=8, d_ff=32),
        "lstm": LSTMConfig(**common, n_layers=2, hidden_size=24),
    }
    for position in ("sinusoidal", "alibi", "kerple", "t5", "xl"):
        configs[f"transformer-{position}"] = TransformerConfig(
            **common, n_layers=2, n_heads=2, d_ff=32, position=position
        )
    configs["transformer-alibi-logscaled"] = TransformerConfig(
        **common, n_layers=2, n_heads=2, d_ff=32, position="alibi", log_length_scaling=True
    )
    return configs


ARCHITECTURE_OF = {config_class: name for name, config_class in ARCHITECTURE_CONFIGS.items()}

MODEL_IDS = sorted(tiny_configs(5, 3))

# Tests parametrized with these run on the CPU everywhere and on CUDA where there is a GPU (CI has none).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def build_tiny(model_id: str, vocab_size: int, num_labels: int):
    """A freshly initialised tiny model (float32, train mode)."""
    config = tiny_configs(vocab_size, num_labels)[model_id]
    return build_model(ARCHITECTURE_OF[type(config)], config)
