"""The row-invariant panel product and its greedy picks, compiled by :func:`build_panels`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from model.ops.cpu.kernels.helpers import PANEL, tile_best, tile_product


class Panels(NamedTuple):
    """The compiled panel kernels and their tile height."""

    product: Callable[..., None]  # panel_product(x, panels, bias, has_bias, out)
    argmax: Callable[..., None]  # panel_argmax(x, panels, bias, has_bias, n, index, value)
    tile_rows: int  # rows of x per tile


def build_panels(numba: ModuleType, tile_rows: int) -> Panels:
    """Compiled now: ``panel_product(x, panels, bias, has_bias, out)``: x (R, in) times panels (P, in, PANEL), plus bias
    where ``has_bias``, into out (R, n), n <= P PANEL; ``panel_argmax(x, panels, bias, has_bias, n, index (R,) int64,
    value (R,) float32)``: each row's first largest of its n outputs (a NaN first), compared in registers.

    Each output's sum runs over i in order, one fused multiply-add a step, then adds the bias: the same operations
    whatever the other rows, so a row's result is the same bits in any batch."""
    jit: Callable[..., Callable[..., Any]] = functools.partial(numba.njit, boundscheck=False, nogil=True)
    one, two, three, four = (tile_product(numba, height) for height in (1, 2, 3, 4))

    @jit(inline="always")
    def tile_of(
        x: np.ndarray, panels: np.ndarray, p: int, r: int, height: int, out: np.ndarray, row: int, column: int
    ) -> None:
        # the tile's sums at its height (its rows alone)
        if height == 4:
            four(x, panels, p, r, out, row, column)
        elif height == 3:
            three(x, panels, p, r, out, row, column)
        elif height == 2:
            two(x, panels, p, r, out, row, column)
        else:
            one(x, panels, p, r, out, row, column)

    def panel_product(x: np.ndarray, panels: np.ndarray, bias: np.ndarray, has_bias: bool, out: np.ndarray) -> None:
        rows, n = x.shape[0], out.shape[1]
        tile = np.empty((tile_rows, PANEL), dtype=np.float32)
        for p in range(panels.shape[0]):
            base = p * PANEL
            count = min(PANEL, n - base)  # out may end inside the last panel (a layer step's exact width)
            biased = min(count, bias.shape[0] - base) if has_bias else 0
            for r in range(0, rows, tile_rows):
                height = min(tile_rows, rows - r)  # the last tile's rows alone: none computed twice
                if count == PANEL and not biased:  # straight into out: no scratch tile, no scalar copy
                    tile_of(x, panels, p, r, height, out, r, base)
                    continue
                tile_of(x, panels, p, r, height, tile, 0, 0)
                for k in range(height):
                    for j in range(count):
                        out[r + k, base + j] = tile[k, j]
                    for j in range(biased):
                        out[r + k, base + j] += bias[base + j]

    best_one, best_two, best_three, best_four = (tile_best(numba, height) for height in (1, 2, 3, 4))

    def panel_argmax(
        x: np.ndarray,
        panels: np.ndarray,
        bias: np.ndarray,
        has_bias: bool,
        n: int,
        index: np.ndarray,
        value: np.ndarray,
    ) -> None:
        rows = x.shape[0]
        tile = np.empty((tile_rows, PANEL), dtype=np.float32)
        padded = np.zeros(panels.shape[0] * PANEL, dtype=np.float32)  # what tile_best reads, bias or not
        if has_bias:
            padded[: bias.shape[0]] = bias
        best = np.full((rows, PANEL), -np.inf, dtype=np.float32)  # per row and lane: the largest so far (NaN: the
        where = np.zeros((rows, PANEL), dtype=np.int32)  # first NaN), and its output
        for p in range(panels.shape[0]):
            base = p * PANEL
            count = min(PANEL, n - base)
            for r in range(0, rows, tile_rows):
                height = min(tile_rows, rows - r)
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
    return Panels(
        jit(signature.format("float32[:, ::1]"))(panel_product),
        jit(signature.format("int64, int64[::1], float32[::1]"))(panel_argmax),
        tile_rows,
    )
