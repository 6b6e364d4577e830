"""``linear_scan``: the scan through a named implementation, or the one ``choose_scan_impl`` picks for the shape and
device ("auto")."""

from __future__ import annotations

from typing import Literal

import torch

from model.ops.cpu import cpu_decode
from model.ops.scan.compiled import scan_compiled
from model.ops.scan.parallel import scan_chunked, scan_parallel
from model.ops.scan.reference import scan_sequential
from model.ops.scan.signature import ScanResult
from model.ops.scan.triton import MAX_BLOCK, MAX_ROWS_TIMES_HEADS, available, refusal, scan_triton

ScanImpl = Literal["auto", "sequential", "parallel", "chunked", "triton", "compiled"]


CUDA_PARALLEL_MAX_BYTES = 512 * 2**20  # transitions up to this size take the parallel scan on CUDA


def choose_scan_impl(
    batch: int, length: int, heads: int, block: int, device: torch.device, triton: bool = True, compiled: bool = True
) -> str:
    """The "auto" policy. CPU: "compiled" if allowed, else "chunked" up to 32 batch x heads, else "sequential". CUDA:
    "triton" if allowed, else "parallel" up to ``CUDA_PARALLEL_MAX_BYTES`` of transitions, else "chunked"."""
    if device.type == "cpu" and compiled and cpu_decode.kernel_available():
        return "compiled"
    if device.type == "cuda":
        if triton and available() and block <= MAX_BLOCK and batch * heads <= MAX_ROWS_TIMES_HEADS:
            return "triton"
        transition_bytes = batch * length * heads * block * block * 4  # float32 inside
        return "parallel" if transition_bytes <= CUDA_PARALLEL_MAX_BYTES else "chunked"
    return "chunked" if batch * heads <= 32 else "sequential"


def linear_scan(
    transitions: torch.Tensor,
    inputs: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    impl: ScanImpl = "auto",
    chunk_size: int = 64,
) -> ScanResult:
    """Dispatch to ``scan_<impl>`` ("auto": :func:`choose_scan_impl`); ValueError for an unknown impl."""
    if impl == "auto":
        # only on CUDA: asking imports Triton, which a CPU process has no use for
        triton = inputs.device.type == "cuda" and refusal(transitions, inputs, initial_state, chunk_size) is None
        compiled = inputs.device.type == "cpu" and cpu_decode.compiles_scan(transitions, inputs, initial_state)
        batch, length, heads, block = inputs.shape
        impl = choose_scan_impl(batch, length, heads, block, inputs.device, triton, compiled)  # type: ignore[assignment]
    if impl == "sequential":
        return scan_sequential(transitions, inputs, initial_state)
    if impl == "parallel":
        return scan_parallel(transitions, inputs, initial_state)
    if impl == "chunked":
        return scan_chunked(transitions, inputs, initial_state, chunk_size=chunk_size)
    if impl == "triton":
        return scan_triton(transitions, inputs, initial_state, chunk_size=chunk_size)
    if impl == "compiled":
        return scan_compiled(transitions, inputs, initial_state)
    raise ValueError(f"unknown scan impl {impl!r}; choose auto, sequential, parallel, chunked, triton or compiled")
