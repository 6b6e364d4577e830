"""What a linear RNN's calls cost (model/lrnn/model.py: :meth:`LinearRNN.cost`, :meth:`LinearRNN.head_cost`,
:meth:`LinearRNN.cache_nbytes`): multiply-adds and peak bytes of each call path, for the scan that path runs at that
size, and the bytes a cache row holds. Functions of the configuration, the model's :class:`Sizes` (read once off
its layers), its dtype and device, and whether gradients are enabled (the "auto" scan's choice depends on it). The
context never matters: a cached chunk costs what the same chunk costs from an empty cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.base import CallPath, Cost
from model.config import DiagonalLRNNConfig, LRNNConfig
from model.ops.linear_scan import choose_scan_impl


@dataclass(frozen=True)
class Sizes:
    """What the costs read off a built model beyond its configuration: ``layers`` recurrent blocks, each state
    ``state_shape`` (H, b); ``weights``, the blocks' parameters, and ``tail``, those of the last block's readout and
    MLP."""

    layers: int
    state_shape: tuple[int, int]
    weights: int
    tail: int

    @property
    def state_size(self) -> int:
        """H b, the state's size."""
        heads, block = self.state_shape
        return heads * block


def cost(
    config: LRNNConfig | DiagonalLRNNConfig, sizes: Sizes, dtype: torch.dtype, device: torch.device,
    path: CallPath, rows: int, length: int, context: int = 0,
) -> Cost:
    """flops: per position the blocks' weights (projections, readout, MLP: one multiply-add each; "final" runs
    the last block's readout and MLP on the last positions only), per layer the scan (:func:`scan_flops`),
    and the head's d x output_size per logit position ("final": one per row). The context never matters: a
    cached chunk costs what the same chunk costs from an empty cache. nbytes: per position the transitions
    (:func:`transition_bytes`), ~6 d + 3 H b + 2 d_ff activations and the logits' output_size."""
    impl = scan_impl(config, sizes, dtype, device, rows, length)
    flops = rows * (length * sizes.weights + sizes.layers * scan_flops(config, sizes, impl, length))
    if path == "final":
        flops -= rows * (length - 1) * sizes.tail
    head = head_cost(config, dtype.itemsize, rows if path == "final" else rows * length)
    activations = (6 * config.d_model + 3 * sizes.state_size + 2 * config.d_ff) * dtype.itemsize
    return Cost(
        flops=float(flops + head.flops),
        nbytes=rows * length * (transition_bytes(sizes, impl, dtype.itemsize) + activations) + head.nbytes,
    )


def head_cost(config: LRNNConfig | DiagonalLRNNConfig, itemsize: int, positions: int) -> Cost:
    """d x output_size multiply-adds and output_size logits a position."""
    return Cost(flops=float(positions * config.d_model * config.output_size),
                nbytes=positions * config.output_size * itemsize)


def cache_nbytes(sizes: Sizes, itemsize: int) -> int:
    """One (H, b) state per layer, whatever the length."""
    return sizes.layers * sizes.state_size * itemsize


def scan_impl(
    config: LRNNConfig | DiagonalLRNNConfig, sizes: Sizes, dtype: torch.dtype, device: torch.device, rows: int,
    length: int,
) -> str:
    """The scan that runs on ``rows`` x ``length``: the configured one, or the "auto" policy's choice (the Triton
    scan where no gradient is asked for and the dtype allows it, the compiled loop for float32 on the CPU)."""
    heads, block = sizes.state_shape
    impl = config.scan_impl
    if impl == "auto":
        triton = not torch.is_grad_enabled() and dtype != torch.float64
        compiled = dtype == torch.float32
        impl = choose_scan_impl(rows, length, heads, block, device, triton, compiled)
    return impl


def scan_flops(config: LRNNConfig | DiagonalLRNNConfig, sizes: Sizes, impl: str, length: int) -> int:
    """Multiply-adds of one layer's scan ``impl`` over ``length`` positions of one row, H heads of b x b blocks: the
    loop does H b^2 per position; the parallel scan H (b^3 + 2 b^2) per position (it multiplies transitions
    together); the chunked scan (and the Triton scan, the same algorithm) the loop's work plus, on all chunks but
    the last of n = length // chunk_size, the products of the transitions inside each chunk and the scan across
    chunks, ~H (b^3 + 2 b^2) per position there; the compiled loop the loop's."""
    heads, block = sizes.state_shape
    if impl == "parallel":
        return length * heads * (block**3 + 2 * block**2)
    chunks = length // config.scan_chunk_size if impl in ("chunked", "triton") else 0
    products = max(chunks - 1, 0) * config.scan_chunk_size
    return heads * (length * block**2 + products * (block**3 + 2 * block**2))


def transition_bytes(sizes: Sizes, impl: str, itemsize: int) -> int:
    """Bytes per position of one layer's transitions while scan ``impl`` runs: (H, b, b) a few times over (the linear
    map's output, the norm constraint's copies, the scan's float32 copy), 2.5 times more in the parallel scan."""
    heads, block = sizes.state_shape
    copies = 4 + (3 if impl == "parallel" else 0)
    return copies * heads * block * block * max(itemsize, 4)
