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
all) then run across outputs instead (model/ops/cpu_kernels/panels.py): the weight copied once into panels of
:data:`PANEL` outputs, each output's sum in a fixed order of fused multiply-adds, a tile of rows by the panel's
outputs in vector registers (``tile_product`` in model/ops/cpu_kernels/helpers.py), as MKL vectorises many rows.
The dot-product kernel, which reduces each output's sum horizontally, took 10x MKL's time for a 64-row 8,192 x 16
head and 1.9x for 8,192 x 128; the panels take 0.9-1.2x at 64 rows on an AVX-512 machine, where numba's own
vectorising of them took 3-4x (docs/benchmarks.md).
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
import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from model.ops import prepacked
from model.ops.cpu_kernels.helpers import PANEL, tile_rows
from model.ops.cpu_kernels.layer_ops import LayerOps, build_layer_ops
from model.ops.cpu_kernels.layer_steps import LayerSteps, build_layer_steps
from model.ops.cpu_kernels.panels import Panels, build_panels
from model.ops.cpu_kernels.scan import Scan, build_scan
from model.ops.cpu_kernels.sparsemax import Sparsemax, build_sparsemax

logger = logging.getLogger(__name__)

LayerTransitions = Literal["column", "stochastic"]  # the LRNN transitions lrnn_layer_step runs
MAX_ROWS = 4  # the kernel's rows per call; from 8 rows MKL's blocked products were faster (docs/benchmarks.md)
# Smaller weights stay F.linear: such a weight is likely in a cache between steps, where MKL reads it about as fast,
# and the kernel's call costs ~8 us of Python against F.linear's ~5 (a hot 128 x 128: 11 against 5 us; 512 x 512:
# 26 us either way; 2048 x 512: 67 against 80-95 us).
MIN_ELEMENTS = 2**18  # 1 MiB of float32


@dataclasses.dataclass(frozen=True)
class _Kernels:
    """Every compiled kernel family (model/ops/cpu_kernels/), built together by :func:`_build`."""

    panels: Panels  # the row-invariant product and its greedy picks
    ops: LayerOps  # the dot-product kernel (.dots) and the layer steps' shared pieces
    steps: LayerSteps  # the LRNN layer step (.lrnn) and the RegularGPT thick layer step (.regulargpt)
    sparsemax: Sparsemax  # the column sparsemax (.columns) and its backward
    scan: Scan  # the linear scan (.states) and its backward


_state = threading.local()  # .off: torch_products() depth in this thread; .invariant: set_row_invariant's choice
_kernels: _Kernels | None = None  # set once by _build, whole
_unavailable: str | None = None  # why the kernels cannot be built, once known
_build_lock = threading.Lock()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (..., in), weight: (out, in), bias: (out,) or None -> (..., out): ``F.linear(x, weight, bias)``, through
    the streaming kernel when it applies (module docstring), else through the weight's oneDNN pack where it has a
    valid one (model/ops/prepacked.py), else ``F.linear``."""
    kernels = (_kernels or _build()) if _applies(x, weight, bias) else None
    if kernels is None:
        packed = None if _off() else prepacked.product(x, weight, bias)
        return F.linear(x, weight, bias) if packed is None else packed
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()  # (R, in)
    values, offsets = rows.numpy(force=True), _NO_BIAS if bias is None else bias.numpy(force=True)
    if _invariant_step(x):
        panels = _panels(weight)  # (P, in, PANEL)
        out = np.empty((rows.shape[0], panels.shape[0] * PANEL), dtype=np.float32)  # (R, P PANEL)
        kernels.panels.product(values, panels, offsets, bias is not None, out)
        result = torch.from_numpy(out)[:, : weight.shape[0]]  # (R, out)
    else:
        out = np.empty((rows.shape[0], weight.shape[0]), dtype=np.float32)  # (R, out)
        kernels.ops.dots(values, weight.numpy(force=True), offsets, bias is not None, out)
        result = torch.from_numpy(out)
    return result if x.dim() == 2 else result.view(*x.shape[:-1], weight.shape[0])


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x: (R, in), weight: (out, in), bias: (out,) or None -> each row's greedy pick of ``linear(x, weight, bias)``,
    as :func:`rows_argmax` takes it: (ids (R,) int64, their values (R,)). A decode step's product under
    :func:`set_row_invariant` (the panels) never writes its logits: each tile's sums are compared in the registers
    they are in (``tile_best`` in model/ops/cpu_kernels/helpers.py), the same sums, so the same pick and value as the
    logits', bit for bit (at 64 rows of an 8,192 x 16 head this took about half the product and argmax's time:
    docs/benchmarks.md, "Several decode steps an iteration; greedy picks without logits"). Elsewhere: the logits,
    then :func:`rows_argmax`."""
    if (x.dim() == 2 and _invariant_step(x) and _applies(x, weight, bias)
            and (kernels := _kernels or _build()) is not None):  # fmt: skip
        rows = x.contiguous().numpy(force=True)
        index, value = np.empty(rows.shape[0], dtype=np.int64), np.empty(rows.shape[0], dtype=np.float32)
        offsets = _NO_BIAS if bias is None else bias.numpy(force=True)
        kernels.panels.argmax(rows, _panels(weight), offsets, bias is not None, weight.shape[0], index, value)
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
    return (_kernels or _build()) is not None


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
    """One served LRNN layer (model/lrnn/model.py, ``RecurrentBlock.step`` with the full generator) as one compiled
    call: x + readout(A(u) state + B u) with u = LN_1(x), then + MLP(LN_2(.)). ``transitions`` "column": A(u) =
    g(u) with column j divided by max(1, ||column j||_p) (applied to the state entry it multiplies, as the torch step
    does); "stochastic": column j of A(u) is the sparsemax of g(u)'s column j (``column_sparsemax`` in
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
    _kernels.steps.lrnn(
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
    _kernels.steps.regulargpt(
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
    _kernels.sparsemax.columns(flat, matrices.shape[-1])
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
        _kernels.sparsemax.backward(output.reshape(-1).numpy(force=True), flat, output.shape[-1])
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
    _kernels.scan.states(*arrays, states, final)
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
        _kernels.scan.backward(*arrays, grad_transitions, grad_inputs, grad_initial)
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
    return not _off() and (_kernels or _build()) is not None


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


def _build() -> _Kernels | None:
    """Import numba and build every kernel family once per process (the first call, under ``_build_lock``; later
    calls return what it built); None (and one warning) if numba is missing."""
    global _kernels, _unavailable
    with _build_lock:
        if _kernels is not None or _unavailable is not None:
            return _kernels
        try:
            import numba
        except ImportError as error:  # an install without the dependency: every product stays F.linear
            _unavailable = f"numba is not importable ({error})"
            logger.warning("few-row CPU products use F.linear: %s", _unavailable)
            return None
        panels = build_panels(numba, tile_rows(numba))
        ops = build_layer_ops(numba, panels.product)
        sparsemax = build_sparsemax(numba)
        _kernels = _Kernels(panels, ops, build_layer_steps(numba, ops, sparsemax.block), sparsemax, build_scan(numba))
        return _kernels


_NO_BIAS = np.zeros(0, dtype=np.float32)
_LAYER_MATRICES = (2, 5, 9, 11)  # lrnn_layer_step's weights that are matrices: generator, readout, MLP (2)
