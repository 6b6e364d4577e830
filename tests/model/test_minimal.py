"""The minimal references (model/lrnn/minimal.py, model/regulargpt/minimal.py) give the real models' per-position logits on the real models' weights:
random weights large enough that attention is far from uniform and the column constraint binds, float64, odd
lengths past several depths, transducers and language models."""

from __future__ import annotations

import pytest
import torch

from model.config import LRNNConfig, RegularGPTConfig
from model.lrnn.minimal import lrnn
from model.lrnn.model import BlockDiagonalLRNN
from model.regulargpt.minimal import regulargpt
from model.regulargpt.model import RegularGPT

VOCAB = 5
LENGTHS = [1, 7, 29]


def randomized(model: torch.nn.Module, std: float) -> torch.nn.Module:
    """The model in float64, eval mode, every parameter drawn from N(0, std^2)."""
    generator = torch.Generator().manual_seed(0)
    model = model.double().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * std)
    return model


@pytest.mark.parametrize(
    ("chunk_size", "thickness", "out_of_range", "impl", "block_norm"),
    [
        (2, 1, "mask", "auto", "pre"),
        (2, 2, "null", "auto", "post"),
        (3, 2, "mask", "fast", "post"),
        (3, 1, "null", "fast", "pre"),
        (5, 1, "null", "reference", "pre"),
        (2, 1, "null", "reference", "post"),
    ],
)
@pytest.mark.parametrize("num_labels", [0, 3])
def test_regulargpt_minimal_gives_the_models_logits(
    chunk_size: int, thickness: int, out_of_range: str, impl: str, block_norm: str, num_labels: int
) -> None:
    config = RegularGPTConfig(
        vocab_size=VOCAB,
        num_labels=num_labels,
        d_model=8,
        n_heads=2,
        d_ff=16,
        chunk_size=chunk_size,
        thickness=thickness,
        out_of_range=out_of_range,
        attention_impl=impl,
        block_norm=block_norm,
    )
    model = randomized(RegularGPT(config), std=0.5)
    for length in LENGTHS:
        tokens = torch.randint(VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = model(tokens)  # (B, T, V)
            got = regulargpt(
                tokens,
                model.state_dict(),
                config.n_heads,
                chunk_size,
                thickness,
                config.layer_norm_eps,
                post_norm=block_norm == "post",
            )
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("p_norm", "rank"), [(1.2, None), (2.0, None), (1.2, 3)])
@pytest.mark.parametrize("num_labels", [0, 3])
def test_lrnn_minimal_gives_the_models_logits(p_norm: float, rank: int | None, num_labels: int) -> None:
    config = LRNNConfig(
        vocab_size=VOCAB,
        num_labels=num_labels,
        d_model=16,
        n_layers=2,
        block_size=4,
        num_blocks=2,
        d_ff=32,
        p_norm=p_norm,
        transition_rank=rank,
    )
    model = randomized(BlockDiagonalLRNN(config), std=0.3)  # g(u)'s columns far outside the unit p-ball
    for length in LENGTHS:
        tokens = torch.randint(VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = model(tokens)  # (B, T, V)
            got = lrnn(tokens, model.state_dict(), config.num_blocks, config.block_size, p_norm, config.layer_norm_eps)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
