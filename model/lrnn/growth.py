"""Growing a block-diagonal LRNN to more blocks per layer."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, cast

import torch
from torch import nn

from model.config import LRNNConfig
from model.lrnn.serving import Generator

GROWN_SPREAD = 0.3  # how far g(u)'s entries vary with the input in a stochastic block added by grown_from


class Growable(Protocol):
    """What :func:`grown_from` reads of a ``BlockDiagonalLRNN`` (model/lrnn/model.py, which imports this module)."""

    blocks: nn.ModuleList  # of RecurrentBlock

    def __init__(self, config: LRNNConfig) -> None: ...

    @property
    def config(self) -> LRNNConfig: ...

    def state_dict(self) -> dict[str, Any]: ...


def grown_from(model: Growable, weights: dict[str, torch.Tensor], generated_spread: float) -> dict[str, torch.Tensor]:
    """A state dict for ``model`` computing what ``weights`` (the same LRNN with fewer blocks per layer) did: old
    tensors lead, new readout columns are zero; new "stochastic" blocks start inside their sparsemax's support.
    ValueError for other weights."""
    config = model.config
    if config.transition_norm == "delta":
        raise ValueError("a delta-rule LRNN does not grow: its heads' keys span the head, a new head reads nothing")
    size, readout = config.block_size, weights.get("blocks.0.recurrence.out_proj.weight")
    old_blocks = 0 if readout is None else readout.shape[-1] // size
    if not 0 < old_blocks < config.num_blocks:
        raise ValueError(
            f"not an LRNN of blocks of {size} with fewer than {config.num_blocks} blocks per "
            f"layer (its first layer's readout: {None if readout is None else tuple(readout.shape)})"
        )
    with torch.device("meta"):  # the smaller model's shapes, no weights drawn
        expected = type(model)(dataclasses.replace(config, num_blocks=old_blocks)).state_dict()
    wrong = [
        f"{name}: {None if name not in weights else tuple(weights[name].shape)} there, {tuple(shape.shape)} expected"
        for name, shape in expected.items()
        if name not in weights or weights[name].shape != shape.shape
    ]
    if wrong or len(weights) != len(expected):
        raise ValueError(f"not this LRNN with {old_blocks} blocks per layer: {'; '.join(wrong) or 'other tensors'}")
    grown = {}
    for name, fresh in model.state_dict().items():
        grown[name] = tensor = fresh.clone()
        tensor[tuple(slice(0, length) for length in weights[name].shape)] = weights[name]
    old_state = old_blocks * size  # H b there
    diagonal = (0.5 * torch.eye(size)).repeat(config.num_blocks - old_blocks, 1, 1)  # (new H, b, b)
    for index, block in enumerate(model.blocks):
        prefix = f"blocks.{index}.recurrence."
        grown[prefix + "out_proj.weight"][:, old_state:] = 0
        if cast(Generator, block.recurrence).stochastic:
            grown[prefix + "transition.bias"][old_state * size :] = diagonal.flatten()
            grown[prefix + "transition.weight"][old_state * size :] *= GROWN_SPREAD / generated_spread
    return grown
