"""CPU kernels for the decode step of few rows: products that read a weight at the memory's streaming rate, and a served
LRNN layer or RegularGPT block as one compiled call.

A decode step at batch 1 is a chain of matrix-vector products, each of which reads its whole weight once: its
time is the weight's bytes over the rate at which the product streams them. MKL's one-thread matrix-vector kernel
reaches that rate only on some shapes and layouts: on this project's CPU (docs/benchmarks.md, "One-token products")
it read a 4608 x 512 weight at 16 GB/s stored (in, out) and 8 GB/s stored (out, in), and the square and tall
weights of a layer at 8-14 GB/s either way, where a plain sum over memory reads at ~25-29. :func:`linear`'s kernel
is the textbook loop (one dot product per output, over a row of the weight as ``nn.Linear`` stores it), compiled by
numba with reassociation allowed so that the dot products vectorise: 16-26 GB/s on every shape measured, 1.1-2x
MKL's best layout, and with 2-4 rows it reads the weight once for all of them.

:func:`linear` does not use the kernel with gradients enabled, on other devices and dtypes, with more than
:data:`MAX_ROWS` rows (blocked products win from ~8 rows: measured crossover), for a weight of fewer than
:data:`MIN_ELEMENTS` entries or not contiguous as (out, in), or with more than one intra-op thread (the kernel runs
on one; MKL's and oneDNN's products use them all). There it multiplies by the weight's oneDNN pack where a served
model made one (model/ops/prepacked.py), else it is ``F.linear``. Its results equal ``F.linear``'s up to float
rounding (the sums run in another order); each row's result is the same whatever the other rows are. numba is
imported and the kernel compiled (~1 s) on first use; without numba, the kernel never applies and a warning says
why once. :func:`torch_products` turns the kernel and the packs off within a block (the reference path, for tests
and benchmarks).

Batch invariance (:func:`set_row_invariant`, the server's ``batch_invariant``): the kernels compute each row by the
same arithmetic whatever the other rows, but MKL's and oneDNN's products do not (at one thread this torch's MKL gave
other bits at 1-3 rows than at 4 or more; at two threads at most row counts below 12), so a sequence's logits
changed by float rounding when its decode batch crossed :data:`MAX_ROWS` (issue 30: a seeded text-regulargpt sample
diverged from its solo run beside ten others). Where it is on, a decode step's products and layer steps run through
the kernels at any rows, weight size and thread count: a row's logits are then bit for bit the same in any batch
(tests/model/test_cpu_decode.py, tests/server/test_sampling.py). The products of :func:`linear` (the head above
all) then run across outputs instead (:func:`_compile_panel_kernel`): the weight copied once into panels of
:data:`PANEL` outputs, each output's sum in a fixed order of fused multiply-adds, a tile of rows by the panel's
outputs in vector registers (:func:`_tile_product`), as MKL vectorises many rows. The dot-product kernel, which
reduces each output's sum horizontally, took 10x MKL's time for a 64-row 8,192 x 16 head and 1.9x for 8,192 x 128;
the panels take 0.9-1.2x at 64 rows on an AVX-512 machine, where numba's own vectorising of them took 3-4x
(docs/benchmarks.md).
The LRNN layer step's products take its weights as panels too (:func:`lrnn_layer_step`), and so do the RegularGPT
thick layer's (:func:`block_panels`; without invariance, at most :data:`MAX_ROWS` rows, dot products). Prefill
chunks (many positions per row) keep MKL's and oneDNN's products, and what a model or the engine would run over
several rows at once outside a decode step's kernels runs one row at a time (:func:`row_invariant`: a RegularGPT
row's new thick layer, a prompt's prefill chunk), as it runs alone. Not invariant even so: where a long prompt is
cut into chunks (that depends on what else is prefilling), and any model or device this does not cover (the engine
refuses to start with them).

Between the products, a layer's ~20 small ops (layer norms, the transition constraint or the attention over J
slots, GELU, residual adds) cost more than their arithmetic: each is a dispatch of a few microseconds, whose code
and data the weights streamed before it have evicted (oneDNN's GELU of 2,048 values: 8 us with hot caches, 40 us
inside a size-L LRNN step). :func:`lrnn_layer_step` and :func:`regulargpt_layer_step` run a whole served LRNN
layer (column-constrained or stochastic transitions) or RegularGPT thick layer (its K blocks), products included, as
one compiled call (figures: docs/benchmarks.md, "CPU decode kernels").

Two more serve a stochastic LRNN's parallel pass (prefill, and training with their backward):
:func:`column_sparsemax` and :func:`linear_scan` (the loop), which model/ops/linear_scan.py takes where they apply.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from model.ops import prepacked

logger = logging.getLogger(__name__)

LayerTransitions = Literal["column", "stochastic"]  # the LRNN transitions lrnn_layer_step runs
MAX_ROWS = 4  # the kernel's rows per call; from 8 rows MKL's blocked products were faster (docs/benchmarks.md)
# Smaller weights stay F.linear: such a weight is likely in a cache between steps, where MKL reads it about as fast,
# and the kernel's call costs ~8 us of Python against F.linear's ~5 (a hot 128 x 128: 11 against 5 us; 512 x 512:
# 26 us either way; 2048 x 512: 67 against 80-95 us).
MIN_ELEMENTS = 2**18  # 1 MiB of float32
PANEL = 32  # outputs per panel of the row-invariant product (_tile_product: two vectors of 16 lanes per row)
TILE_ROWS = 2  # rows of x per tile of the panel product: 4 where numba compiles for AVX-512 (_build: _tile_rows)

_state = threading.local()  # .off: torch_products() depth in this thread; .invariant: set_row_invariant's choice
_kernel: Callable[..., None] | None = None
_panel_kernel: Callable[..., None] | None = None
_argmax_kernel: Callable[..., None] | None = None
_layer_step: Callable[..., None] | None = None
_regulargpt_layer_step: Callable[..., None] | None = None
_sparsemax_columns: Callable[..., None] | None = None
_scan_states: Callable[..., None] | None = None
_sparsemax_columns_backward: Callable[..., None] | None = None
_scan_backward: Callable[..., None] | None = None
_unavailable: str | None = None  # why the kernel cannot be built, once known
_build_lock = threading.Lock()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (..., in), weight: (out, in), bias: (out,) or None -> (..., out): ``F.linear(x, weight, bias)``, through
    the streaming kernel when it applies (module docstring), else through the weight's oneDNN pack where it has a
    valid one (model/ops/prepacked.py), else ``F.linear``."""
    kernel = (_kernel or _build()) if _applies(x, weight, bias) else None
    if kernel is None:
        packed = None if _off() else prepacked.product(x, weight, bias)
        return F.linear(x, weight, bias) if packed is None else packed
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()  # (R, in)
    values, offsets = rows.numpy(force=True), _NO_BIAS if bias is None else bias.numpy(force=True)
    if _invariant_step(x):
        panels = _panels(weight)  # (P, in, PANEL)
        out = np.empty((rows.shape[0], panels.shape[0] * PANEL), dtype=np.float32)  # (R, P PANEL)
        _panel_kernel(values, panels, offsets, bias is not None, out)
        result = torch.from_numpy(out)[:, : weight.shape[0]]  # (R, out)
    else:
        out = np.empty((rows.shape[0], weight.shape[0]), dtype=np.float32)  # (R, out)
        kernel(values, weight.numpy(force=True), offsets, bias is not None, out)
        result = torch.from_numpy(out)
    return result if x.dim() == 2 else result.view(*x.shape[:-1], weight.shape[0])


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x: (R, in), weight: (out, in), bias: (out,) or None -> each row's greedy pick of ``linear(x, weight, bias)``,
    as :func:`rows_argmax` takes it: (ids (R,) int64, their values (R,)). A decode step's product under
    :func:`set_row_invariant` (the panels) never writes its logits: each tile's sums are compared in the registers
    they are in (:func:`_tile_best`), the same sums, so the same pick and value as the logits', bit for bit (at 64
    rows of an 8,192 x 16 head this took about half the product and argmax's time: docs/benchmarks.md, "Several
    decode steps an iteration; greedy picks without logits"). Elsewhere: the logits, then :func:`rows_argmax`."""
    if x.dim() == 2 and _invariant_step(x) and _applies(x, weight, bias) and (_kernel or _build()) is not None:
        rows = x.contiguous().numpy(force=True)
        index, value = np.empty(rows.shape[0], dtype=np.int64), np.empty(rows.shape[0], dtype=np.float32)
        offsets = _NO_BIAS if bias is None else bias.numpy(force=True)
        _argmax_kernel(rows, _panels(weight), offsets, bias is not None, weight.shape[0], index, value)
        return torch.from_numpy(index), torch.from_numpy(value)
    return rows_argmax(linear(x, weight, bias))


def rows_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest value and where it is: logits (R, V) -> (ids (R,) int64, values (R,)), the first of ties,
    and the first NaN before any number (numpy's and torch's argmax). On the CPU through numpy, whose argmax is
    vectorised: torch 2.13's took ~0.5 ms for 64 x 8,192 floats on one thread, numpy's 25 us."""
    if logits.device.type == "cpu":
        values = logits.detach().numpy()
        ids = values.argmax(-1)
        return torch.from_numpy(ids), torch.from_numpy(values[np.arange(len(ids)), ids])
    ids = logits.argmax(-1)
    return ids, logits.gather(-1, ids[:, None])[:, 0]


def kernel_available() -> bool:
    """Whether the kernel can run here (numba importable; builds it now if not built yet)."""
    return (_kernel or _build()) is not None


def streams(rows: int = 1, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a product of ``rows`` rows of ``dtype`` with a contiguous CPU weight would run through the kernel now
    (no gradients aside): float32, one intra-op thread, at most :data:`MAX_ROWS` rows (any threads and rows where
    :func:`set_row_invariant` is on), not inside :func:`torch_products`, numba importable. Serving code lays its
    weights out for the kernel when this holds."""
    invariant = _invariant()
    return (
        dtype is torch.float32
        and (invariant or rows <= MAX_ROWS)
        and not _off()
        and (invariant or torch.get_num_threads() == 1)
        and kernel_available()
    )


def set_row_invariant(invariant: bool) -> None:
    """From now on in this thread (the engine's worker; False: the default policy again), every compiled layer step
    and every product of :func:`linear` over one position per row (x (R, in) or (..., 1, in): a decode step's)
    runs through the kernels at any number of rows, any weight size and any intra-op threads (the kernels run on
    one), so that each row's result is the same whatever the other rows are (module docstring, "Batch invariance").
    Products over many positions per row (prefill chunks) keep the default policy and its speed. Set it before the
    model's ``for_serving``, which lays weights out for the kernels where :func:`streams` holds. Without numba it
    cannot hold: :func:`kernel_available` says."""
    _state.invariant = invariant


def row_invariant() -> bool:
    """Whether :func:`set_row_invariant` is on in this thread: then what would run over several rows at once outside
    the kernels runs one row at a time, as it runs alone (a RegularGPT row's new thick layer, a prompt's prefill
    chunk in server/execution/generation.py)."""
    return _invariant()


def rows_note() -> str:
    """The rows at which the compiled layer steps run, for a model's serving notes."""
    return "every batch size (batch-invariant)" if _invariant() else f"1-{MAX_ROWS} rows"


def compiles_step(x: torch.Tensor) -> bool:
    """Whether a decode step over ``x`` (rows first) may run as one compiled call (:func:`lrnn_layer_step`,
    :func:`regulargpt_layer_step`): on the CPU, no gradients, and :func:`streams` for its rows and dtype."""
    return x.is_cpu and not torch.is_grad_enabled() and streams(x.shape[0], x.dtype)


@contextlib.contextmanager
def row_invariance() -> Iterator[None]:
    """Within the block (this thread), :func:`set_row_invariant` is on, as the server's engine thread sets it; then
    as it was before."""
    before = _invariant()
    set_row_invariant(True)
    try:
        yield
    finally:
        set_row_invariant(before)


@contextlib.contextmanager
def torch_products() -> Iterator[None]:
    """Within the block (this thread), :func:`linear` is ``F.linear`` everywhere (no kernel, no packs): the reference
    path."""
    _state.off = _off() + 1
    try:
        yield
    finally:
        _state.off -= 1


def lrnn_layer_step(
    x: torch.Tensor,
    state: torch.Tensor,
    arrays: Sequence[np.ndarray],
    eps: float,
    transitions: LayerTransitions,
    p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One served LRNN layer (model/lrnn/model.py, ``RecurrentBlock.step`` with the full generator) as one compiled call:
    x + readout(A(u) state + B u) with u = LN_1(x), then + MLP(LN_2(.)). ``transitions`` "column": A(u) = g(u) with
    column j divided by max(1, ||column j||_p) (applied to the state entry it multiplies, as the torch step does);
    "stochastic": column j of A(u) is the sparsemax of g(u)'s column j (``column_sparsemax`` in
    model/ops/linear_scan.py, here sort-free), and there is no B u. Every product streams its weight as
    :func:`linear` does, and the ~20 small ops between them (layer norms, the constraint, the block products, GELU,
    the residual adds), each a dispatch that finds its code and data evicted by the weights streamed before it, run
    in the same call. Equal to the torch step up to float rounding (tests/model/test_cpu_decode.py).

    x: (R, d_model), state: (R, H, b), R <= MAX_ROWS; ``arrays``: the layer's weights as :func:`layer_step_arrays`
    made them; ``p``: the column norm's (unused by "stochastic"). Returns (R, d_model), (R, H, b). Call it only where
    :func:`streams` holds for R rows (which builds it)."""
    rows = x.contiguous().numpy(force=True)
    x_out = np.empty_like(rows)
    state_out = np.empty(state.shape, dtype=np.float32)
    _layer_step(
        rows, state.contiguous().numpy(force=True), (arrays[0], arrays[1]), arrays[2], arrays[3], arrays[4],
        (arrays[5], arrays[6]), (arrays[7], arrays[8]), (arrays[9], arrays[10]), (arrays[11], arrays[12]),
        np.float32(eps), np.float64(p), transitions == "stochastic", x_out, state_out,
    )
    return torch.from_numpy(x_out), torch.from_numpy(state_out)


def layer_step_arrays(weights: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """:func:`lrnn_layer_step`'s weights as it reads them. ``weights``: ln_1 weight and bias, the generator's weight
    ("column": g's and B's stacked, (H b^2 + H b, d_model); "stochastic": g's, (H b^2, d_model)), g's bias, B's bias
    ((0,) for "stochastic"), out_proj weight and bias, ln_2 weight and bias, the MLP's c_fc weight and bias and
    c_proj weight and bias, all float32 on the CPU. Each becomes a numpy view of itself, but for the four matrices
    under :func:`set_row_invariant`, which become panels (:func:`_panels`), multiplied as :func:`linear` multiplies
    a decode step's: a row's bits then do not depend on the other rows, at about MKL's speed. A caller that keeps
    the arrays makes them again when a weight's :func:`stamp` or :func:`row_invariant` changes."""
    panels = _invariant()
    return [
        _panels(tensor) if panels and index in _LAYER_MATRICES else tensor.numpy(force=True)
        for index, tensor in enumerate(weights)
    ]


def stamp(tensor: torch.Tensor) -> tuple[int, int | None]:
    """What changes when ``tensor``'s values may have: its storage (``.data =``, ``.to``, ``load_state_dict(...,
    assign=True)``) and its version counter (an in-place change; an inference tensor has none)."""
    return tensor.data_ptr(), None if tensor.is_inference() else tensor._version


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """One contiguous buffer holding ``tensors`` (all of one dtype, on the CPU) one after another, flattened, and
    where each starts in it, then its end: (n + 1,) int64. The caller makes its parameters views of the buffer (a
    compiled step then takes them as one array, not one argument each)."""
    sizes = [tensor.numel() for tensor in tensors]
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    flat = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
    return flat, starts


def regulargpt_layer_step(
    x: torch.Tensor,
    windows: tuple[np.ndarray, ...],
    positions: np.ndarray,
    dilation: int,
    ring: int,
    slots: int,
    packed: np.ndarray,
    starts: np.ndarray,
    panels: tuple[np.ndarray, ...],
    has_null: bool,
    heads: int,
    eps: float,
) -> torch.Tensor:
    """One thick layer of a RegularGPT decode step (model/regulargpt/decode.py: its K blocks, ``CachedBlock.forward``
    with a ``StepPlan``) as one compiled call. Each block: x + attention(LN_1(x)) over the J dilated slots, then
    + MLP(LN_2(.)); the new position's keys and values are then written into its window. The ring entries are
    found as the step's plan finds them (``_plan_step`` in model/regulargpt/cache.py: row r's slot j holds position
    p = positions[r] - j * dilation at its ``ring_slot``; out of range, masked or null, where p < 0), without
    building it. Equal to the torch step up to float rounding (tests/model/test_cpu_decode.py).

    x: (R, d_model), R <= MAX_ROWS; windows: the K blocks' rings (R, 2 H, allocated, hd) each as flat (R 2 H
    allocated, hd) arrays (``KVWindow.entries``), written in place; positions: (R,) int64, each row's new position;
    dilation: C**l; ring: (C - 1) C**l; slots: J, the slots any row can reach; ``packed``: every block's parameters
    one after another (:func:`pack`): per block ln_1 weight and bias, c_attn weight and bias, c_proj weight and
    bias, ln_2 weight and bias, the MLP's c_fc and c_proj weights and biases, the relative bias (H, C), then with
    ``has_null`` the null key and value (H, hd); ``starts``: (K, n + 1), each
    block's tensors' starts in ``packed`` and its end; ``panels``: :func:`block_panels` of the K blocks' matrices.
    Returns (R, d_model). Call it only where :func:`streams` holds for R rows (which builds it)."""
    rows = x.contiguous().numpy(force=True)
    x_out = np.empty_like(rows)
    _regulargpt_layer_step(
        rows, windows, positions, dilation, ring, slots, packed, starts, panels, has_null, heads, np.float32(eps),
        x_out,
    )
    return torch.from_numpy(x_out)


def block_panels(matrices: Sequence[torch.Tensor]) -> tuple[np.ndarray, ...]:
    """The matrices of a thick layer's blocks (per block: c_attn, c_proj, c_fc and the MLP's c_proj weights) as
    :func:`regulargpt_layer_step` multiplies them: under :func:`set_row_invariant` their panels (:func:`_panels`,
    made once per weight), multiplied as :func:`linear` multiplies a decode step's, at about MKL's speed where the
    dot products took 3-5x at 64 rows; else ``()``, the dot products over the pack (at most :data:`MAX_ROWS` rows,
    where they are as fast)."""
    return tuple(_panels(matrix) for matrix in matrices) if _invariant() else ()


def column_sparsemax(matrices: torch.Tensor) -> torch.Tensor | None:
    """``column_sparsemax`` of model/ops/linear_scan.py (every column of every (b, b) block onto the simplex) as one
    compiled loop, with its backward where a gradient is asked for, or None where it does not apply: not float32 on
    the CPU, numba missing, or inside :func:`torch_products`. torch's sort of 8-entry columns and the ops around it
    were ~45% of a stochastic LRNN's CPU prefill, and with their backward ~35% of a pass-key training step
    (docs/benchmarks.md, "Compiled CPU prefill"). Equal to the reference up to float rounding (its sums run in index
    order, not sorted order). matrices: (..., b, b) -> a new tensor, the same shape."""
    if matrices.dtype is not torch.float32 or not matrices.is_cpu or matrices.numel() == 0 or not _compiles():
        return None
    if matrices.requires_grad and torch.is_grad_enabled():
        return _CompiledSparsemax.apply(matrices)
    return _sparsemax_forward(matrices)


def _sparsemax_forward(matrices: torch.Tensor) -> torch.Tensor:
    flat = matrices.detach().reshape(-1).numpy(force=True).copy()  # (N b b,): a copy the kernel overwrites
    _sparsemax_columns(flat, matrices.shape[-1])
    return torch.from_numpy(flat).view(matrices.shape)


class _CompiledSparsemax(torch.autograd.Function):
    """The sparsemax's Jacobian: on a column's support S (its positive outputs) the gradient less its mean over S,
    0 off it."""

    @staticmethod
    def forward(ctx, matrices: torch.Tensor) -> torch.Tensor:
        output = _sparsemax_forward(matrices)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (output,) = ctx.saved_tensors
        flat = grad.reshape(-1).numpy(force=True).copy()
        _sparsemax_columns_backward(output.reshape(-1).numpy(force=True), flat, output.shape[-1])
        return torch.from_numpy(flat).view(output.shape)


def linear_scan(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``scan_sequential`` of model/ops/linear_scan.py (the work-optimal loop, T H b^2 per row) as one compiled loop,
    with its backward (the loop in reverse) where a gradient is asked for, or None where :func:`compiles_scan` does
    not hold. On one CPU thread the torch scans spend most of their time dispatching small ops (the chunked scan's
    per-chunk copies and ``bmm``: ~40% of ``text-lrnn``'s prefill after the compiled sparsemax; docs/benchmarks.md,
    "Compiled CPU prefill"). Equal to the loop up to float rounding. Shapes: (B, T, H, b, b), (B, T, H, b),
    (B, H, b) or None (zeros) -> (B, T, H, b), (B, H, b), float32."""
    if not compiles_scan(transitions, inputs, initial_state):
        return None
    if initial_state is None:
        batch, _, heads, size = inputs.shape
        initial_state = inputs.new_zeros((batch, heads, size))
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (transitions, inputs, initial_state)):
        return _CompiledScan.apply(transitions, inputs, initial_state)
    return _scan_forward(transitions, inputs, initial_state)


def _scan_forward(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length, heads, size = inputs.shape
    states = np.empty((batch, length, heads, size), dtype=np.float32)
    final = np.empty((batch, heads, size), dtype=np.float32)
    arrays = [tensor.detach().contiguous().numpy(force=True) for tensor in (transitions, inputs, initial_state)]
    _scan_states(*arrays, states, final)
    return torch.from_numpy(states), torch.from_numpy(final)


class _CompiledScan(torch.autograd.Function):
    """Backward through state_t = A_t state_(t-1) + u_t, from the last step: G_t (the gradient reaching state_t) =
    its own gradient + A_(t+1)^T G_(t+1); then du_t = G_t, dA_t = G_t state_(t-1)^T, d initial = A_0^T G_0."""

    @staticmethod
    def forward(ctx, transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor):
        states, final = _scan_forward(transitions, inputs, initial_state)
        ctx.save_for_backward(transitions, initial_state, states)
        return states, final

    @staticmethod
    def backward(ctx, grad_states: torch.Tensor | None, grad_final: torch.Tensor | None):
        transitions, initial_state, states = ctx.saved_tensors
        grad_states = torch.zeros_like(states) if grad_states is None else grad_states
        grad_final = torch.zeros_like(initial_state) if grad_final is None else grad_final
        grad_transitions = np.empty(transitions.shape, dtype=np.float32)
        grad_inputs = np.empty(states.shape, dtype=np.float32)
        grad_initial = np.empty(initial_state.shape, dtype=np.float32)
        arrays = [
            tensor.detach().contiguous().numpy(force=True)
            for tensor in (transitions, initial_state, states, grad_states, grad_final)
        ]
        _scan_backward(*arrays, grad_transitions, grad_inputs, grad_initial)
        return torch.from_numpy(grad_transitions), torch.from_numpy(grad_inputs), torch.from_numpy(grad_initial)


def compiles_scan(transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None) -> bool:
    """Whether :func:`linear_scan` runs these: float32 CPU tensors of matching shapes, at least one step, numba
    present, outside :func:`torch_products` (the reference path)."""
    tensors = [transitions, inputs] + ([] if initial_state is None else [initial_state])
    if inputs.dim() != 4:
        return False
    batch, length, heads, size = inputs.shape
    return (
        all(tensor.dtype is torch.float32 and tensor.is_cpu for tensor in tensors)
        and transitions.shape == (batch, length, heads, size, size)
        and (initial_state is None or initial_state.shape == (batch, heads, size))
        and length > 0
        and _compiles()
    )


def _compiles() -> bool:
    """The compiled ops' shared conditions: outside :func:`torch_products`, numba present (built on first use)."""
    return not _off() and _build() is not None


def _off() -> int:
    return getattr(_state, "off", 0)


def _invariant() -> bool:
    return getattr(_state, "invariant", False)


def _invariant_step(x: torch.Tensor) -> bool:
    """Whether a product over ``x`` is a decode step's (one position per row) under :func:`set_row_invariant`."""
    return _invariant() and (x.dim() == 2 or x.shape[-2] == 1)


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The module docstring's conditions, cheapest first (this runs on every product: ~1 us)."""
    invariant = _invariant_step(x)
    return (
        x.dtype is torch.float32
        and not torch.is_grad_enabled()
        and (invariant or weight.numel() >= MIN_ELEMENTS)
        and 0 < x.numel()
        and (invariant or x.numel() <= MAX_ROWS * x.shape[-1])
        and x.is_cpu
        and weight.dtype is torch.float32
        and weight.is_cpu
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is torch.float32 and bias.is_cpu and bias.is_contiguous()))
        and (invariant or torch.get_num_threads() == 1)
        and not _off()
        and _unavailable is None
    )


def _panels(weight: torch.Tensor) -> np.ndarray:
    """``weight`` (out, in) as the row-invariant product reads it: (P, in, PANEL) float32, panel p holding outputs
    p PANEL .. p PANEL + PANEL - 1 (zeros past ``out``), each output's weights down a column. Made once and kept on
    the tensor; made again when the tensor's storage changes (``.data =``, ``load_state_dict(assign=True)``) or it is
    changed in place (its version counter; an inference tensor has none, and there only its storage is checked)."""
    key = stamp(weight)
    held = getattr(weight, "_row_invariant_panels", None)
    if held is not None and held[0] == key:
        return held[1]
    outputs, width = weight.shape
    count = -(-outputs // PANEL)
    panels = np.zeros((count * PANEL, width), dtype=np.float32)  # (P PANEL, in)
    panels[:outputs] = weight.detach().numpy(force=True)
    panels = np.ascontiguousarray(panels.reshape(count, PANEL, width).transpose(0, 2, 1))  # (P, in, PANEL)
    weight._row_invariant_panels = (key, panels)
    return panels


def _build() -> Callable[..., None] | None:
    """Import numba and compile the kernels once per process; None (and one warning) if numba is missing."""
    global _kernel, _panel_kernel, _argmax_kernel, _layer_step, _regulargpt_layer_step, _sparsemax_columns
    global _scan_states, _sparsemax_columns_backward, _scan_backward, _unavailable
    with _build_lock:
        if _kernel is not None or _unavailable is not None:
            return _kernel
        try:
            import numba
        except ImportError as error:  # an install without the dependency: every product stays F.linear
            _unavailable = f"numba is not importable ({error})"
            logger.warning("few-row CPU products use F.linear: %s", _unavailable)
            return None
        global TILE_ROWS
        TILE_ROWS = _tile_rows(numba)
        _panel_kernel, _argmax_kernel = _compile_panel_kernel(numba)
        compiled = _compile(numba, _panel_kernel)
        _kernel, _layer_step, _regulargpt_layer_step = compiled[:3]
        _sparsemax_columns, _sparsemax_columns_backward, _scan_states, _scan_backward = compiled[3:]
        return _kernel


def _tile_rows(numba) -> int:
    """Rows per tile of the panel product: 4 where numba compiles for this machine and it has AVX-512 (32 vector
    registers: four rows' eight 16-lane accumulators, the two weight vectors and a broadcast), else 2 (with 16
    registers of 8 lanes, two rows' accumulators are eight of them)."""
    import llvmlite.binding

    if numba.config.CPU_NAME is not None:  # compiled for another target (NUMBA_CPU_NAME, e.g. a portable cache)
        return 2
    return 4 if llvmlite.binding.get_host_cpu_features().get("avx512f", False) else 2


def _compile_panel_kernel(numba) -> tuple[Callable[..., None], Callable[..., None]]:
    """The row-invariant product, compiled now: x (R, in) times panels (P, in, PANEL) (:func:`_panels`), plus the
    bias (out,) where ``has_bias``, into out (R, n): n = P PANEL (:func:`linear`), or the weight's own outputs (a
    layer step's, which calls it where its weights are panels). And its greedy picks, ``panel_argmax(x, panels,
    bias, has_bias, n, index (R,) int64, value (R,) float32)``: each row's first largest of its n outputs and its
    value, the same sums compared in registers (:func:`_tile_best`; :func:`linear_argmax`).

    Each row keeps one accumulator per output of a panel and adds x[r, i] * w[o, i] to it for i = 0, 1, ..., in - 1
    in that order, each step one fused multiply-add, then the bias: the same operations in the same order whatever
    the other rows, so a row's result is the same bits in any batch. The accumulators are vectors of 16 lanes
    written out as such (:func:`_tile_product`), so that they stay in registers and the products are FMAs at the
    machine's width; :data:`TILE_ROWS` rows at a time share each load of the panel's weights. (numba's own
    vectorisers gave this loop unfused mul-adds in 256-bit registers, a third of MKL's rate on an AVX-512 machine:
    docs/benchmarks.md, "A row-invariant head product across outputs".)"""
    jit = functools.partial(numba.njit, boundscheck=False, nogil=True)
    one, two, three, four = (_tile_product(numba, height) for height in (1, 2, 3, 4))

    @jit(inline="always")
    def tile_of(x, panels, p, r, height, out, row, column):  # the tile's sums at its height (its rows alone)
        if height == 4:
            four(x, panels, p, r, out, row, column)
        elif height == 3:
            three(x, panels, p, r, out, row, column)
        elif height == 2:
            two(x, panels, p, r, out, row, column)
        else:
            one(x, panels, p, r, out, row, column)

    def panel_product(x, panels, bias, has_bias, out):
        rows, n = x.shape[0], out.shape[1]
        tile = np.empty((TILE_ROWS, PANEL), dtype=np.float32)
        for p in range(panels.shape[0]):
            base = p * PANEL
            count = min(PANEL, n - base)  # out may end inside the last panel (a layer step's exact width)
            biased = min(count, bias.shape[0] - base) if has_bias else 0
            for r in range(0, rows, TILE_ROWS):
                height = min(TILE_ROWS, rows - r)  # the last tile's rows alone: none computed twice
                if count == PANEL and not biased:  # straight into out: no scratch tile, no scalar copy
                    tile_of(x, panels, p, r, height, out, r, base)
                    continue
                tile_of(x, panels, p, r, height, tile, 0, 0)
                for k in range(height):
                    for j in range(count):
                        out[r + k, base + j] = tile[k, j]
                    for j in range(biased):
                        out[r + k, base + j] += bias[base + j]

    best_one, best_two, best_three, best_four = (_tile_best(numba, height) for height in (1, 2, 3, 4))

    def panel_argmax(x, panels, bias, has_bias, n, index, value):
        rows = x.shape[0]
        tile = np.empty((TILE_ROWS, PANEL), dtype=np.float32)
        padded = np.zeros(panels.shape[0] * PANEL, dtype=np.float32)  # what tile_best reads, bias or not
        if has_bias:
            padded[: bias.shape[0]] = bias
        best = np.full((rows, PANEL), -np.inf, dtype=np.float32)  # per row and lane: the largest so far (NaN: the
        where = np.zeros((rows, PANEL), dtype=np.int32)  # first NaN), and its output
        for p in range(panels.shape[0]):
            base = p * PANEL
            count = min(PANEL, n - base)
            for r in range(0, rows, TILE_ROWS):
                height = min(TILE_ROWS, rows - r)
                if count == PANEL:  # in registers: the sums, the bias, the comparisons
                    if height == 4:
                        best_four(x, panels, p, r, padded, has_bias, best, where)
                    elif height == 3:
                        best_three(x, panels, p, r, padded, has_bias, best, where)
                    elif height == 2:
                        best_two(x, panels, p, r, padded, has_bias, best, where)
                    else:
                        best_one(x, panels, p, r, padded, has_bias, best, where)
                    continue
                tile_of(x, panels, p, r, height, tile, 0, 0)  # the last panel's outputs past n are padding: only the
                for k in range(height):  # first count lanes compete
                    for j in range(count):
                        v = tile[k, j] + bias[base + j] if has_bias else tile[k, j]
                        b = best[r + k, j]
                        if v > b or (np.isnan(v) and not np.isnan(b)):
                            best[r + k, j], where[r + k, j] = v, base + j
        for r in range(rows):  # the lanes' bests: the largest, the first output of ties, the first NaN before all
            top, at = best[r, 0], where[r, 0]
            for j in range(1, PANEL):
                v, i = best[r, j], where[r, j]
                if np.isnan(top):
                    if np.isnan(v) and i < at:
                        at = i
                elif np.isnan(v) or v > top or (v == top and i < at):
                    top, at = v, i
            index[r], value[r] = at, top

    signature = "void(float32[:, ::1], float32[:, :, ::1], float32[::1], boolean, {})"
    return (
        jit(signature.format("float32[:, ::1]"))(panel_product),
        jit(signature.format("int64, int64[::1], float32[::1]"))(panel_argmax),
    )


def _tile_product(numba, height: int) -> Callable[..., None]:
    """A numba intrinsic, ``tile_product(x, panels, p, r, out, row, column)``: out[row + k, column : column + PANEL] =
    sum over i of x[r + k, i] * panels[p, i, :] for k < ``height`` (:func:`_tile_sums`): into a scratch tile (row and
    column 0), or straight into the product's output where a whole panel fits there. x (R, in), panels (P, in,
    PANEL) and out (>= row + height, >= column + PANEL) are C-contiguous float32."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile_product(typingctx, x, panels, p, r, out, row, column):
        signature = types.void(x, panels, types.intp, types.intp, out, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            sums = _tile_sums(context, builder, signature, args, height)
            out_array = context.make_array(signature.args[4])(context, builder, args[4])
            index = context.get_value_type(types.intp)
            stride = builder.extract_value(out_array.shape, 1)
            for k, halves in enumerate(sums):
                start = builder.add(builder.mul(builder.add(args[5], ir.Constant(index, k)), stride), args[6])
                for half, total in enumerate(halves):
                    offset = builder.add(start, ir.Constant(index, total.type.count * half))
                    target = builder.gep(out_array.data, [offset])
                    builder.store(total, builder.bitcast(target, total.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile_product


def _tile_best(numba, height: int) -> Callable[..., None]:
    """A numba intrinsic, ``tile_best(x, panels, p, r, bias, has_bias, best, where)``: the sums of
    :func:`_tile_product` for rows r .. r + ``height`` - 1 and a whole panel p, plus bias[p PANEL + j] where
    ``has_bias`` (as :func:`linear` adds it; bias has P PANEL entries, read either way), each compared in its lane
    with best[row, j] (float32) and where[row, j] (int32, the output it came from), all (R, PANEL): it takes the
    lane where it is larger, or NaN where the lane holds none (numpy's argmax: the first NaN wins, then the first of
    the largest; a lane sees its outputs in order). Vector compares and selects on the registers the sums are in: no
    logit is written to memory."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile_best(typingctx, x, panels, p, r, bias, has_bias, best, where):
        signature = types.void(x, panels, types.intp, types.intp, bias, types.boolean, best, where)

        def codegen(context, builder, signature, args):
            sums = _tile_sums(context, builder, signature, args, height)
            bias_array, best_array, where_array = (context.make_array(signature.args[at])(context, builder, args[at])
                                                   for at in (4, 6, 7))  # fmt: skip
            index = context.get_value_type(types.intp)
            lanes = sums[0][0].type.count
            vector, int32 = sums[0][0].type, ir.IntType(32)
            base = builder.mul(args[2], ir.Constant(index, PANEL))
            offsets = ir.Constant(ir.VectorType(int32, lanes), list(range(lanes)))
            spread = builder.insert_element(ir.Constant(ir.VectorType(int32, lanes), ir.Undefined),
                                            builder.trunc(base, int32), ir.Constant(int32, 0))  # fmt: skip
            spread = builder.shuffle_vector(spread, spread, ir.Constant(ir.VectorType(int32, lanes), [0] * lanes))
            for half in (0, 1):
                outputs = builder.add(spread, builder.add(offsets, ir.Constant(ir.VectorType(int32, lanes),
                                                                               [lanes * half] * lanes)))  # fmt: skip
                offset = builder.add(base, ir.Constant(index, lanes * half))
                bias_vector = builder.load(builder.bitcast(builder.gep(bias_array.data, [offset]),
                                                           vector.as_pointer()), align=4)  # fmt: skip
                values = [builder.select(args[5], builder.fadd(total[half], bias_vector), total[half])
                          for total in sums]  # fmt: skip
                for k, value in enumerate(values):
                    at = builder.add(builder.mul(builder.add(args[3], ir.Constant(index, k)),
                                                 ir.Constant(index, PANEL)), ir.Constant(index, lanes * half))
                    best_pointer = builder.bitcast(builder.gep(best_array.data, [at]), vector.as_pointer())
                    where_pointer = builder.bitcast(builder.gep(where_array.data, [at]),
                                                    ir.VectorType(int32, lanes).as_pointer())  # fmt: skip
                    held, held_at = builder.load(best_pointer, align=4), builder.load(where_pointer, align=4)
                    larger = builder.fcmp_ordered(">", value, held)
                    first_nan = builder.and_(builder.fcmp_unordered("uno", value, value),
                                             builder.fcmp_ordered("ord", held, held))  # fmt: skip
                    take = builder.or_(larger, first_nan)
                    builder.store(builder.select(take, value, held), best_pointer, align=4)
                    builder.store(builder.select(take, outputs, held_at), where_pointer, align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile_best


def _block_sparsemax(numba, size: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """Two numba intrinsics. ``block_sparsemax(flat, start)``: the sparsemax of every column of the row-major
    ``size`` x ``size`` block at flat[start:] (a C-contiguous float32 array), in place, as LLVM vector code: the
    block's rows held in ``size``-lane registers, the columns side by side in the lanes. The same operations in the
    same order as ``sparsemax_block``'s loop (:func:`_compile`), so the same bits, NaN columns included: entry i is
    in the support where 1 + k_i v_i > s_i, k_i and s_i the count and sum of the column's entries >= v_i, and
    tau = (s - 1) / k over the support's k entries. The loop runs its columns through scratch memory at ~6 ns an
    entry on one AVX-512 core; this 1.4 ns at size 16 and 0.7 ns at size 8 (docs/benchmarks.md).
    ``block_sparsemax_backward(output, grad, start)``: ``sparsemax_columns_backward``'s for that block, in place in
    grad, the same way (the sums in the same order; only a zero's sign may differ)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def block_sparsemax(typingctx, flat, start):
        signature = types.void(flat, types.intp)

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            index = context.get_value_type(types.intp)
            vector = ir.VectorType(ir.FloatType(), size)
            base = builder.gep(array.data, [args[1]])
            pointers = [builder.bitcast(builder.gep(base, [ir.Constant(index, m * size)]), vector.as_pointer())
                        for m in range(size)]  # fmt: skip
            rows = [builder.load(pointer, align=4) for pointer in pointers]  # row m: entry m of every column
            zero, one = ir.Constant(vector, [0.0] * size), ir.Constant(vector, [1.0] * size)
            support = total = zero
            for i in range(size):
                count = partial = zero
                for m in range(size):
                    taken = builder.uitofp(builder.fcmp_ordered(">=", rows[m], rows[i]), vector)
                    count = builder.fadd(count, taken)
                    partial = builder.fadd(partial, builder.fmul(taken, rows[m]))
                inside = builder.uitofp(builder.fcmp_ordered(">", builder.fmul(count, rows[i]),
                                                              builder.fsub(partial, one)), vector)  # fmt: skip
                support = builder.fadd(support, inside)
                total = builder.fadd(total, builder.fmul(inside, rows[i]))
            found = builder.fdiv(builder.fsub(total, one), support)
            tau = builder.select(builder.fcmp_ordered(">", support, zero), found,
                                 ir.Constant(vector, [float("nan")] * size))  # fmt: skip
            for i in range(size):  # max(v - tau, 0) as Python's max: NaN stays NaN
                difference = builder.fsub(rows[i], tau)
                builder.store(builder.select(builder.fcmp_ordered(">", zero, difference), zero, difference),
                              pointers[i], align=4)  # fmt: skip
            return context.get_dummy_value()

        return signature, codegen

    @intrinsic
    def block_sparsemax_backward(typingctx, output, grad, start):
        signature = types.void(output, grad, types.intp)

        def codegen(context, builder, signature, args):
            index = context.get_value_type(types.intp)
            vector = ir.VectorType(ir.FloatType(), size)
            bases = [builder.gep(context.make_array(signature.args[at])(context, builder, args[at]).data, [args[2]])
                     for at in (0, 1)]  # fmt: skip
            outputs, grads = ([builder.bitcast(builder.gep(base, [ir.Constant(index, m * size)]), vector.as_pointer())
                               for m in range(size)] for base in bases)  # fmt: skip
            zero, one = ir.Constant(vector, [0.0] * size), ir.Constant(vector, [1.0] * size)
            inside = [builder.fcmp_ordered(">", builder.load(pointer, align=4), zero) for pointer in outputs]
            values = [builder.load(pointer, align=4) for pointer in grads]
            support = total = zero
            for i in range(size):
                support = builder.fadd(support, builder.select(inside[i], one, zero))
                total = builder.fadd(total, builder.select(inside[i], values[i], zero))
            mean = builder.select(builder.fcmp_ordered(">", support, zero), builder.fdiv(total, support), zero)
            for i in range(size):
                builder.store(builder.select(inside[i], builder.fsub(values[i], mean), zero), grads[i], align=4)
            return context.get_dummy_value()

        return signature, codegen

    return block_sparsemax, block_sparsemax_backward


def _bit_casts(numba) -> tuple[Callable[[float], int], Callable[[int], float]]:
    """Two numba intrinsics: a float32's bits as an int32, and an int32's bits as a float32 (LLVM bitcasts: free,
    and a loop that uses them still vectorises, where ``np.frexp`` or a view per value would not)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def float_bits(typingctx, value):
        return types.int32(types.float32), lambda context, builder, signature, args: builder.bitcast(
            args[0], ir.IntType(32))

    @intrinsic
    def bits_float(typingctx, value):
        return types.float32(types.int32), lambda context, builder, signature, args: builder.bitcast(
            args[0], ir.FloatType())

    return float_bits, bits_float


def _tile_sums(context, builder, signature, args, height: int) -> list[list]:
    """The sums of a tile, as LLVM vector code (the codegen :func:`_tile_product` and :func:`_tile_best` share):
    args[0] x (R, in), args[1] panels (P, in, PANEL), args[2] p, args[3] r. Two 16-lane accumulators per row, held in
    registers through the loop over i, each step ``llvm.fma`` of the row's x[r + k, i] broadcast and the panel's row
    i: a row's operations are the same at any height. Returns, per row k < ``height``, its two vectors (lanes 0-15
    and 16-31 of the panel)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils

    lanes = PANEL // 2
    x_array, panel_array = (context.make_array(signature.args[at])(context, builder, args[at]) for at in (0, 1))
    index = context.get_value_type(types.intp)
    vector = ir.VectorType(ir.FloatType(), lanes)
    width = builder.extract_value(x_array.shape, 1)
    starts = [builder.gep(x_array.data, [builder.mul(builder.add(args[3], ir.Constant(index, k)), width)])
              for k in range(height)]  # each tile row's first element in x  # fmt: skip
    panel = builder.gep(panel_array.data, [builder.mul(args[2], builder.mul(width, ir.Constant(index, PANEL)))])
    sums = [cgutils.alloca_once_value(builder, ir.Constant(vector, None)) for _ in range(2 * height)]
    undefined, first = ir.Constant(vector, ir.Undefined), ir.Constant(ir.IntType(32), 0)
    broadcast = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)  # lane 0 into every lane
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                         f"llvm.fma.v{lanes}f32")  # fmt: skip
    with cgutils.for_range(builder, width) as loop:
        weights_row = builder.gep(panel, [builder.mul(loop.index, ir.Constant(index, PANEL))])
        halves = [builder.load(builder.bitcast(builder.gep(weights_row, [ir.Constant(index, lanes * half)]),
                                               vector.as_pointer()), align=4) for half in (0, 1)]  # fmt: skip
        for k in range(height):
            value = builder.load(builder.gep(starts[k], [loop.index]))
            lane = builder.insert_element(undefined, value, first)
            spread = builder.shuffle_vector(lane, undefined, broadcast)
            for half in (0, 1):
                total = sums[2 * k + half]
                builder.store(builder.call(fma, [spread, halves[half], builder.load(total)]), total)
    return [[builder.load(sums[2 * k + half]) for half in (0, 1)] for k in range(height)]


def _compile(numba, panel_product) -> tuple[Callable[..., None], ...]:
    """The product kernel, the LRNN layer step (:func:`lrnn_layer_step`), the RegularGPT thick layer step
    (:func:`regulargpt_layer_step`), the column sparsemax over many blocks (:func:`column_sparsemax`) and the
    linear scan (:func:`linear_scan`) with their backward passes, compiled with numba (all but the product on first
    call). A step's products run
    ``product`` on weights (out, in), or ``panel_product`` (:func:`_compile_panel_kernel`, compiled apart: its sums
    keep their order, where this module's ``reassoc`` would let the compiler reorder them) on weights given as
    panels (P, in, PANEL): ``matmul`` picks by the weight's number of dimensions, when the step compiles."""
    from numba.extending import overload

    # reassoc only: sums may run in any order (what vectorises the dot products); NaN and inf keep their meaning
    # (full fastmath would assume neither occurs). numpy's error model: a division by zero gives inf or NaN, as
    # torch's, where Python's would raise; and a loop with a division in it vectorises (no check per value).
    jit = functools.partial(numba.njit, fastmath={"reassoc"}, boundscheck=False, nogil=True, error_model="numpy")
    (vector_sparsemax_8, vector_backward_8), (vector_sparsemax_16, vector_backward_16) = (
        _block_sparsemax(numba, size) for size in (8, 16)
    )

    @jit(inline="always")
    def product(x, weight, bias, has_bias, out):  # (R, in), (out, in), (out,) or (0,), (R, out)
        rows, width = x.shape
        for o in range(weight.shape[0]):  # each weight row is read from memory once, for every x row
            for r in range(rows):
                total = np.float32(0.0)
                for i in range(width):
                    total += weight[o, i] * x[r, i]
                out[r, o] = total + bias[o] if has_bias else total

    @jit("void(float32[:, ::1], float32[:, ::1], float32[::1], boolean, float32[:, ::1])")
    def kernel(x, weight, bias, has_bias, out):
        product(x, weight, bias, has_bias, out)

    def matmul(x, weight, bias, has_bias, out):  # typed by the overload below, in compiled code only
        raise NotImplementedError

    @overload(matmul)
    def matmul_by_layout(x, weight, bias, has_bias, out):
        if weight.ndim == 3:  # panels: the row-invariant product
            return lambda x, weight, bias, has_bias, out: panel_product(x, weight, bias, has_bias, out)
        return lambda x, weight, bias, has_bias, out: product(x, weight, bias, has_bias, out)

    @jit(inline="always")
    def layer_norm(x, weight, bias, eps, out):  # (R, d) -> (R, d), as F.layer_norm (biased variance)
        rows, width = x.shape
        for r in range(rows):
            mean = np.float32(0.0)
            for i in range(width):
                mean += x[r, i]
            mean /= width
            variance = np.float32(0.0)
            for i in range(width):
                variance += (x[r, i] - mean) ** 2
            scale = np.float32(1.0) / np.sqrt(variance / width + eps)
            for i in range(width):
                out[r, i] = (x[r, i] - mean) * scale * weight[i] + bias[i]

    float_bits, bits_float = _bit_casts(numba)

    @jit(inline="always")
    def erf(value):  # float32 -> float32, within 4.5e-7 of erf: no call, so a loop over it vectorises
        """The rational approximation that Eigen and XLA use for float32 erf: x P(x^2) / Q(x^2) on x clamped to
        [-4, 4] (beyond it erf is +-1 in float32). GELU over 64 x 64 values: 6.2 us, with libm's erf 21.4 us."""
        x = min(max(value, np.float32(-4.0)), np.float32(4.0))
        x2 = x * x
        p = x2 * np.float32(-2.72614225801306e-10) + np.float32(2.77068142495902e-08)
        p = x2 * p + np.float32(-2.10102402082508e-06)
        p = x2 * p + np.float32(-5.69250639462346e-05)
        p = x2 * p + np.float32(-7.34990630326855e-04)
        p = x2 * p + np.float32(-2.95459980854025e-03)
        p = x2 * p + np.float32(-1.60960333262415e-02)
        q = x2 * np.float32(-1.45660718464996e-05) + np.float32(-2.13374055278905e-04)
        q = x2 * q + np.float32(-1.68282697438203e-03)
        q = x2 * q + np.float32(-7.37332916720468e-03)
        q = x2 * q + np.float32(-1.42647390514189e-02)
        return x * p / q

    @jit(inline="always")
    def power(value, p):  # float32 |value| ** p (p float64), within 1 ulp: no call, so a loop over it vectorises
        """2 ** (p log2 |value|) from the value's bits: log2 of the mantissa m in [sqrt(1/2), sqrt(2)] by the series
        of atanh((m - 1) / (m + 1)) to s^11, 2 ** f for f in [-1/2, 1/2] by exp's series to t^8, both in float64,
        then the exponent put into the bits in two halves (each a normal float32: the product rounds once, to a
        subnormal or inf where it must). Subnormal inputs give 0 (right for the norm's p >= 1: their power is below
        float32's normal range; the divisors' 1/p take sums >= 1), a power past float32's range inf, inf gives inf, NaN
        stays NaN. Within 6e-8 of the float64 power over 1e-30 .. 1e30 (torch's float32 pow: 3.4e-6). 64 rows of 128:
        63 us, libm's powf 170 us (dev-intel)."""
        magnitude = abs(value)
        bits = float_bits(magnitude)
        high = np.int32((bits & 0x7FFFFF) > 0x3504F3)  # the mantissa above sqrt(2): halve it, and add 1 to the exponent
        exponent = (bits >> 23) - 127 + high
        m = np.float64(bits_float(np.int32((bits & 0x7FFFFF) | 0x3F800000))) * (1.0 - 0.5 * high)
        s = (m - 1.0) / (m + 1.0)
        s2 = s * s
        series = 1.0 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 * (1.0 / 9 + s2 * (1.0 / 11)))))
        y = p * (exponent + 2.0 * s * series * 1.4426950408889634)  # p log2 |value|
        n = np.floor(y + 0.5)
        t = (y - n) * 0.6931471805599453  # 2 ** (y - n) = exp(t), |t| <= ln(2) / 2
        e = 1.0 + t * (1.0 + t * (0.5 + t * (1.0 / 6 + t * (1.0 / 24 + t * (1.0 / 120 + t * (1.0 / 720 + t * (
            1.0 / 5040 + t * (1.0 / 40320))))))))
        whole = np.int32(min(max(n, -160.0), 129.0))  # from 2 ** 129 x e >= 2 ** 128.5 the product is inf
        half = whole >> 1  # 2 ** whole as 2 ** half times 2 ** (whole - half), both in float32's normal range
        result = np.float32(e) * bits_float(np.int32((half + 127) << 23)) * bits_float(
            np.int32((whole - half + 127) << 23))
        normal = np.float32(magnitude >= np.float32(1.17549435e-38))
        return result * normal if bits < 0x7F800000 else magnitude  # inf and NaN: themselves (inf ** p is inf)

    @jit(inline="always")
    def gelu(values):  # (R, n) in place: exact GELU, as F.gelu (erf above)
        for r in range(values.shape[0]):
            for i in range(values.shape[1]):
                value = values[r, i]
                values[r, i] = np.float32(0.5) * value * (np.float32(1.0) + erf(value * _SQRT_HALF))

    @jit(inline="always")
    def residual_tail(x, mixed, mixer, ln_2, c_fc, c_proj, eps, out):
        """out = y + MLP(LN_2(y)) with y = x + mixer(mixed): a pre-norm block after its mixing (the recurrence's
        states or the attention's heads), (R, d_model)."""
        matmul(mixed, mixer[0], mixer[1], True, out)
        rows, width = x.shape
        for r in range(rows):
            for i in range(width):
                out[r, i] += x[r, i]
        normed = np.empty_like(x)
        layer_norm(out, ln_2[0], ln_2[1], eps, normed)
        # (R, d_ff), from the bias: the weight is (d_ff, d_model) or panels
        hidden = np.empty((rows, c_fc[1].shape[0]), dtype=np.float32)
        matmul(normed, c_fc[0], c_fc[1], True, hidden)
        gelu(hidden)
        matmul(hidden, c_proj[0], c_proj[1], True, normed)
        for r in range(rows):
            for i in range(width):
                out[r, i] += normed[r, i]

    @jit(inline="always")
    def sparsemax_block(block, size, scratch):
        """block: (b b,), a row-major b x b block, in place -> every column j (block[j + i b] for i < b) its sparsemax
        max(v - tau, 0), as ``column_sparsemax`` (model/ops/linear_scan.py) without the sort: entry i is in the
        support where 1 + k_i v_i > s_i, with k_i and s_i the count and sum of the column's entries >= v_i (the
        sorted test at rank k_i; ties pass or fail together), and tau = (s - 1) / k over the support's k entries; a
        NaN column comes out NaN. The b columns run side by side (vector lanes), with no branch per entry: a
        comparison on random data mispredicted half the time, 7 ns an entry against ~1. scratch: (4, b). Blocks of 8
        and 16 (the shipped text models') run :func:`_block_sparsemax`'s vector code instead: the same bits."""
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
    def layer_step(
        x, state, ln_1, joint, g_bias, b_bias, out_proj, ln_2, c_fc, c_proj, eps, p, stochastic, x_out, state_out
    ):
        rows = x.shape[0]
        heads, size = state.shape[1], state.shape[2]
        u = np.empty_like(x)
        layer_norm(x, ln_1[0], ln_1[1], eps, u)
        outputs = g_bias.shape[0] + b_bias.shape[0]  # g(u) (H b^2) then B u (H b; none if stochastic)
        products = np.empty((rows, outputs), dtype=np.float32)
        matmul(u, joint, g_bias, False, products)
        generated = g_bias.shape[0]
        for r in range(rows):
            for k in range(generated):
                products[r, k] += g_bias[k]
            for k in range(b_bias.shape[0]):
                products[r, generated + k] += b_bias[k]
        scaled = np.empty(size, dtype=np.float32)
        scratch = np.empty((4, size), dtype=np.float32)
        powered = np.empty(0 if stochastic else generated, dtype=np.float32)  # a row's |g(u)| ** p
        norms = np.empty(0 if stochastic else heads * size, dtype=np.float32)  # a row's max(1, ||column j||_p)
        exponent, inverse = np.float64(p), 1.0 / np.float64(p)
        for r in range(rows):
            if not stochastic:  # the powers and the p-th roots each in one contiguous loop: they vectorise
                for k in range(generated):
                    powered[k] = power(products[r, k], exponent)
                for h in range(heads):  # g(u)'s (H, b, b) blocks, row-major: entry (i, j) at h b^2 + i b + j
                    for j in range(size):
                        total = np.float32(0.0)
                        for i in range(size):
                            total += powered[h * size * size + i * size + j]
                        # max(1, total) keeping a NaN, as torch's clamp does (Python's max(1, NaN) is 1)
                        norms[h * size + j] = np.float32(1.0) if total < np.float32(1.0) else total  # noqa: FURB136
                for k in range(heads * size):
                    norms[k] = power(norms[k], inverse)
            for h in range(heads):
                block = h * size * size
                if stochastic:  # every column becomes its sparsemax; the state entries stay
                    sparsemax_block(products[r, block : block + size * size], size, scratch)
                    scaled[:] = state[r, h]
                else:
                    for j in range(size):  # the state entry of column j, divided by max(1, ||column j||_p)
                        scaled[j] = state[r, h, j] / norms[h * size + j]
                for i in range(size):
                    total = np.float32(0.0)
                    for j in range(size):
                        total += products[r, block + i * size + j] * scaled[j]
                    state_out[r, h, i] = total if stochastic else total + products[r, generated + h * size + i]
        residual_tail(x, state_out.reshape(rows, heads * size), out_proj, ln_2, c_fc, c_proj, eps, x_out)

    @jit(inline="always")
    def matrix(packed, start, i, columns):  # tensor i of a block in the pack, as (rows, columns)
        return packed[start[i] : start[i + 1]].reshape(((start[i + 1] - start[i]) // columns, columns))

    def weight_of(packed, start, i, columns, panels, slot):  # typed by the overload below, in compiled code only
        raise NotImplementedError

    @overload(weight_of)
    def weight_by_kind(packed, start, i, columns, panels, slot):
        """A block's matrix i for the products: its panels panels[slot] where the step got them (a tuple of arrays),
        else the matrix in the pack (the step got ``()``)."""
        if isinstance(panels, numba.types.UniTuple):
            return lambda packed, start, i, columns, panels, slot: panels[slot]
        return lambda packed, start, i, columns, panels, slot: matrix(packed, start, i, columns)

    @jit(inline="always")
    def block_step(x, window, positions, dilation, where, slots, packed, start, panels, block, has_null, heads, eps,
                   x_out):  # fmt: skip
        """One block (tensors of ``start`` in ``packed``, its matrices' panels from panels[4 block] where the step
        has them: :func:`regulargpt_layer_step`) over x (R, d) -> x_out; where[r, j]: the ring slot of row r's
        position positions[r] - j * dilation."""
        width = x.shape[1]
        head_dim = width // heads
        ln_1 = (packed[start[0] : start[1]], packed[start[1] : start[2]])
        c_attn = (weight_of(packed, start, 2, width, panels, 4 * block), packed[start[3] : start[4]])
        c_proj = (weight_of(packed, start, 4, width, panels, 4 * block + 1), packed[start[5] : start[6]])
        ln_2 = (packed[start[6] : start[7]], packed[start[7] : start[8]])
        c_fc_bias = packed[start[9] : start[10]]
        c_fc = (weight_of(packed, start, 8, width, panels, 4 * block + 2), c_fc_bias)
        hidden_size = c_fc_bias.shape[0]
        mlp_proj = (weight_of(packed, start, 10, hidden_size, panels, 4 * block + 3), packed[start[11] : start[12]])
        relative_bias = matrix(packed, start, 12, (start[13] - start[12]) // heads)
        null_key = matrix(packed, start, 13, head_dim) if has_null else relative_bias
        null_value = matrix(packed, start, 14, head_dim) if has_null else relative_bias
        rows = x.shape[0]
        allocated = window.shape[0] // (rows * 2 * heads)  # slots held per row and channel
        chunk_size = relative_bias.shape[1]  # C
        scale = np.float32(1.0) / np.sqrt(np.float32(head_dim))
        u = np.empty_like(x)
        layer_norm(x, ln_1[0], ln_1[1], eps, u)
        qkv = np.empty((rows, 3 * width), dtype=np.float32)  # q | k | v, heads in order
        matmul(u, c_attn[0], c_attn[1], True, qkv)
        attended = np.empty_like(x)
        scores = np.empty(chunk_size, dtype=np.float32)
        for r in range(rows):
            for h in range(heads):
                query = h * head_dim
                keys = (r * 2 * heads + h) * allocated  # the first entry of the head's key ring; its values' next
                values = keys + heads * allocated
                null_score = np.float32(0.0)
                if has_null:
                    for i in range(head_dim):
                        null_score += qkv[r, query + i] * null_key[h, i]
                    null_score *= scale
                top = -np.inf
                for j in range(chunk_size):  # slot j: key j * dilation back (0: the new one); its score
                    position = positions[r] - j * dilation
                    if j < slots and position >= 0:
                        total = np.float32(0.0)
                        if j == 0:
                            for i in range(head_dim):
                                total += qkv[r, query + i] * qkv[r, width + query + i]
                        else:
                            key = keys + where[r, j]
                            for i in range(head_dim):
                                total += qkv[r, query + i] * window[key, i]
                        scores[j] = total * scale + relative_bias[h, j]
                    elif has_null:
                        scores[j] = null_score + relative_bias[h, j]
                    else:
                        scores[j] = -np.inf
                    top = max(top, scores[j])
                count = chunk_size if has_null else slots
                total = np.float32(0.0)
                for j in range(count):
                    scores[j] = np.exp(scores[j] - top)
                    total += scores[j]
                kept = np.float32(0.0)  # the share of the slots in range; the null value gets the rest
                for i in range(head_dim):
                    attended[r, query + i] = np.float32(0.0)
                for j in range(slots):
                    position = positions[r] - j * dilation
                    if position < 0:
                        continue
                    weight = scores[j] / total
                    kept += weight
                    if j == 0:
                        for i in range(head_dim):
                            attended[r, query + i] += weight * qkv[r, 2 * width + query + i]
                    else:
                        value = values + where[r, j]
                        for i in range(head_dim):
                            attended[r, query + i] += weight * window[value, i]
                if has_null:
                    for i in range(head_dim):
                        attended[r, query + i] += (np.float32(1.0) - kept) * null_value[h, i]
        for r in range(rows):  # the window stores the new keys and values (after every read of the ring)
            for channel in range(2 * heads):
                target = (r * 2 * heads + channel) * allocated + where[r, 0]
                for i in range(head_dim):
                    window[target, i] = qkv[r, width + channel * head_dim + i]
        residual_tail(x, attended, c_proj, ln_2, c_fc, mlp_proj, eps, x_out)

    @jit
    def regulargpt_layer(x, windows, positions, dilation, ring, slots, packed, starts, panels, has_null, heads, eps,
                         x_out):  # fmt: skip
        blocks, rows = starts.shape[0], x.shape[0]
        columns = windows[0].shape[0] // (rows * 2 * heads) // dilation  # K of ring_slot
        period = ring // dilation  # C - 1
        where = np.empty((rows, max(slots, 1)), dtype=np.int64)  # ring_slot (model/regulargpt/cache.py) of each key
        for r in range(rows):
            base, column = positions[r] % dilation * columns, positions[r] // dilation % period
            for j in range(where.shape[1]):  # position - j * dilation: the same run, j columns back
                where[r, j] = base + (column - j) % period
        current = x
        for k in range(blocks):  # the last block writes x_out; the others alternate between two buffers
            out = x_out if (blocks - 1 - k) % 2 == 0 else np.empty_like(x)
            block_step(current, windows[k], positions, dilation, where, slots, packed, starts[k], panels, k, has_null,
                       heads, eps, out)  # fmt: skip
            current = out

    @jit
    def sparsemax_columns(flat, size):  # (N b b,): N row-major b x b blocks, each in place -> sparsemax_block's
        scratch = np.empty((4, size), dtype=np.float32)
        for start in range(0, flat.shape[0], size * size):
            sparsemax_block(flat[start : start + size * size], size, scratch)

    @jit
    def scan_states(transitions, inputs, initial, states, final):
        """(B, T, H, b, b), (B, T, H, b), (B, H, b) -> states (B, T, H, b) and final (B, H, b): state_t = A_t
        state_(t-1) + u_t, each block's product then the input, as ``scan_step``."""
        batch, length, heads, size = inputs.shape
        state = np.empty(size, dtype=np.float32)
        for r in range(batch):
            for h in range(heads):
                state[:] = initial[r, h]
                for t in range(length):
                    for i in range(size):
                        total = np.float32(0.0)
                        for j in range(size):
                            total += transitions[r, t, h, i, j] * state[j]
                        states[r, t, h, i] = total + inputs[r, t, h, i]
                    state[:] = states[r, t, h]
                final[r, h] = state

    @jit
    def sparsemax_columns_backward(output, grad, size):
        """(N b b,) each: the sparsemax's outputs and the gradient reaching them, in place -> the gradient of its
        inputs: on a column's support (positive outputs) the gradient less its mean there, 0 off it. Blocks of 8 and
        16 as vector code (:func:`_block_sparsemax`)."""
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

    @jit
    def scan_backward(transitions, initial, states, grad_states, grad_final, grad_transitions, grad_inputs,
                      grad_initial):  # fmt: skip
        """The scan's backward (``_CompiledScan``): shapes as ``scan_states``'s, the gradients of its outputs in."""
        batch, length, heads, size = states.shape
        carried = np.empty(size, dtype=np.float32)  # G_(t+1) carried back: A_(t+1)^T G_(t+1)
        back = np.empty(size, dtype=np.float32)  # A_t^T G_t: each sum over i in order, row by row
        for r in range(batch):
            for h in range(heads):
                carried[:] = grad_final[r, h]
                for t in range(length - 1, -1, -1):
                    before = states[r, t - 1, h] if t > 0 else initial[r, h]  # state_(t-1)
                    transition, grad_transition = transitions[r, t, h], grad_transitions[r, t, h]
                    back[:] = np.float32(0.0)
                    for i in range(size):  # (vectors along j: the rows of A_t and dA_t are contiguous)
                        g = carried[i] + grad_states[r, t, h, i]  # G_t[i]
                        grad_inputs[r, t, h, i] = g
                        for j in range(size):
                            grad_transition[i, j] = g * before[j]
                            back[j] += transition[i, j] * g
                    carried[:] = back
                grad_initial[r, h] = carried

    return (
        kernel, layer_step, regulargpt_layer, sparsemax_columns, sparsemax_columns_backward, scan_states, scan_backward
    )


_NO_BIAS = np.zeros(0, dtype=np.float32)
_LAYER_MATRICES = (2, 5, 9, 11)  # lrnn_layer_step's weights that are matrices: generator, readout, MLP (2)
_SQRT_HALF = np.float32(math.sqrt(0.5))
