"""The dot-product kernel of ``cpu_decode.linear`` and the inline pieces both layer steps build on, compiled
by :func:`build_layer_ops`."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import numpy as np

from model.ops.cpu.kernels.helpers import reassociating_jit

_SQRT_HALF = np.float32(math.sqrt(0.5))


class LayerOps(NamedTuple):
    """The dot-product kernel, compiled; the rest are inline functions, callable only from compiled code."""

    dots: Callable[..., None]  # kernel(x, weight, bias, has_bias, out): (R, in), (out, in), (out,) or (0,), (R, out)
    matmul: Callable[..., None]  # (x, weight, bias, has_bias, out): by the weight's dimensions, panels or dot products
    layer_norm: Callable[..., None]  # (x, weight, bias, eps, out): as F.layer_norm
    residual_tail: Callable[..., None]  # (x, mixed, mixer, ln_2, c_fc, c_proj, eps, out): a pre-norm block's tail


def build_layer_ops(numba: ModuleType, panel_product: Callable[..., None]) -> LayerOps:
    """The dot-product kernel (compiled now) and the inline pieces. ``matmul`` multiplies by a weight (out, in) with
    reassociated dot products, or by panels (P, in, PANEL) with ``panel_product``, compiled apart so that its sums keep
    their order."""
    from numba.extending import overload

    jit = reassociating_jit(numba)

    @jit(inline="always")
    def product(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, has_bias: bool, out: np.ndarray) -> None:
        # (R, in), (out, in), (out,) or (0,), (R, out)
        rows, width = x.shape
        for o in range(weight.shape[0]):  # each weight row is read from memory once, for every x row
            for r in range(rows):
                total = np.float32(0.0)
                for i in range(width):
                    total += weight[o, i] * x[r, i]
                out[r, o] = total + bias[o] if has_bias else total

    @jit("void(float32[:, ::1], float32[:, ::1], float32[::1], boolean, float32[:, ::1])")
    def kernel(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, has_bias: bool, out: np.ndarray) -> None:
        product(x, weight, bias, has_bias, out)

    def matmul(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, has_bias: bool, out: np.ndarray) -> None:
        # typed by the overload below, in compiled code only
        raise NotImplementedError

    @overload(matmul)
    # unannotated: numba compares this signature, annotations included, with the returned lambdas'
    def matmul_by_layout(x, weight, bias, has_bias, out):  # type: ignore[no-untyped-def]
        if weight.ndim == 3:  # panels: the row-invariant product
            return lambda x, weight, bias, has_bias, out: panel_product(x, weight, bias, has_bias, out)
        return lambda x, weight, bias, has_bias, out: product(x, weight, bias, has_bias, out)

    @jit(inline="always")
    def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float, out: np.ndarray) -> None:
        # (R, d) -> (R, d), as F.layer_norm (biased variance)
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

    @jit(inline="always")
    def erf(value: np.float32) -> np.float32:  # within 4.5e-7 of erf: no call, so a loop over it vectorises
        """Eigen's and XLA's float32 erf: x P(x^2) / Q(x^2) on x clamped to [-4, 4]."""
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
    def gelu(values: np.ndarray) -> None:  # (R, n) in place: exact GELU, as F.gelu (erf above)
        for r in range(values.shape[0]):
            for i in range(values.shape[1]):
                value = values[r, i]
                values[r, i] = np.float32(0.5) * value * (np.float32(1.0) + erf(value * _SQRT_HALF))

    @jit(inline="always")
    def residual_tail(
        x: np.ndarray,
        mixed: np.ndarray,
        mixer: tuple[np.ndarray, np.ndarray],
        ln_2: tuple[np.ndarray, np.ndarray],
        c_fc: tuple[np.ndarray, np.ndarray],
        c_proj: tuple[np.ndarray, np.ndarray],
        eps: float,
        out: np.ndarray,
    ) -> None:
        """out = y + MLP(LN_2(y)), y = x + mixer(mixed): a pre-norm block's tail, (R, d_model)."""
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

    return LayerOps(kernel, matmul, layer_norm, residual_tail)
