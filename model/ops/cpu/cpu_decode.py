"""The public face of the numba CPU kernels (model/ops/cpu/kernels/): few-row products, a served LRNN or RegularGPT
layer as one compiled decode step, a stochastic LRNN's column sparsemax and linear scan. Each falls back to torch, or
returns None, where its kernel does not apply (numba missing included). Under :func:`set_row_invariant` a row's decode
results are bitwise independent of its batch. The kernels build once, on first use, under a lock."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from model.ops import prepacked
from model.ops.cpu.kernels.helpers import PANEL, tile_rows
from model.ops.cpu.kernels.layer_ops import LayerOps, build_layer_ops
from model.ops.cpu.kernels.layer_steps import LayerSteps, build_layer_steps
from model.ops.cpu.kernels.panels import Panels, build_panels
from model.ops.cpu.kernels.scan import Scan, build_scan
from model.ops.cpu.kernels.sparsemax import Sparsemax, build_sparsemax

logger = logging.getLogger(__name__)

LayerTransitions = Literal["column", "stochastic"]  # the LRNN transitions lrnn_layer_step runs
MAX_ROWS = 4  # the dot-product kernel's rows per call; MKL's blocked products overtake it a few rows above
# Smaller weights stay F.linear: such a weight likely stays cached between steps, where MKL reads it about as fast,
# and the kernel's Python call costs more than F.linear's.
MIN_ELEMENTS = 2**18  # 1 MiB of float32


@dataclasses.dataclass(frozen=True)
class _Kernels:
    """Every compiled kernel family, built together by :func:`_build`."""

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
    """``F.linear(x, weight, bias)``: x (..., in), weight (out, in), bias (out,) or None -> (..., out), equal up to
    float rounding. A kernel runs for float32 CPU tensors, a contiguous weight, no gradients, numba present, outside
    :func:`torch_products`, and either under :func:`set_row_invariant` over one position per row
    (x (R, in) or (..., 1, in); each row's result is then bitwise independent of the others) or for at most
    :data:`MAX_ROWS` rows, :data:`MIN_ELEMENTS` weight entries and one thread. Else the weight's oneDNN pack, else
    ``F.linear``."""
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


def linear_argmax(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, in) -> (ids (R,) int64, values (R,)): :func:`rows_argmax` of ``linear(x, weight, bias)``. Under
    :func:`set_row_invariant` the panel kernel picks from its sums in registers, bitwise as the logits' argmax, without
    writing the logits."""
    if (
        x.dim() == 2
        and _invariant_step(x)
        and _applies(x, weight, bias)
        and (kernels := _kernels or _build()) is not None
    ):
        rows = x.contiguous().numpy(force=True)
        index, value = np.empty(rows.shape[0], dtype=np.int64), np.empty(rows.shape[0], dtype=np.float32)
        offsets = _NO_BIAS if bias is None else bias.numpy(force=True)
        kernels.panels.argmax(rows, _panels(weight), offsets, bias is not None, weight.shape[0], index, value)
        return torch.from_numpy(index), torch.from_numpy(value)
    return rows_argmax(linear(x, weight, bias))


def rows_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (R, V) -> (ids (R,) int64, values (R,)): each row's largest value and its index, the first of ties, a NaN
    before any number (numpy's and torch's argmax); on the CPU through numpy."""
    if logits.device.type == "cpu":
        values = logits.detach().numpy()
        ids = values.argmax(-1)
        return torch.from_numpy(ids), torch.from_numpy(values[np.arange(len(ids)), ids])
    ids = logits.argmax(-1)
    return ids, logits.gather(-1, ids[:, None])[:, 0]


def kernel_available() -> bool:
    """Whether the kernels can run here (numba importable); builds them on the first call."""
    return (_kernels or _build()) is not None


def streams(rows: int = 1, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a product of ``rows`` rows of ``dtype`` runs through a kernel now (gradients and the weight aside):
    float32, numba present, outside :func:`torch_products`, and row invariance or at most :data:`MAX_ROWS` rows on one
    thread. Serving lays weights out for the kernels where this holds."""
    invariant = _invariant()
    return (
        dtype is torch.float32
        and (invariant or rows <= MAX_ROWS)
        and not _off()
        and (invariant or torch.get_num_threads() == 1)
        and kernel_available()
    )


def set_row_invariant(invariant: bool) -> None:
    """For this thread from now on. True: every compiled layer step and every :func:`linear` over one position per row
    run through the kernels at any rows, size and threads, so a row's result is bitwise the same in any batch. False:
    the default policy. Set it before ``for_serving``; it needs numba (:func:`kernel_available`)."""
    _state.invariant = invariant


def row_invariant() -> bool:
    """Whether :func:`set_row_invariant` is on in this thread; callers then run what would batch rows outside the
    kernels one row at a time."""
    return _invariant()


def rows_note() -> str:
    """The rows at which the compiled layer steps run, for a model's serving notes."""
    return "every batch size (batch-invariant)" if _invariant() else f"1-{MAX_ROWS} rows"


def compiles_step(x: torch.Tensor) -> bool:
    """Whether a decode step over ``x`` (rows first) may run as one compiled layer step: CPU, no gradients,
    :func:`streams`."""
    return x.is_cpu and not torch.is_grad_enabled() and streams(x.shape[0], x.dtype)


@contextlib.contextmanager
def row_invariance() -> Iterator[None]:
    """:func:`set_row_invariant` on within the block (this thread), then as it was."""
    before = _invariant()
    set_row_invariant(True)
    try:
        yield
    finally:
        set_row_invariant(before)


@contextlib.contextmanager
def torch_products() -> Iterator[None]:
    """Within the block (this thread), the reference path: :func:`linear` is ``F.linear`` and no other kernel runs."""
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
    """One served LRNN layer (``RecurrentBlock.step``, model/lrnn/model.py) as one compiled call: x (R, d_model), state
    (R, H, b) float32 -> new (x, state). ``arrays``: :func:`layer_step_arrays`; ``transitions`` "column" (g(u)'s columns
    divided by max(1, ||column||_p)) or "stochastic" (each column's sparsemax, no B u, ``p`` unused). Equal to the torch
    step up to float rounding; bitwise row-invariant with arrays made under :func:`set_row_invariant`. Call only where
    :func:`compiles_step` holds (it builds the kernels)."""
    rows = x.contiguous().numpy(force=True)
    x_out = np.empty_like(rows)
    state_out = np.empty(state.shape, dtype=np.float32)
    assert _kernels is not None, "call only where compiles_step holds"
    _kernels.steps.lrnn(
        rows,
        state.contiguous().numpy(force=True),
        (arrays[0], arrays[1]),
        arrays[2],
        arrays[3],
        arrays[4],
        (arrays[5], arrays[6]),
        (arrays[7], arrays[8]),
        (arrays[9], arrays[10]),
        (arrays[11], arrays[12]),
        np.float32(eps),
        np.float64(p),
        transitions == "stochastic",
        x_out,
        state_out,
    )
    return torch.from_numpy(x_out), torch.from_numpy(state_out)


def layer_step_arrays(weights: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The layer's float32 CPU ``weights`` as :func:`lrnn_layer_step` takes them: numpy views, the four matrices as
    panels under :func:`set_row_invariant`. In order: ln_1 weight and bias; the generator's weight (g's, with B's
    stacked below for "column"); g's bias; B's bias ((0,) for "stochastic"); then out_proj, ln_2, c_fc and c_proj,
    weight and bias each. Make them again when a :func:`stamp` or :func:`row_invariant` changes."""
    panels = _invariant()
    return [
        _panels(tensor) if panels and index in _LAYER_MATRICES else tensor.numpy(force=True)
        for index, tensor in enumerate(weights)
    ]


def stamp(tensor: torch.Tensor) -> tuple[int, int | None]:
    """(storage address, version counter or None for an inference tensor): changes whenever ``tensor``'s values may
    have."""
    return tensor.data_ptr(), None if tensor.is_inference() else tensor._version


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """``tensors`` (one dtype, CPU) flattened into one buffer -> (buffer, starts (n + 1,) int64: each one's start, then
    the end), so that a compiled step takes them as one array."""
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
    """One RegularGPT thick layer of a decode step (its K blocks' ``CachedBlock.forward``, model/regulargpt/decode.py)
    as one compiled call: x (R, d_model) float32 -> a new (R, d_model), each block's new keys and values written into
    its window where ``_plan_step`` (model/regulargpt/cache.py) puts them.

    windows: per block (R 2 H allocated, hd) (``KVWindow.entries``); positions: (R,) int64; dilation: C**l; ring: (C-1)
    C**l; slots: J; ``packed``, ``starts`` (K, n + 1): :func:`pack` of each block's ln_1, c_attn, c_proj, ln_2, c_fc and
    MLP c_proj (weight, bias each), relative bias (H, C) and, with ``has_null``, null key and value (H, hd); ``panels``:
    :func:`block_panels`. Equal to the torch step up to float rounding; bitwise row-invariant with panels. Call only
    where :func:`compiles_step` holds."""
    rows = x.contiguous().numpy(force=True)
    x_out = np.empty_like(rows)
    assert _kernels is not None, "call only where compiles_step holds"
    _kernels.steps.regulargpt(
        rows,
        windows,
        positions,
        dilation,
        ring,
        slots,
        packed,
        starts,
        panels,
        has_null,
        heads,
        np.float32(eps),
        x_out,
    )
    return torch.from_numpy(x_out)


def block_panels(matrices: Sequence[torch.Tensor]) -> tuple[np.ndarray, ...]:
    """The blocks' c_attn, c_proj, c_fc and MLP c_proj weights, in block order -> their panels under
    :func:`set_row_invariant` (made once per weight), else ``()``."""
    return tuple(_panels(matrix) for matrix in matrices) if _invariant() else ()


def column_sparsemax(matrices: torch.Tensor) -> torch.Tensor | None:
    """``column_sparsemax`` of model/ops/scan/constraints.py, compiled, with its backward: matrices (..., b, b) -> a new
    tensor, each column projected onto the simplex. None unless float32 on the CPU, non-empty, numba present, outside
    :func:`torch_products`. Equal up to float rounding."""
    if matrices.dtype is not torch.float32 or not matrices.is_cpu or matrices.numel() == 0 or not _compiles():
        return None
    if matrices.requires_grad and torch.is_grad_enabled():
        # torch's Function.apply is unannotated
        projected: torch.Tensor = _CompiledSparsemax.apply(matrices)  # type: ignore[no-untyped-call]
        return projected
    return _sparsemax_forward(matrices)


def _sparsemax_forward(matrices: torch.Tensor) -> torch.Tensor:
    flat = matrices.detach().reshape(-1).numpy(force=True).copy()  # (N b b,): a copy the kernel overwrites
    assert _kernels is not None
    _kernels.sparsemax.columns(flat, matrices.shape[-1])
    return torch.from_numpy(flat).view(matrices.shape)


class _CompiledSparsemax(torch.autograd.Function):
    """Backward: on a column's support (positive outputs) the gradient less its mean there, else 0."""

    @staticmethod
    def forward(ctx: Any, matrices: torch.Tensor) -> torch.Tensor:
        output = _sparsemax_forward(matrices)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (output,) = ctx.saved_tensors
        flat = grad.reshape(-1).numpy(force=True).copy()
        assert _kernels is not None
        _kernels.sparsemax.backward(output.reshape(-1).numpy(force=True), flat, output.shape[-1])
        return torch.from_numpy(flat).view(output.shape)


def linear_scan(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``scan_sequential`` of model/ops/scan/reference.py, compiled, with its backward: transitions (B, T, H, b, b),
    inputs (B, T, H, b), initial_state (B, H, b) or None (zeros) -> (states (B, T, H, b), final (B, H, b)), float32.
    None where :func:`compiles_scan` does not hold. Equal up to float rounding."""
    if not compiles_scan(transitions, inputs, initial_state):
        return None
    if initial_state is None:
        batch, _, heads, size = inputs.shape
        initial_state = inputs.new_zeros((batch, heads, size))
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (transitions, inputs, initial_state)):
        # torch's Function.apply is unannotated
        scanned: tuple[torch.Tensor, torch.Tensor] = _CompiledScan.apply(  # type: ignore[no-untyped-call]
            transitions, inputs, initial_state
        )
        return scanned
    return _scan_forward(transitions, inputs, initial_state)


def _scan_forward(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length, heads, size = inputs.shape
    states = np.empty((batch, length, heads, size), dtype=np.float32)
    final = np.empty((batch, heads, size), dtype=np.float32)
    arrays = [tensor.detach().contiguous().numpy(force=True) for tensor in (transitions, inputs, initial_state)]
    assert _kernels is not None
    _kernels.scan.states(*arrays, states, final)
    return torch.from_numpy(states), torch.from_numpy(final)


class _CompiledScan(torch.autograd.Function):
    """Backward of state_t = A_t state_(t-1) + u_t: G_t = its own gradient + A_(t+1)^T G_(t+1); du_t = G_t, dA_t = G_t
    state_(t-1)^T, d initial = A_0^T G_0."""

    @staticmethod
    def forward(
        ctx: Any, transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        states, final = _scan_forward(transitions, inputs, initial_state)
        ctx.save_for_backward(transitions, initial_state, states)
        return states, final

    @staticmethod
    def backward(
        ctx: Any, grad_states: torch.Tensor | None, grad_final: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        assert _kernels is not None
        _kernels.scan.backward(*arrays, grad_transitions, grad_inputs, grad_initial)
        return torch.from_numpy(grad_transitions), torch.from_numpy(grad_inputs), torch.from_numpy(grad_initial)


def snapped_scan(
    transitions: torch.Tensor,
    inputs: torch.Tensor,
    initial_state: torch.Tensor,
    codes: torch.Tensor,
    every: int,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`linear_scan` with state codes, as ``RecurrentBlock.scan`` runs it (model/lrnn/model.py): after the
    symbol at t with (offset + t + 1) % every == 0 each block's state becomes its nearest row of codes (H, K, b).
    None where :func:`compiles_scan` does not hold, the codes are not float32 on the CPU, or gradients are wanted.
    Equal to the torch loop up to float rounding (and so, at an exact tie of two codes, up to which is picked)."""
    tensors = (transitions, inputs, initial_state, codes)
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        return None
    if not compiles_scan(transitions, inputs, initial_state) or codes.dtype is not torch.float32 or not codes.is_cpu:
        return None
    batch, length, heads, size = inputs.shape
    states = np.empty((batch, length, heads, size), dtype=np.float32)
    final = np.empty((batch, heads, size), dtype=np.float32)
    arrays = [tensor.detach().contiguous().numpy(force=True) for tensor in tensors]
    assert _kernels is not None
    _kernels.scan.snapped(*arrays, every, offset, states, final)
    return torch.from_numpy(states), torch.from_numpy(final)


def compiles_scan(transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None) -> bool:
    """Whether :func:`linear_scan` runs these: float32 CPU tensors of matching shapes, at least one step,
    :func:`_compiles`."""
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
    """Outside :func:`torch_products` and numba present (builds the kernels on first use)."""
    return not _off() and (_kernels or _build()) is not None


def _off() -> int:
    return getattr(_state, "off", 0)


def _invariant() -> bool:
    return getattr(_state, "invariant", False)


def _invariant_step(x: torch.Tensor) -> bool:
    """Whether a product over ``x`` is a decode step's (one position per row) under row invariance."""
    return _invariant() and (x.dim() == 2 or x.shape[-2] == 1)


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """:func:`linear`'s conditions for a kernel, cheapest first."""
    invariant = _invariant_step(x)
    return (
        x.dtype is torch.float32
        and not torch.is_grad_enabled()
        and (invariant or weight.numel() >= MIN_ELEMENTS)
        and x.numel() > 0
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
    """``weight`` (out, in) -> (P, in, PANEL) float32, panel p holding outputs p PANEL .. (p + 1) PANEL - 1 down its
    columns, zeros past ``out``. Kept on the tensor until its :func:`stamp` changes."""
    key = stamp(weight)
    held = getattr(weight, "_row_invariant_panels", None)
    if held is not None and held[0] == key:
        cached: np.ndarray = held[1]
        return cached
    outputs, width = weight.shape
    count = -(-outputs // PANEL)
    panels = np.zeros((count * PANEL, width), dtype=np.float32)  # (P PANEL, in)
    panels[:outputs] = weight.detach().numpy(force=True)
    panels = np.ascontiguousarray(panels.reshape(count, PANEL, width).transpose(0, 2, 1))  # (P, in, PANEL)
    setattr(weight, "_row_invariant_panels", (key, panels))  # an attribute Tensor does not declare
    return panels


def _build() -> _Kernels | None:
    """Builds every kernel family once per process, under ``_build_lock``; None, and one warning, without numba."""
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
