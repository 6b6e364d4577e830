"""Few-row products on the CPU (a decode step's x W^T + b), reading the weight at the memory's streaming rate.

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
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

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
    """Import numba and compile the kernel once per process; None (and one warning) if numba is missing."""
    global _kernel, _unavailable
    with _build_lock:
        if _kernel is not None or _unavailable is not None:
            return _kernel
        try:
            import numba
        except ImportError as error:  # an install without the dependency: every product stays F.linear
            _unavailable = f"numba is not importable ({error})"
            logger.warning("few-row CPU products use F.linear: %s", _unavailable)
            return None

        # reassoc only: the dot products may be summed in any order (what vectorises them); NaN and inf keep their
        # meaning (full fastmath would assume neither occurs).
        @numba.njit(
            "void(float32[:, ::1], float32[:, ::1], float32[::1], boolean, float32[:, ::1])",
            fastmath={"reassoc"},
            boundscheck=False,
            nogil=True,
        )
        def kernel(x, weight, bias, has_bias, out):  # (R, in), (out, in), (out,) or (0,), (R, out)
            rows, width = x.shape
            for o in range(weight.shape[0]):  # each weight row is read from memory once, for every x row
                for r in range(rows):
                    total = np.float32(0.0)
                    for i in range(width):
                        total += weight[o, i] * x[r, i]
                    out[r, o] = total + bias[o] if has_bias else total

        _kernel = kernel
        return _kernel


_NO_BIAS = np.zeros(0, dtype=np.float32)
