"""The block-diagonal linear recurrence as Triton kernels (:func:`scan_triton`, forward only, blocks up to
``MAX_BLOCK``): per-chunk summaries, chunk start states, then every chunk from its start, three launches at any T.
Float32 inside; runs on CUDA or, with TRITON_INTERPRET=1 set before Triton's import, in its interpreter (tests)."""

from __future__ import annotations

import functools
import os

import torch

MAX_BLOCK = 16  # the product of stage 1 is a (b, b, b) temporary in registers: 4,096 floats at b = 16
MAX_ROWS_TIMES_HEADS = 65_535  # CUDA's limit on a grid's second axis; chunks take the first (2^31 - 1)


@functools.cache
def available() -> bool:
    """Whether Triton is importable here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def scan_triton(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None = None, chunk_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """As the torch scans (model/ops/scan/), forward only; ValueError for what :func:`refusal` refuses."""
    problem = refusal(transitions, inputs, initial_state, chunk_size)
    if problem:
        raise ValueError(problem)
    if inputs.device.type == "cuda":
        with torch.cuda.device(inputs.device):  # Triton launches on the current device
            return _scan(transitions, inputs, initial_state, chunk_size)
    return _scan(transitions, inputs, initial_state, chunk_size)


def _scan(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    from model.ops.scan import triton_kernels as kernels  # imports Triton: only here

    batch, length, heads, block = inputs.shape
    a, x = transitions.float(), inputs.float()  # (B, T, H, b, b), (B, T, H, b): no copy when already float32
    h0 = x.new_zeros((batch, heads, block)) if initial_state is None else initial_state.float()  # (B, H, b)
    states = x.new_empty((batch, length, heads, block))  # (B, T, H, b)
    padded = max(next_power_of_2(block), 2)  # tl.arange needs a power of 2
    chunks = -(-length // chunk_size)
    sizes, strides = (heads, length, block, chunk_size), (*a.stride(), *x.stride())
    if chunks == 1:
        starts, chunk_stride = h0, 0  # (B, H, b)
    else:
        products = x.new_empty((batch, heads, chunks - 1, block, block))  # (B, H, n - 1, b, b)
        finals = x.new_empty((batch, heads, chunks - 1, block))  # (B, H, n - 1, b)
        kernels.chunk_summary_kernel[(chunks - 1, batch * heads)](
            a, x, products, finals, *sizes, *strides, BLOCK=padded
        )
        starts = x.new_empty((batch, heads, chunks, block))  # (B, H, n, b)
        kernels.chunk_starts_kernel[(batch * heads,)](
            products, finals, h0, *h0.stride(), starts, heads, chunks, block, BLOCK=padded
        )
        chunk_stride = starts.stride(2)
    kernels.chunk_states_kernel[(chunks, batch * heads)](
        a,
        x,
        starts,
        starts.stride(0),
        starts.stride(1),
        chunk_stride,
        starts.stride(-1),
        states,
        *states.stride(),
        *sizes,
        *strides,
        BLOCK=padded,
    )
    return states.to(inputs.dtype), states[:, -1].to(inputs.dtype)


def refusal(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None, chunk_size: int
) -> str | None:
    """Why ``scan_triton`` cannot take these arguments, or None."""
    if not available():
        return "the triton scan needs the triton package (installed with CUDA builds of torch)"
    if inputs.dim() != 4:
        return f"inputs must have shape (B, T, H, b), got {tuple(inputs.shape)}"
    batch, length, heads, block = inputs.shape
    if transitions.shape != (batch, length, heads, block, block):
        return (
            f"transitions must have shape {(batch, length, heads, block, block)} to match inputs "
            f"{tuple(inputs.shape)}, got {tuple(transitions.shape)}"
        )
    if initial_state is not None and initial_state.shape != (batch, heads, block):
        return f"initial_state must have shape {(batch, heads, block)}, got {tuple(initial_state.shape)}"
    if length == 0:
        return "the scan needs at least one time step"
    if block > MAX_BLOCK:
        return f"the triton scan takes blocks of at most {MAX_BLOCK}, got {block}"
    if chunk_size < 1:
        return f"chunk_size must be >= 1, got {chunk_size}"
    if batch * heads > MAX_ROWS_TIMES_HEADS:
        return f"the triton scan takes at most {MAX_ROWS_TIMES_HEADS} rows x heads (a grid axis), got {batch * heads}"
    tensors = [transitions, inputs] + ([] if initial_state is None else [initial_state])
    if any(tensor.dtype == torch.float64 for tensor in tensors):
        return "the triton scan computes in float32; use a torch scan for float64"
    if len({tensor.device for tensor in tensors}) != 1:
        return "transitions, inputs and initial_state must be on one device"
    if inputs.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the triton scan runs on CUDA tensors, got {inputs.device.type} ones (or set TRITON_INTERPRET=1)"
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        return "the triton scan has no backward; train with a torch scan"
    return None


def next_power_of_2(value: int) -> int:
    """The smallest power of 2 >= value (as triton.next_power_of_2, without importing Triton)."""
    return 1 << max(value - 1, 0).bit_length()
