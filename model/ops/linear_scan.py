"""The linear recurrence h_t = A_t h_{t-1} + b_t with block-diagonal A_t (block-diagonal-lrnn.txt 3.3-3.4).

Every implementation has one signature::

    scan_<impl>(transitions, inputs, initial_state=None) -> (states, final_state)

    transitions:   (B, T, H, b, b)  A_t, one b x b block per head (a stride-0 expand is fine)
    inputs:        (B, T, H, b)     b_t
    initial_state: (B, H, b)        h_0, zeros when None
    states:        (B, T, H, b)     h_1 .. h_T
    final_state:   (B, H, b)        h_T

- ``scan_sequential``: the reference loop, T steps of ``scan_step``. Work-optimal (T b^2 per head).
- ``scan_parallel``: log-depth associative scan over the pairs (A, b) with (A2, b2) o (A1, b1) =
  (A2 A1, A2 b1 + b2): pair neighbours, scan the half-length sequence of pairs, fill in the other half.
  Any T. Work ~T b^3; peaks at ~2.5x the transitions' memory, input included (the pair products).
- ``scan_chunked``: split T into chunks of ``chunk_size``; one sequential pass over all chunks at once
  gives each chunk's (product of A, local final state), a parallel scan across those gives each chunk's
  start state, a second sequential pass runs every chunk from its start. A trailing partial chunk continues
  sequentially. Depth ~2 chunk_size + log(T / chunk_size); beside the inputs and outputs it holds only
  per-chunk summaries (no copy of the transitions).

All run in at least float32 (bfloat16/float16 in, float32 inside, the input dtype out; float64 stays
float64), support autograd, and are pure PyTorch (CPU and CUDA).

``linear_scan(..., impl="auto")`` picks by this policy, set from benchmarks/bench_linear_scan.py (forward,
no grad, fp32, H = 8, b = 8; T = 500 .. 65536, B = 1 .. 64; one CPU thread, and an H100; docs/benchmarks.md):

- on the CPU, for float32 where numba is installed: "compiled", the loop as one compiled call, and its backward
  the loop in reverse (``scan_compiled``, model/ops/cpu_decode.py). The torch scans spend most of a one-thread
  CPU's time dispatching small ops; the compiled loop does the loop's work alone (text-lrnn's 4,096-token
  prefill: 42-45 -> 10-17 ms a layer for its scan; docs/benchmarks.md, "Compiled CPU prefill").
- on the CPU otherwise (float64, no numba), with batch * heads <= 32 rows per step (B <= 4 at H = 8): "chunked".
  Per-step work is too small for the loop to pay its per-op overhead; chunked was fastest from T = 8192 on (1.6-5x
  faster than the loop, 1.3-2.5x than the parallel scan) and 2 ms behind the parallel scan at T = 500, at a
  fraction of its memory.
- on the CPU otherwise, with more rows: "sequential". The work-optimal loop (T b^2 against the scans' T b^3) won from
  B = 8 on (at B = 64: 4-8x faster than chunked, 8-10x than parallel, which ran out of 12 GiB at T = 65536)
  and holds the least memory.
- on CUDA, where the Triton scan takes the problem (Triton installed, blocks of at most 16, at most 65,535 rows x
  heads, no gradient asked for, not float64): "triton". On an H100 (2026-11-26) it was the fastest at every size
  timed, 3-16x the torch scans: 0.2 / 0.2 / 1.4 ms at B = 1 and T = 500 / 8192 / 65536 against 1.6 / 3.3 / 3.3
  ms for the parallel scan; 0.5 / 6.7 / 53.5 ms at B = 64 against 1.8 / 19.2 / 153 ms for the best torch scan;
  with the least memory (10.4 against 11.5 GiB for chunked at B = 64, T = 65536). The parallel scan under
  ``torch.compile`` took 1.6-2.9 ms at B = 1, T = 8192.
- on CUDA otherwise (training, float64, larger blocks), with transitions of at most 512 MiB: "parallel". Kernel
  launches, not arithmetic, set the time there, and the parallel scan has the fewest sequential steps: 1.7 / 4.4 /
  5.8 ms at B = 1 and T = 500 / 8192 / 65536, against 14.8 / 13.8 / 15.0 ms for chunked and 26 ms to 3.5 s for
  the loop; 3.2 against 16.1 ms at B = 64, T = 500.
- on CUDA otherwise, with larger transitions: "chunked". From 1 GiB of transitions on (B = 64 at T = 8192 and
  65536) the two scans took the same time (19.5 / 20.2 ms, 153 / 156 ms) and chunked half the memory.

A T shorter than ``chunk_size`` makes "chunked" the plain loop, so the policy needs no rule for short T.

- ``scan_triton`` (``model.ops.triton_scan``): the chunked scan as three Triton kernels, forward only, blocks of
  at most 16, CUDA (or Triton's interpreter, for tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch

from model.ops import cpu_decode
from model.ops.triton_scan import MAX_BLOCK, MAX_ROWS_TIMES_HEADS, available, refusal, scan_triton

ScanImpl = Literal["auto", "sequential", "parallel", "chunked", "triton", "compiled"]
ScanResult = tuple[torch.Tensor, torch.Tensor]


def scan_step(transition: torch.Tensor, input: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One step: transition (B, H, b, b), input (B, H, b), state (B, H, b) -> A state + input (B, H, b)."""
    return torch.matmul(transition, state.unsqueeze(-1)).squeeze(-1) + input  # (B, H, b)


def column_norm_constraint(matrices: torch.Tensor, p: float = 1.2) -> torch.Tensor:
    """Scale every column v of every block by 1 / max(1, ||v||_p) (block-diagonal-lrnn.txt eq. 6).

    matrices: (..., b, b); a column is the vector along the row axis (dim -2). Columns already inside the
    unit p-ball are returned unchanged. The norm is taken in at least float32 (:func:`column_divisors`).
    """
    return (matrices / column_divisors(matrices, p)).to(matrices.dtype)  # (..., b, b)


def column_divisors(matrices: torch.Tensor, p: float = 1.2) -> torch.Tensor:
    """matrices: (..., b, b) -> max(1, ||v||_p) of every column v, (..., 1, b), in at least float32.

    Computed as max(1, sum |v_i|^p)^(1/p), which equals max(1, ||v||_p) (t -> t^(1/p) is increasing): for a
    non-integer p this is 2x faster on the CPU than ``torch.linalg.vector_norm`` (the model's hottest op at
    p = 1.2), and its gradient is 0, never NaN, for a column inside the ball, an all-zero one included.
    ``tests/model/test_linear_scan.py`` checks the constraint against ``vector_norm``.
    """
    powered = matrices.to(_compute_dtype(matrices.dtype)).abs().pow(p)  # (..., b, b)
    return powered.sum(dim=-2, keepdim=True).clamp(min=1.0).pow(1.0 / p)  # (..., 1, b)


def column_sparsemax(matrices: torch.Tensor) -> torch.Tensor:
    """Project every column of every block onto the probability simplex (sparsemax, Martins & Astudillo 2016):
    p = max(v - tau, 0) with tau such that sum p = 1.

    matrices: (..., b, b); a column is the vector along dim -2. Unlike a softmax, the result has exact zeros: an
    entry more than 1 below its column's largest is 0, so a deterministic automaton's 0/1 transition matrix is
    reached with finite logits and nothing leaks out of a state. Gradients flow through the column's support
    (autograd through the sort gives the sparsemax Jacobian). Computed in at least float32.
    """
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


SpectralImpl = Literal["auto", "svd", "closed_form"]


def spectral_norm_constraint(matrices: torch.Tensor, impl: SpectralImpl = "auto") -> torch.Tensor:
    """Scale every block by 1 / max(1, ||A||_2), ||A||_2 its largest singular value.

    matrices: (..., b, b). Unlike the column p-norm clamp for p > 1, this bounds the spectral radius, and every
    product of such blocks, by 1: ||A_T ... A_1 h|| <= ||h|| for any input sequence, so no state can blow up at
    any length, while every rotation (and reflection) stays representable exactly, which the column 1-norm
    clamp forbids for angles other than multiples of 90 degrees. Implementations: "svd" (the reference,
    ``torch.linalg.matrix_norm(ord=2)``, any b), "closed_form" (b = 2 only: sigma_max^2 = (F + sqrt(F^2 -
    4 det^2)) / 2 with F the squared Frobenius norm; 19x faster than batched SVD on the CPU, forward and
    backward, measured on 40,960 blocks), "auto" (closed_form for b = 2, else svd). Computed in at least
    float32; blocks inside the unit ball are returned unchanged.
    """
    if impl == "auto":
        impl = "closed_form" if matrices.shape[-1] == 2 else "svd"
    blocks = matrices.to(_compute_dtype(matrices.dtype))  # (..., b, b)
    if impl == "svd":
        squared = torch.linalg.matrix_norm(blocks, ord=2).square()  # (...,)
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
    """Shared entry of the implementations: check shapes, fill in the zero initial state, run the body in at
    least float32 and hand back the input dtype. The body sees (transitions, inputs, initial_state)."""

    @functools.wraps(scan)
    def checked(
        transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None = None, **kwargs
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
    """The loop along ``time_dim`` under any batch dims: transitions (..., T, ..., b, b), inputs (..., T, ..., b),
    state (..., ...) without that dim -> states (..., T, ..., b), final state."""
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
    """States of the scan from h_0 = 0. transitions (B, T, H, b, b), inputs (B, T, H, b) -> (B, T, H, b).

    With 0-based t: the pairs (2i, 2i+1) compose into one step each, whose scan gives the states at odd t;
    the state at an even t > 0 is one more step from the odd state before it. An odd T leaves the last
    (even) position out of the pairs and fills it in with the other even ones.
    """
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
    """Steps 2i and 2i+1 as one step: transitions (B, 2P, H, b, b), inputs (B, 2P, H, b) ->
    (B, P, H, b, b), (B, P, H, b)."""
    odd_a = transitions[:, 1::2].contiguous()  # (B, P, H, b, b): copied once, used twice
    return torch.matmul(odd_a, transitions[:, 0::2]), scan_step(odd_a, inputs[:, 1::2], inputs[:, 0::2])


@_scan_signature
def scan_chunked(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor, chunk_size: int = 64
) -> ScanResult:
    """Sequential inside chunks (all chunks at once), parallel across them. Shapes as in the module docstring."""
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
    """Each chunk as one affine step: chunk_a (B, n, C, H, b, b), chunk_b (B, n, C, H, b) ->
    (A_C ... A_1 (B, n, H, b, b), the chunk's final state from zero (B, n, H, b))."""
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
    """The "auto" policy of the module docstring: an implementation name for this problem size and device.
    ``triton`` / ``compiled``: whether the Triton scan (CUDA) / the compiled loop (CPU) may run it as far as the shapes
    cannot say (Triton: no gradient, not float64; the compiled loop: float32)."""
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
    """Dispatch to ``scan_<impl>``; "auto" follows the policy in the module docstring."""
    if impl == "auto":
        # only on CUDA: asking imports Triton, which a CPU process has no use for
        triton = inputs.device.type == "cuda" and refusal(transitions, inputs, initial_state, chunk_size) is None
        compiled = inputs.device.type == "cpu" and cpu_decode.compiles_scan(transitions, inputs, initial_state)
        impl = choose_scan_impl(*inputs.shape, inputs.device, triton, compiled)  # type: ignore[assignment]
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


def scan_compiled(transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None = None
                  ) -> ScanResult:  # fmt: skip
    """The reference loop compiled (``cpu_decode.linear_scan``), with its backward: float32 CPU tensors, numba."""
    result = cpu_decode.linear_scan(transitions, inputs, initial_state)
    if result is None:
        raise ValueError(
            "the compiled scan takes float32 CPU tensors of matching shapes and at least one step, with numba "
            "installed; use a torch scan"
        )
    return result
