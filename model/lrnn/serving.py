"""A linear RNN as served: weight layouts and the compiled decode step; values and checkpoints unchanged."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal, Protocol, cast

import numpy as np
import torch
from torch import nn

from model.config import BaseModelConfig
from model.layers import MLP, TokenEmbedding
from model.ops.cpu import cpu_decode


class Generator(Protocol):
    """What this module reads of a ``BlockDiagonalRecurrence`` (model/lrnn/model.py, which imports this module)."""

    rank: int | None
    stochastic: bool
    inputless: bool
    p_norm: float
    transition: nn.Linear
    input_proj: nn.Linear
    out_proj: nn.Linear

    @property
    def transition_norm(self) -> Literal["column", "spectral", "stochastic", "orthogonal", "delta"]: ...

    def joint_weight(self) -> torch.Tensor | None: ...


class Recurrent(Protocol):
    """What this module reads of a ``Recurrence``."""

    def for_serving(self, streaming: bool) -> bool: ...

    def fused_step_weights(self) -> list[torch.Tensor] | None: ...

    def joint_weight(self) -> torch.Tensor | None: ...


class Block(Protocol):
    """What this module reads of a ``RecurrentBlock``."""

    training: bool
    ln_1: nn.LayerNorm
    ln_2: nn.LayerNorm
    mlp: MLP

    @property
    def recurrence(self) -> Recurrent: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class Served(Protocol):
    """What this module reads of a ``LinearRNN``."""

    blocks: nn.ModuleList  # of RecurrentBlock
    embedding: TokenEmbedding

    @property
    def config(self) -> BaseModelConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...


def stack_generator_weights(recurrence: Generator, streaming: bool) -> bool:
    """Make g's and B's weights views of one matrix ((out, in) if ``streaming``, else (in, out)) for one product;
    returns whether anything moved."""
    if recurrence.rank is not None or recurrence.inputless or recurrence.joint_weight() is not None:
        return False
    joint = torch.cat([recurrence.transition.weight, recurrence.input_proj.weight])  # (H b^2 + H b, d)
    if not streaming:
        joint = joint.t().contiguous().t()  # (in, out) in memory
    size = recurrence.transition.out_features
    recurrence.transition.weight.data = joint[:size]  # (H b^2, d) viewing the joint matrix
    recurrence.input_proj.weight.data = joint[size:]  # (H b, d)
    return True


def joint_weight(recurrence: Generator) -> torch.Tensor | None:
    """The matrix g's and B's weights still view after :func:`stack_generator_weights`, or None."""
    if recurrence.rank is not None or recurrence.inputless:
        return None
    first, second = recurrence.transition.weight, recurrence.input_proj.weight  # (H b^2, d), (H b, d)
    rows, (out_stride, in_stride) = first.shape[0] + second.shape[0], first.stride()
    stacked = (
        (out_stride, in_stride) in ((first.shape[1], 1), (1, rows))
        and second.stride() == first.stride()
        and second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and second.data_ptr() == first.data_ptr() + first.shape[0] * out_stride * first.element_size()
        and (first.dtype, first.device) == (second.dtype, second.device)
    )
    if not stacked:
        return None
    shape, strides = (rows, first.shape[1]), (out_stride, in_stride)
    # the same tensor each step: what is cached on it (cpu_decode's panels)
    view: torch.Tensor | None = vars(recurrence).get("_joint_view")
    if view is None or view.data_ptr() != first.data_ptr() or view.shape != shape or view.stride() != strides:
        view = first.detach().as_strided(shape, strides)
        vars(recurrence)["_joint_view"] = view
    return view


def fused_step_weights(recurrence: Generator) -> list[torch.Tensor] | None:
    """[generator weight, g bias, B bias, readout weight, readout bias] where the compiled step runs the recurrence,
    else None."""
    if recurrence.rank is not None or recurrence.transition_norm not in ("column", "stochastic"):
        return None
    weight: torch.Tensor | None
    if recurrence.stochastic:
        weight, inputs_bias = recurrence.transition.weight, recurrence.transition.bias.new_empty(0)  # (H b^2, d), (0,)
    else:
        weight, inputs_bias = recurrence.joint_weight(), recurrence.input_proj.bias  # (H b^2 + H b, d) or None, (H b,)
    if weight is None or not weight.is_contiguous() or weight.dtype != torch.float32:
        return None
    return [weight, recurrence.transition.bias, inputs_bias, recurrence.out_proj.weight, recurrence.out_proj.bias]


def step_arrays(block: Block) -> list[np.ndarray] | None:
    """What ``cpu_decode.lrnn_layer_step`` takes from a block (or None), kept until parameters change."""
    invariant = cpu_decode.row_invariant()
    held = block.__dict__.get("_held_step_arrays")  # (parameters, their stamps and the invariance, arrays)
    if held is not None and held[1] == (invariant, *map(cpu_decode.stamp, held[0])):
        held_arrays: list[np.ndarray] | None = held[2]
        return held_arrays
    weights = block.recurrence.fused_step_weights()
    arrays = None
    if weights is not None:
        ln_1, ln_2, mlp = block.ln_1, block.ln_2, block.mlp
        arrays = cpu_decode.layer_step_arrays(
            [
                ln_1.weight,
                ln_1.bias,
                *weights,
                ln_2.weight,
                ln_2.bias,
                mlp.c_fc.weight,
                mlp.c_fc.bias,
                mlp.c_proj.weight,
                mlp.c_proj.bias,
            ]
        )
    parameters = list(block.parameters())
    block.__dict__["_held_step_arrays"] = (parameters, (invariant, *map(cpu_decode.stamp, parameters)), arrays)
    return arrays


def compiled_step(block: Block, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A block's step as one compiled call where served on the CPU with few rows, else None."""
    if block.training or not cpu_decode.compiles_step(x):
        return None
    arrays = step_arrays(block)
    if arrays is None or state.dtype != torch.float32:
        return None
    recurrence = cast(Generator, block.recurrence)  # only a BlockDiagonalRecurrence has step arrays
    transitions = recurrence.transition_norm
    assert transitions in ("column", "stochastic")  # (fused_step_weights refuses the others)
    return cpu_decode.lrnn_layer_step(x, state, arrays, block.ln_1.eps, transitions, recurrence.p_norm)


def lay_out_weights(model: Served) -> list[str]:
    """On the CPU, lay weights out for one-token products; returns a note per change."""
    streaming = cpu_decode.streams(dtype=model.dtype)
    blocks = cast("Iterable[Block]", model.blocks)
    joined = sum(block.recurrence.for_serving(streaming) for block in blocks)
    notes = [f"{joined} layers make g(u) and B u with one product (CPU)"] if joined else []
    if streaming:
        fused = sum(block.recurrence.fused_step_weights() is not None for block in blocks)
        if fused:
            notes.append(f"{fused} layers step as one compiled call each at {cpu_decode.rows_note()} (CPU)")
        notes.append("one-token products through the streaming matrix-vector kernel (CPU, one thread)")
        return notes
    wide = [
        module.weight
        for module in model.blocks.modules()
        if isinstance(module, nn.Linear) and module.out_features > module.in_features
    ]
    head = model.embedding.embed.weight  # (V, d): the tied head multiplies by its transpose
    if model.config.is_language_model and head.shape[0] > head.shape[1]:
        wide.append(head)
    moved = [weight for weight in wide if weight.stride(0) != 1]  # not (in, out) in memory yet
    for weight in moved:
        weight.data = weight.data.t().contiguous().t()  # (out, in) with (in, out) in memory
    if moved:
        notes.append(f"{len(moved)} weight matrices wider than tall stored transposed for one-token products (CPU)")
    return notes


def product_weights(
    blocks: nn.ModuleList, default: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]
) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """``default``, with a recurrence's stacked g/B matrix in place of its two weights."""
    joints: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []
    for block in cast("Iterable[Block]", blocks):
        joint = block.recurrence.joint_weight()
        if joint is not None:
            recurrence = cast(Generator, block.recurrence)  # only a BlockDiagonalRecurrence stacks its weights
            joints.append((joint, (recurrence.transition.weight, recurrence.input_proj.weight)))
    stacked = {id(owner) for _, owners in joints for owner in owners}
    return [*(pair for pair in default if id(pair[0]) not in stacked), *joints]
