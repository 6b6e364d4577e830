"""The LRNN and RegularGPT layer steps of model/ops/cpu/cpu_decode.py, compiled by :func:`build_layer_steps`."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import numpy as np

from model.ops.cpu.kernels.helpers import bit_casts, reassociating_jit
from model.ops.cpu.kernels.layer_ops import LayerOps


class LayerSteps(NamedTuple):
    """The layer steps, each compiled on its first call."""

    lrnn: Callable[..., None]  # layer_step(x, state, ln_1, joint, g_bias, b_bias, out_proj, ln_2, c_fc, ...)
    regulargpt: Callable[..., None]  # regulargpt_layer(x, windows, positions, dilation, ring, slots, packed, ...)


def build_layer_steps(numba: ModuleType, ops: LayerOps, sparsemax_block: Callable[..., None]) -> LayerSteps:
    """The LRNN layer step (``sparsemax_block`` for stochastic transitions) and the RegularGPT thick layer step, on
    ``ops``' products."""
    from numba.extending import overload

    jit = reassociating_jit(numba)
    matmul, layer_norm, residual_tail = ops.matmul, ops.layer_norm, ops.residual_tail
    float_bits, bits_float = bit_casts(numba)

    @jit(inline="always")
    def power(value: np.float32, p: np.float64) -> np.float32:  # within 1 ulp: no call, so a loop vectorises
        """float32 |value| ** p (p float64), within 6e-8 of the float64 power over 1e-30 .. 1e30: series from the bits,
        no call, so loops over it vectorise. Subnormals give 0 (right for p >= 1); inf and NaN stay."""
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
        e = 1.0 + t * (
            1.0
            + t
            * (
                0.5
                + t
                * (1.0 / 6 + t * (1.0 / 24 + t * (1.0 / 120 + t * (1.0 / 720 + t * (1.0 / 5040 + t * (1.0 / 40320))))))
            )
        )
        whole = np.int32(min(max(n, -160.0), 129.0))  # from 2 ** 129 x e >= 2 ** 128.5 the product is inf
        half = whole >> 1  # 2 ** whole as 2 ** half times 2 ** (whole - half), both in float32's normal range
        result = (
            np.float32(e) * bits_float(np.int32((half + 127) << 23)) * bits_float(np.int32((whole - half + 127) << 23))
        )
        normal = np.float32(magnitude >= np.float32(1.17549435e-38))
        return result * normal if bits < 0x7F800000 else magnitude  # inf and NaN: themselves (inf ** p is inf)

    @jit
    def layer_step(
        x: np.ndarray,
        state: np.ndarray,
        ln_1: tuple[np.ndarray, np.ndarray],
        joint: np.ndarray,
        g_bias: np.ndarray,
        b_bias: np.ndarray,
        out_proj: tuple[np.ndarray, np.ndarray],
        ln_2: tuple[np.ndarray, np.ndarray],
        c_fc: tuple[np.ndarray, np.ndarray],
        c_proj: tuple[np.ndarray, np.ndarray],
        eps: np.float32,
        p: np.float64,
        stochastic: bool,
        x_out: np.ndarray,
        state_out: np.ndarray,
    ) -> None:
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
                        norms[h * size + j] = np.float32(1.0) if total < np.float32(1.0) else total
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
    def matrix(packed: np.ndarray, start: np.ndarray, i: int, columns: int) -> np.ndarray:
        # tensor i of a block in the pack, as (rows, columns)
        return packed[start[i] : start[i + 1]].reshape(((start[i + 1] - start[i]) // columns, columns))

    def weight_of(  # typed by the overload below, in compiled code only
        packed: np.ndarray, start: np.ndarray, i: int, columns: int, panels: tuple[np.ndarray, ...], slot: int
    ) -> np.ndarray:
        raise NotImplementedError

    @overload(weight_of)
    # unannotated: numba compares this signature, annotations included, with the returned lambdas'
    def weight_by_kind(packed, start, i, columns, panels, slot):  # type: ignore[no-untyped-def]
        """A block's matrix i: panels[slot] where the step got panels, else the matrix in the pack."""
        if isinstance(panels, numba.types.UniTuple):
            return lambda packed, start, i, columns, panels, slot: panels[slot]
        return lambda packed, start, i, columns, panels, slot: matrix(packed, start, i, columns)

    @jit(inline="always")
    def block_step(
        x: np.ndarray,
        window: np.ndarray,
        positions: np.ndarray,
        dilation: int,
        where: np.ndarray,
        slots: int,
        packed: np.ndarray,
        start: np.ndarray,
        panels: tuple[np.ndarray, ...],
        block: int,
        has_null: bool,
        heads: int,
        eps: np.float32,
        x_out: np.ndarray,
    ) -> None:
        """One block over x (R, d) -> x_out: its tensors at ``start`` in ``packed``, its matrices' panels from
        panels[4*block:]; where[r, j]: the ring slot of position positions[r] - j * dilation."""
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
    def regulargpt_layer(
        x: np.ndarray,
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
        eps: np.float32,
        x_out: np.ndarray,
    ) -> None:
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
            block_step(
                current,
                windows[k],
                positions,
                dilation,
                where,
                slots,
                packed,
                starts[k],
                panels,
                k,
                has_null,
                heads,
                eps,
                out,
            )
            current = out

    return LayerSteps(layer_step, regulargpt_layer)
