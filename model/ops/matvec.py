"""Few-row CPU kernels for the decode step: products that read the weight at the memory's streaming rate, and the LRNN's
layer step in one call.

A decode step at batch 1 is a chain of matrix-vector products, each of which reads its whole weight once: its
time is the weight's bytes over the rate at which the product streams them. MKL's one-thread matrix-vector kernel
reaches that rate only on some shapes and layouts: on this project's CPU (docs/benchmarks.md, "One-token products")
it read a 4608 x 512 weight at 16 GB/s stored (in, out) and 8 GB/s stored (out, in), and the square and tall
weights of a layer at 8-14 GB/s either way, where a plain sum over memory reads at ~25-29. :func:`linear`'s kernel
is the textbook loop (one dot product per output, over a row of the weight as ``nn.Linear`` stores it), compiled by
numba with reassociation allowed so that the dot products vectorise: 16-26 GB/s on every shape measured, 1.1-2x
MKL's best layout, and with 2-4 rows it reads the weight once for all of them.

:func:`linear` is ``F.linear`` wherever the kernel does not apply: with gradients enabled, on other devices and
dtypes, with more than :data:`MAX_ROWS` rows (MKL's blocked products win from ~8 rows: measured crossover), for a
weight of fewer than :data:`MIN_ELEMENTS` entries or not contiguous as (out, in), or with more than one intra-op
thread (the kernel runs on one; MKL's products use them all). Its results equal ``F.linear``'s up to float rounding
(the sums run in another order); each row's result is the same whatever the other rows are. numba is imported and
the kernel compiled (~1 s) on first use; without numba, every call is ``F.linear`` and a warning says why once.
:func:`torch_products` turns the kernel off within a block (the reference path, for tests and benchmarks).

Between the products, a layer's ~20 small ops (layer norms, the transition constraint, GELU, residual adds) cost
more than their arithmetic: each is a dispatch whose code and data the weights streamed before it have evicted
(oneDNN's GELU of 2,048 values: 8 us with hot caches, 40 us inside a size-L step). :func:`lrnn_column_layer_step`
runs a served LRNN layer, products included, as one compiled call: the size-L step went from 9.9 to ~8 ms.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_ROWS = 4  # the kernel's rows per call; from 8 rows MKL's blocked products were faster (docs/benchmarks.md)
# Smaller weights stay F.linear: such a weight is likely in a cache between steps, where MKL reads it about as fast,
# and the kernel's call costs ~8 us of Python against F.linear's ~5 (a hot 128 x 128: 11 against 5 us; 512 x 512:
# 26 us either way; 2048 x 512: 67 against 80-95 us).
MIN_ELEMENTS = 2**18  # 1 MiB of float32

_state = threading.local()  # .off: torch_products() depth in this thread
_kernel: Callable[..., None] | None = None
_layer_step: Callable[..., None] | None = None
_unavailable: str | None = None  # why the kernel cannot be built, once known
_build_lock = threading.Lock()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: (..., in), weight: (out, in), bias: (out,) or None -> (..., out): ``F.linear(x, weight, bias)``, through
    the streaming kernel when it applies (module docstring)."""
    if not _applies(x, weight, bias):
        return F.linear(x, weight, bias)
    kernel = _kernel or _build()
    if kernel is None:
        return F.linear(x, weight, bias)
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()  # (R, in)
    out = np.empty((rows.shape[0], weight.shape[0]), dtype=np.float32)  # (R, out)
    offsets = _NO_BIAS if bias is None else bias.numpy(force=True)
    kernel(rows.numpy(force=True), weight.numpy(force=True), offsets, bias is not None, out)
    result = torch.from_numpy(out)
    return result if x.dim() == 2 else result.view(*x.shape[:-1], weight.shape[0])


def kernel_available() -> bool:
    """Whether the kernel can run here (numba importable; builds it now if not built yet)."""
    return (_kernel or _build()) is not None


def streams(rows: int = 1) -> bool:
    """Whether a product of ``rows`` rows with a contiguous CPU float32 weight would run through the kernel now (no
    gradients aside): one intra-op thread, at most :data:`MAX_ROWS` rows, not inside :func:`torch_products`, numba
    importable. Serving code lays its weights out for the kernel when this holds."""
    return rows <= MAX_ROWS and not _off() and torch.get_num_threads() == 1 and kernel_available()


@contextlib.contextmanager
def torch_products() -> Iterator[None]:
    """Within the block (this thread), :func:`linear` is ``F.linear`` everywhere: the reference path."""
    _state.off = _off() + 1
    try:
        yield
    finally:
        _state.off -= 1


def lrnn_column_layer_step(
    x: torch.Tensor, state: torch.Tensor, weights: Sequence[torch.Tensor], eps: float, p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One served LRNN layer (model/lrnn.py, ``RecurrentBlock.step`` with the column p-norm constraint and the full
    generator) as one compiled call: x + readout(A(u) state + B u) with u = LN_1(x), then + MLP(LN_2(.)), where
    A(u)'s column j is divided by max(1, ||column j||_p) (applied to the state entry it multiplies, as the torch
    step does). Every product streams its weight as :func:`linear` does, and the ~20 small ops between them (layer
    norms, the constraint, the block products, GELU, the residual adds), each a dispatch that finds its code and
    data evicted by the weights streamed before it, run in the same call. Equal to the torch step up to float
    rounding (tests/model/test_matvec.py).

    x: (R, d_model), state: (R, H, b), R <= MAX_ROWS; ``weights``: ln_1 weight and bias, the stacked (H b^2 + H b,
    d_model) generator and input matrix, g's bias, B's bias, out_proj weight and bias, ln_2 weight and bias, the
    MLP's c_fc weight and bias and c_proj weight and bias, all float32 on the CPU. Returns (R, d_model), (R, H, b).
    Call it only where :func:`streams` holds for R rows (which builds it)."""
    arrays = [tensor.numpy(force=True) for tensor in weights]
    rows = x.contiguous().numpy(force=True)
    x_out = np.empty_like(rows)
    state_out = np.empty(state.shape, dtype=np.float32)
    _layer_step(
        rows, state.contiguous().numpy(force=True), (arrays[0], arrays[1]), arrays[2], arrays[3], arrays[4],
        (arrays[5], arrays[6]), (arrays[7], arrays[8]), (arrays[9], arrays[10]), (arrays[11], arrays[12]),
        np.float32(eps), np.float32(p), x_out, state_out,
    )
    return torch.from_numpy(x_out), torch.from_numpy(state_out)


def _off() -> int:
    return getattr(_state, "off", 0)


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The module docstring's conditions, cheapest first (this runs on every product: ~1 us)."""
    return (
        x.dtype is torch.float32
        and not torch.is_grad_enabled()
        and weight.numel() >= MIN_ELEMENTS
        and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
        and x.is_cpu
        and weight.dtype is torch.float32
        and weight.is_cpu
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is torch.float32 and bias.is_cpu and bias.is_contiguous()))
        and torch.get_num_threads() == 1
        and not _off()
        and _unavailable is None
    )


def _build() -> Callable[..., None] | None:
    """Import numba and compile the kernels once per process; None (and one warning) if numba is missing."""
    global _kernel, _layer_step, _unavailable
    with _build_lock:
        if _kernel is not None or _unavailable is not None:
            return _kernel
        try:
            import numba
        except ImportError as error:  # an install without the dependency: every product stays F.linear
            _unavailable = f"numba is not importable ({error})"
            logger.warning("few-row CPU products use F.linear: %s", _unavailable)
            return None
        _kernel, _layer_step = _compile(numba)
        return _kernel


def _compile(numba) -> tuple[Callable[..., None], Callable[..., None]]:
    """The product kernel and the LRNN layer step (:func:`lrnn_column_layer_step`), compiled with numba."""
    # reassoc only: sums may run in any order (what vectorises the dot products); NaN and inf keep their meaning
    # (full fastmath would assume neither occurs).
    jit = functools.partial(numba.njit, fastmath={"reassoc"}, boundscheck=False, nogil=True)

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

    @jit
    def layer_step(x, state, ln_1, joint, g_bias, b_bias, out_proj, ln_2, c_fc, c_proj, eps, p, x_out, state_out):
        rows, width = x.shape
        heads, size = state.shape[1], state.shape[2]
        u = np.empty_like(x)
        layer_norm(x, ln_1[0], ln_1[1], eps, u)
        products = np.empty((rows, joint.shape[0]), dtype=np.float32)  # g(u) (H b^2) then B u (H b)
        product(u, joint, g_bias, False, products)
        generated = g_bias.shape[0]
        for r in range(rows):
            for k in range(generated):
                products[r, k] += g_bias[k]
            for k in range(b_bias.shape[0]):
                products[r, generated + k] += b_bias[k]
        scaled = np.empty(size, dtype=np.float32)
        inverse = np.float32(1.0) / p
        for r in range(rows):
            for h in range(heads):
                block = h * size * size  # g(u)'s (H, b, b) blocks, row-major: entry (i, j) at block + i b + j
                for j in range(size):  # the state entry of column j, divided by max(1, ||column j||_p)
                    total = np.float32(0.0)
                    for i in range(size):
                        total += abs(products[r, block + i * size + j]) ** p
                    scaled[j] = state[r, h, j] / max(np.float32(1.0), total) ** inverse
                for i in range(size):
                    total = np.float32(0.0)
                    for j in range(size):
                        total += products[r, block + i * size + j] * scaled[j]
                    state_out[r, h, i] = total + products[r, generated + h * size + i]
        flat = state_out.reshape(rows, heads * size)
        product(flat, out_proj[0], out_proj[1], True, x_out)
        for r in range(rows):
            for i in range(width):
                x_out[r, i] += x[r, i]
        layer_norm(x_out, ln_2[0], ln_2[1], eps, u)
        hidden = np.empty((rows, c_fc[0].shape[0]), dtype=np.float32)
        product(u, c_fc[0], c_fc[1], True, hidden)
        for r in range(rows):  # exact GELU, as F.gelu
            for i in range(hidden.shape[1]):
                value = hidden[r, i]
                hidden[r, i] = np.float32(0.5) * value * (np.float32(1.0) + math.erf(value * _SQRT_HALF))
        product(hidden, c_proj[0], c_proj[1], True, u)
        for r in range(rows):
            for i in range(width):
                x_out[r, i] += u[r, i]

    return kernel, layer_step


_NO_BIAS = np.zeros(0, dtype=np.float32)
_SQRT_HALF = np.float32(math.sqrt(0.5))
