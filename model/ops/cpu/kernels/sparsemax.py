"""The column sparsemax and its backward (``cpu_decode.column_sparsemax``), and the LRNN layer step's inline one-block
sparsemax, compiled by :func:`build_sparsemax`."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import numpy as np

from model.ops.cpu.kernels.helpers import block_sparsemax, reassociating_jit


class Sparsemax(NamedTuple):
    """The column sparsemax kernels, each compiled on its first call; ``block`` is inline, for compiled code."""

    block: Callable[..., None]  # sparsemax_block(block (b b,), size, scratch (4, b)): one block, in place
    columns: Callable[..., None]  # sparsemax_columns(flat (N b b,), size): every block, in place
    backward: Callable[..., None]  # sparsemax_columns_backward(output, grad, size): the input's gradient, in grad


def build_sparsemax(numba: ModuleType) -> Sparsemax:
    """The column sparsemax, its backward and its inline one-block piece."""
    jit = reassociating_jit(numba)
    (vector_sparsemax_8, vector_backward_8), (vector_sparsemax_16, vector_backward_16) = (
        block_sparsemax(numba, size) for size in (8, 16)
    )

    @jit(inline="always")
    def sparsemax_block(block: np.ndarray, size: int, scratch: np.ndarray) -> None:
        """block (b b,), row-major b x b, in place: each column its sparsemax max(v - tau, 0), without a sort: entry i
        is in the support where 1 + k_i v_i > s_i (k_i, s_i: count and sum of the column's entries >= v_i), tau =
        (s-1)/k over the support; a NaN column stays NaN. Branch-free, columns in lanes. scratch: (4, b). Blocks of 8
        and 16 run :func:`block_sparsemax`, bit for bit the same."""
        if size == 16:
            vector_sparsemax_16(block, 0)
            return
        if size == 8:
            vector_sparsemax_8(block, 0)
            return
        count, partial, support, total = scratch[0], scratch[1], scratch[2], scratch[3]
        support[:] = 0.0
        total[:] = 0.0
        for i in range(size):
            count[:] = 0.0
            partial[:] = 0.0
            for m in range(size):
                for j in range(size):
                    taken = np.float32(block[m * size + j] >= block[i * size + j])
                    count[j] += taken
                    partial[j] += taken * block[m * size + j]
            for j in range(size):
                value = block[i * size + j]
                inside = np.float32(count[j] * value > partial[j] - np.float32(1.0))  # in float32, as column_sparsemax
                support[j] += inside
                total[j] += inside * value
        for j in range(size):
            tau = (total[j] - np.float32(1.0)) / support[j] if support[j] > 0 else np.float32(np.nan)
            for i in range(size):
                block[i * size + j] = max(block[i * size + j] - tau, np.float32(0.0))

    @jit
    def sparsemax_columns(
        flat: np.ndarray, size: int
    ) -> None:  # (N b b,): N row-major b x b blocks, each in place -> sparsemax_block's
        scratch = np.empty((4, size), dtype=np.float32)
        for start in range(0, flat.shape[0], size * size):
            sparsemax_block(flat[start : start + size * size], size, scratch)

    @jit
    def sparsemax_columns_backward(output: np.ndarray, grad: np.ndarray, size: int) -> None:
        """(N b b,) each: the outputs, and their gradient, replaced in place by the inputs' gradient: on a column's
        support (positive outputs) the gradient less its mean there, else 0."""
        for start in range(0, output.shape[0], size * size):
            if size == 16:
                vector_backward_16(output, grad, start)
                continue
            if size == 8:
                vector_backward_8(output, grad, start)
                continue
            for j in range(size):
                support, total = 0, np.float32(0.0)
                for i in range(size):
                    if output[start + i * size + j] > 0:
                        support += 1
                        total += grad[start + i * size + j]
                mean = total / np.float32(support) if support else np.float32(0.0)
                for i in range(size):
                    index = start + i * size + j
                    grad[index] = grad[index] - mean if output[index] > 0 else np.float32(0.0)

    return Sparsemax(sparsemax_block, sparsemax_columns, sparsemax_columns_backward)
