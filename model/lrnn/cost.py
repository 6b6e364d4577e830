"""A linear RNN's call costs and cache bytes, for the scan each call runs; the context never matters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import DiagonalLRNNConfig, LRNNConfig
from model.ops.scan.delta import runs_sequential
from model.ops.scan.dispatch import choose_scan_impl
from model.serving import CallPath, Cost


@dataclass(frozen=True)
class Sizes:
    """What costs read off a built model: ``layers``, ``state_shape`` (H, b), ``weights`` (blocks' parameters),
    ``tail`` (the last block's readout and MLP), and each block's state ``codes`` searched after every ``snap_every``-th
    symbol (0: none)."""

    layers: int
    state_shape: tuple[int, int]
    weights: int
    tail: int
    codes: int = 0
    snap_every: int = 0

    @property
    def state_size(self) -> int:
        heads, block = self.state_shape
        return heads * block


def cost(
    config: LRNNConfig | DiagonalLRNNConfig,
    sizes: Sizes,
    dtype: torch.dtype,
    device: torch.device,
    path: CallPath,
    rows: int,
    length: int,
    context: int = 0,
) -> Cost:
    """flops: the blocks' weights per position (the tail at last positions only for "final"), :func:`scan_flops` and
    :func:`snap_flops` per layer, the head per logit. nbytes: per position :func:`transition_bytes` (for the delta
    rule :func:`delta_bytes`) and activations, plus the logits."""
    impl = scan_impl(config, sizes, dtype, device, rows, length)
    per_layer = scan_flops(config, sizes, impl, length) + snap_flops(sizes, length)
    flops = rows * (length * sizes.weights + sizes.layers * per_layer)
    if path == "final":
        flops -= rows * (length - 1) * sizes.tail
    head = head_cost(config, dtype.itemsize, rows if path == "final" else rows * length)
    if isinstance(config, LRNNConfig) and config.transition_norm == "delta":
        scan_bytes = delta_bytes(config, length, dtype.itemsize)
    else:
        scan_bytes = transition_bytes(sizes, impl, dtype.itemsize)
    activations = (6 * config.d_model + 3 * sizes.state_size + 2 * config.d_ff) * dtype.itemsize
    searches = rows * sizes.state_shape[0] * sizes.codes * 4 if sizes.snap_every else 0  # a snap's float32 distances
    return Cost(
        flops=float(flops + head.flops),
        nbytes=rows * length * (scan_bytes + activations) + searches + head.nbytes,
    )


def head_cost(config: LRNNConfig | DiagonalLRNNConfig, itemsize: int, positions: int) -> Cost:
    return Cost(
        flops=float(positions * config.d_model * config.output_size), nbytes=positions * config.output_size * itemsize
    )


def cache_nbytes(sizes: Sizes, itemsize: int) -> int:
    return sizes.layers * sizes.state_size * itemsize


def scan_impl(
    config: LRNNConfig | DiagonalLRNNConfig,
    sizes: Sizes,
    dtype: torch.dtype,
    device: torch.device,
    rows: int,
    length: int,
) -> str:
    """The scan run on ``rows`` x ``length``: the configured one, or the "auto" choice."""
    heads, block = sizes.state_shape
    impl: str = config.scan_impl
    if impl == "auto":
        triton = not torch.is_grad_enabled() and dtype != torch.float64
        compiled = dtype == torch.float32
        impl = choose_scan_impl(rows, length, heads, block, device, triton, compiled)
    return impl


def scan_flops(config: LRNNConfig | DiagonalLRNNConfig, sizes: Sizes, impl: str, length: int) -> int:
    """One row's multiply-adds for a layer's scan: H b^2 per position, H (b^3 + 2 b^2) for the parallel scan and on all
    but the last chunk for chunked and Triton; :func:`delta_flops` for the delta rule."""
    if isinstance(config, LRNNConfig) and config.transition_norm == "delta":
        return delta_flops(config, length)
    heads, block = sizes.state_shape
    if impl == "parallel":
        return length * heads * (block**3 + 2 * block**2)
    chunks = length // config.scan_chunk_size if impl in ("chunked", "triton") else 0
    products = max(chunks - 1, 0) * config.scan_chunk_size
    return heads * (length * block**2 + products * (block**3 + 2 * block**2))


def delta_flops(config: LRNNConfig, length: int) -> int:
    """One row's multiply-adds for a delta-rule layer (model/ops/scan/delta.py) past its projections, per head: S k and
    S q a token for the reference loop and one token; else per chunk of C (whole ones, then one of what is left):
    K K^T, Q K^T and their product with U' (3 C^2 b), the triangular solve for W and U (C^2 b), K^T W, U^T K, W S^T
    and Q S^T (4 C b^2), and the chunks' scan, one step per chunk of each of the b value rows (b^3 + 2 b^2 each)."""
    heads, size = config.num_blocks, config.block_size
    if runs_sequential(config.scan_impl, length):
        return length * heads * 2 * size**2
    chunk = max(min(config.scan_chunk_size, length), 1)  # length 0: a call that only reads the cache
    whole, rest = divmod(length, chunk)
    return heads * sum(
        count * (4 * span**2 * size + 4 * span * size**2 + size * (size**3 + 2 * size**2))
        for count, span in ((whole, chunk), (rest > 0, rest))
    )


def delta_bytes(config: LRNNConfig, length: int, itemsize: int) -> int:
    """Bytes per position of a delta-rule layer's chunked form: float32 (at least) copies of q, k, v and beta and the
    outputs, the chunk's C x C products, and each chunk's transition expanded over the b value rows, twice in the
    scan; with a short convolution, its input with the history, its sums and their SiLU (3 b each)."""
    heads, size = config.num_blocks, config.block_size
    chunk = max(min(config.scan_chunk_size, length), 1)  # length 0: a call that only reads the cache
    convolution = 9 * size if config.short_conv else 0
    return heads * (12 * size + convolution + 3 * chunk + -(-3 * size**3 // chunk)) * max(itemsize, 4)


def snap_flops(sizes: Sizes, length: int) -> int:
    """One row's work for a layer's nearest-code searches over ``length`` symbols: 3 b per code, block and snap."""
    if not sizes.snap_every:
        return 0
    heads, block = sizes.state_shape
    return -(-length // sizes.snap_every) * heads * sizes.codes * 3 * block


def transition_bytes(sizes: Sizes, impl: str, itemsize: int) -> int:
    """Bytes per position of one layer's transitions during scan ``impl``."""
    heads, block = sizes.state_shape
    copies = 4 + (3 if impl == "parallel" else 0)
    return copies * heads * block * block * max(itemsize, 4)
