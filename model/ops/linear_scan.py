"""The linear recurrence h_t = A_t h_{t-1} + b_t with block-diagonal A_t, and the LRNN's transition constraints. Each
``scan_<impl>(transitions (B, T, H, b, b), inputs (B, T, H, b), initial_state (B, H, b) or None) -> (states (B, T, H,
b), final_state (B, H, b))`` computes in at least float32 and returns the input dtype; :func:`linear_scan` dispatches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch

from model.ops import cpu_decode
from model.ops.triton_scan import MAX_BLOCK, MAX_ROWS_TIMES_HEADS, available, refusal, scan_triton

ScanImpl = Literal["auto", "sequential", "parallel", "chunked", "triton", "compiled"]
ScanResult = tuple[torch.Tensor, torch.Tensor]


def scan_step(transition: torch.Tensor, input: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One step: transition (B, H, b, b), input (B, H, b), state (B, H, b) -> A state + input (B, H, b)."""
    return torch.matmul(transition, state.unsqueeze(-1)).squeeze(-1) + input  # (B, H, b)


def column_norm_constraint(matrices: torch.Tensor, p: float = 1.2) -> torch.Tensor:
    """Scale every column v (along dim -2) of every block of matrices (..., b, b) by 1 / max(1, ||v||_p)."""
    return (matrices / column_divisors(matrices, p)).to(matrices.dtype)  # (..., b, b)


def column_divisors(matrices: torch.Tensor, p: float = 1.2) -> torch.Tensor:
    """matrices (..., b, b) -> max(1, ||v||_p) per column, (..., 1, b), in at least float32, as max(1, sum
    |v_i|^p)^(1/p): gradient 0, never NaN, inside the ball."""
    powered = matrices.to(_compute_dtype(matrices.dtype)).abs().pow(p)  # (..., b, b)
    return powered.sum(dim=-2, keepdim=True).clamp(min=1.0).pow(1.0 / p)  # (..., 1, b)


def column_sparsemax(matrices: torch.Tensor) -> torch.Tensor:
    """Project every column (along dim -2) of matrices (..., b, b) onto the simplex: max(v - tau, 0) summing to 1, with
    exact zeros (sparsemax, Martins & Astudillo 2016). In at least float32."""
    compiled = cpu_decode.column_sparsemax(matrices)  # float32 on the CPU with numba (its own backward), else None
    if compiled is not None:
        return compiled
    values = matrices.to(_compute_dtype(matrices.dtype))  # (..., b, b)
    ordered = values.sort(dim=-2, descending=True).values  # (..., b, b)
    ranks = torch.arange(1, values.shape[-2] + 1, device=values.device, dtype=values.dtype).unsqueeze(-1)  # (b, 1)
    cumulative = ordered.cumsum(dim=-2) - 1  # (..., b, b)
    support = (ordered * ranks > cumulative).sum(dim=-2, keepdim=True)  # (..., 1, b): k, at least 1
    tau = cumulative.gather(-2, support - 1) / support.to(values.dtype)  # (..., 1, b)
    return (values - tau).clamp(min=0).to(matrices.dtype)  # (..., b, b)


OrthogonalImpl = Literal["newton_schulz", "svd"]
POLAR_ITERATIONS = 32  # at most: singular values from 1e-4 of the Frobenius norm reach 1 in float32
POLAR_TOLERANCE = 1e-6  # a block's Newton-Schulz stops once every |X^T X - I| entry of it is below this


def orthogonal_constraint(matrices: torch.Tensor, impl: OrthogonalImpl = "newton_schulz") -> torch.Tensor:
    """The orthogonal polar factor U V^T of every block of matrices (..., b, b) = U S V^T: the nearest orthogonal
    matrix (reflections included), so products of any length keep norms. In at least float32. "svd": from the
    decomposition (the reference; its gradient is undefined where singular values repeat); "newton_schulz": X <- X (3 I
    - X^T X) / 2 from X sqrt(3) 0.99 / ||X||_F, smooth, equal to it within 1e-5 for blocks whose smallest singular
    value is above 1e-4 of their Frobenius norm."""
    blocks = matrices.to(_compute_dtype(matrices.dtype))  # (..., b, b)
    if impl == "svd":
        left, _, right = torch.linalg.svd(blocks)
        polar: torch.Tensor = left @ right  # (..., b, b)
        return polar.to(matrices.dtype)
    if impl != "newton_schulz":
        raise ValueError(f"unknown orthogonal impl {impl!r}; choose newton_schulz or svd")
    size = blocks.shape[-1]
    polar = blocks.reshape(-1, size, size).permute(1, 2, 0).contiguous()  # (b, b, N): one vector op per entry
    polar = polar * (3**0.5 * 0.99 / polar.square().sum(dim=(0, 1)).sqrt().clamp(min=1e-12))  # singular values < sqrt 3
    identity = torch.eye(size, dtype=polar.dtype, device=polar.device).unsqueeze(-1)  # (b, b, 1)
    for _ in range(POLAR_ITERATIONS):  # a block stops once it has converged: its bits never depend on the others
        gram = _blocks_product(polar.transpose(0, 1), polar)  # X^T X (b, b, N)
        moving = (gram.detach() - identity).abs().amax(dim=(0, 1)) >= POLAR_TOLERANCE  # (N,)
        if not bool(moving.any()):
            break
        polar = torch.where(moving, 1.5 * polar - 0.5 * _blocks_product(polar, gram), polar)
    return polar.permute(2, 0, 1).reshape(blocks.shape).to(matrices.dtype)  # (..., b, b)


def _blocks_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left @ right for N pairs of b x b blocks laid out (b, b, N): b broadcast products (batched matmul of tiny
    blocks costs ~10x more on the CPU)."""
    product = left[:, :1] * right[:1]
    for j in range(1, left.shape[1]):
        product = product + left[:, j : j + 1] * right[j : j + 1]
    return product


SpectralImpl = Literal["auto", "svd", "closed_form"]


def spectral_norm_constraint(matrices: torch.Tensor, impl: SpectralImpl = "auto") -> torch.Tensor:
    """Scale every block of matrices (..., b, b) by 1 / max(1, ||A||_2): products never expand, rotations stay exact.
    ``impl``: "svd", "closed_form" (b = 2 only: sigma_max^2 = (F + sqrt(F^2 - 4 det^2)) / 2, F = ||A||_F^2) or "auto".
    """
    if impl == "auto":
        impl = "closed_form" if matrices.shape[-1] == 2 else "svd"
    blocks = matrices.to(_compute_dtype(matrices.dtype))  # (..., b, b)
    if impl == "svd":
        squared: torch.Tensor = torch.linalg.matrix_norm(blocks, ord=2).square()  # (...,)
    elif impl == "closed_form":
        if blocks.shape[-2:] != (2, 2):
            raise ValueError(f"the closed form is for 2 x 2 blocks, got {tuple(blocks.shape[-2:])}")
        a, b, c, d = blocks[..., 0, 0], blocks[..., 0, 1], blocks[..., 1, 0], blocks[..., 1, 1]  # each (...,)
        # F^2 - 4 det^2 = (sigma_1^2 - sigma_2^2)^2, written as a product of sums of squares (no cancellation);
        # the floor keeps sqrt's gradient finite where the singular values are equal (e.g. a scaled rotation)
        gap = (((a - d).square() + (b + c).square()) * ((a + d).square() + (b - c).square())).clamp(min=1e-30).sqrt()
        squared = (blocks.square().sum(dim=(-2, -1)) + gap) / 2  # (F + gap) / 2
    else:
        raise ValueError(f"unknown spectral norm impl {impl!r}; choose auto, svd or closed_form")
    divisors = squared.clamp(min=1.0).sqrt()[..., None, None]  # (..., 1, 1)
    return (matrices / divisors).to(matrices.dtype)  # (..., b, b)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scan_signature(scan: Callable[..., ScanResult]) -> Callable[..., ScanResult]:

    @functools.wraps(scan)
    def checked(
        transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None = None, **kwargs: Any
    ) -> ScanResult:
        batch, length, heads, block = inputs.shape
        if transitions.shape != (batch, length, heads, block, block):
            raise ValueError(
                f"transitions must have shape {(batch, length, heads, block, block)} to match inputs "
                f"{tuple(inputs.shape)}, got {tuple(transitions.shape)}"
            )
        if length == 0:
            raise ValueError("the scan needs at least one time step")
        dtype = _compute_dtype(inputs.dtype)
        if initial_state is None:
            initial_state = inputs.new_zeros((batch, heads, block), dtype=dtype)
        elif initial_state.shape != (batch, heads, block):
            raise ValueError(f"initial_state must have shape {(batch, heads, block)}, got {tuple(initial_state.shape)}")
        states, final_state = scan(transitions.to(dtype), inputs.to(dtype), initial_state.to(dtype), **kwargs)
        return states.to(inputs.dtype), final_state.to(inputs.dtype)

    return checked


@_scan_signature
def scan_sequential(transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor) -> ScanResult:
    """The reference: T steps of ``scan_step``. Shapes as in the module docstring."""
    return _step_through(transitions, inputs, initial_state, time_dim=1)


def _step_through(transitions: torch.Tensor, inputs: torch.Tensor, state: torch.Tensor, time_dim: int) -> ScanResult:
    states = []
    # unbind, not transitions[:, t]: its backward is one stack, where T selects would each fill a zero (B, T, ...)
    for transition, input in zip(transitions.unbind(time_dim), inputs.unbind(time_dim)):
        state = scan_step(transition, input, state)  # (..., ..., b)
        states.append(state)
    return torch.stack(states, dim=time_dim), state


@_scan_signature
def scan_parallel(transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor) -> ScanResult:
    """Log-depth associative scan. Shapes as in the module docstring."""
    first = scan_step(transitions[:, 0], inputs[:, 0], initial_state)  # (B, H, b): h_0 folded into b_1
    states = _parallel_from_zero(transitions, torch.cat([first.unsqueeze(1), inputs[:, 1:]], dim=1))
    return states, states[:, -1]  # (B, T, H, b), (B, H, b)


def _parallel_from_zero(transitions: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """States from h_0 = 0: pairs (2i, 2i+1) compose into one step whose scan gives the odd states; each even state is
    one step further."""
    length = inputs.shape[1]
    if length == 1:
        return inputs  # (B, 1, H, b)
    pairs = length // 2
    # the pair products go straight into the recursion: each level holds only its own, ~2x the input in all
    odd_states = _parallel_from_zero(*_compose_pairs(transitions[:, : 2 * pairs], inputs[:, : 2 * pairs]))
    later_even = scan_step(transitions[:, 2::2], inputs[:, 2::2], odd_states[:, : (length - 1) // 2])
    even_states = torch.cat([inputs[:, :1], later_even], dim=1)  # (B, ceil(T/2), H, b)
    interleaved = torch.stack([even_states[:, :pairs], odd_states], dim=2).flatten(1, 2)  # (B, 2 pairs, H, b)
    return torch.cat([interleaved, even_states[:, pairs:]], dim=1)  # (B, T, H, b)


def _compose_pairs(transitions: torch.Tensor, inputs: torch.Tensor) -> ScanResult:
    odd_a = transitions[:, 1::2].contiguous()  # (B, P, H, b, b): copied once, used twice
    return torch.matmul(odd_a, transitions[:, 0::2]), scan_step(odd_a, inputs[:, 1::2], inputs[:, 0::2])


@_scan_signature
def scan_chunked(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor, chunk_size: int = 64
) -> ScanResult:
    """Sequential inside chunks (all chunks at once), parallel across them."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, heads, block = inputs.shape
    num_chunks = length // chunk_size
    if num_chunks == 0:
        return scan_sequential(transitions, inputs, initial_state)
    whole = num_chunks * chunk_size
    chunk_a = transitions[:, :whole].reshape(batch, num_chunks, chunk_size, heads, block, block)
    chunk_b = inputs[:, :whole].reshape(batch, num_chunks, chunk_size, heads, block)
    starts = initial_state.unsqueeze(1)  # (B, 1, H, b)
    if num_chunks > 1:
        products, local_finals = _chunk_summaries(chunk_a[:, :-1], chunk_b[:, :-1])  # (B, n-1, H, b[, b])
        later_starts, _ = scan_parallel(products, local_finals, initial_state)  # (B, n-1, H, b)
        starts = torch.cat([starts, later_starts], dim=1)  # (B, n, H, b)
    states, _ = _step_through(chunk_a, chunk_b, starts, time_dim=2)  # (B, n, chunk, H, b): all chunks at once
    states = states.reshape(batch, whole, heads, block)  # (B, whole, H, b)
    if whole == length:
        return states, states[:, -1]
    tail_states, final_state = scan_sequential(transitions[:, whole:], inputs[:, whole:], states[:, -1])
    return torch.cat([states, tail_states], dim=1), final_state  # (B, T, H, b), (B, H, b)


def _chunk_summaries(chunk_a: torch.Tensor, chunk_b: torch.Tensor) -> ScanResult:
    steps_a, steps_b = chunk_a.unbind(2), chunk_b.unbind(2)  # C x (B, n, H, b, b), C x (B, n, H, b)
    product, state = steps_a[0], steps_b[0]
    for transition, input in zip(steps_a[1:], steps_b[1:]):
        product = torch.matmul(transition, product)  # (B, n, H, b, b)
        state = scan_step(transition, input, state)  # (B, n, H, b)
    return product, state


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


def scan_compiled(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None = None
) -> ScanResult:
    """The compiled reference loop with its backward; float32 CPU tensors and numba, else ValueError."""
    result = cpu_decode.linear_scan(transitions, inputs, initial_state)
    if result is None:
        raise ValueError(
            "the compiled scan takes float32 CPU tensors of matching shapes and at least one step, with numba "
            "installed; use a torch scan"
        )
    return result
