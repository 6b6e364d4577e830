"""Numba pieces the kernel families share: the panel width, jit options, LLVM intrinsics as vector code. Factories take
the imported ``numba`` and import its parts only when called."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

PANEL = 32  # outputs per panel of the row-invariant product (tile_product: two vectors of 16 lanes per row)


def reassociating_jit(numba: ModuleType) -> Callable[..., Callable[..., Any]]:
    """``numba.njit`` for every kernel but the panel product: sums may be reassociated, NaN and inf keep their meaning,
    no bounds checks, no GIL, numpy's error model."""
    # reassoc only: sums may run in any order (what vectorises the dot products); NaN and inf keep their meaning
    # (full fastmath would assume neither occurs). numpy's error model: a division by zero gives inf or NaN, as
    # torch's, where Python's would raise; and a loop with a division in it vectorises (no check per value).
    return functools.partial(numba.njit, fastmath={"reassoc"}, boundscheck=False, nogil=True, error_model="numpy")


def tile_rows(numba: ModuleType) -> int:
    """Rows per tile of the panel product: 4 where numba targets this host and it has AVX-512 (32 vector registers),
    else 2."""
    import llvmlite.binding

    if numba.config.CPU_NAME is not None:  # compiled for another target (NUMBA_CPU_NAME, e.g. a portable cache)
        return 2
    return 4 if llvmlite.binding.get_host_cpu_features().get("avx512f", False) else 2


def tile_product(numba: ModuleType, height: int) -> Callable[..., None]:
    """Numba intrinsic ``tile_product(x, panels, p, r, out, row, column)``: out[row + k, column : column + PANEL] =
    :func:`tile_sums` of row r + k of x (R, in) with panel p of panels (P, in, PANEL), for k < ``height``; all
    C-contiguous float32."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile_product(
        typingctx: Any, x: Any, panels: Any, p: Any, r: Any, out: Any, row: Any, column: Any
    ) -> tuple[Any, Callable[..., Any]]:
        signature = types.void(x, panels, types.intp, types.intp, out, types.intp, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            sums = tile_sums(context, builder, signature, args, height)
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


def tile_best(numba: ModuleType, height: int) -> Callable[..., None]:
    """Numba intrinsic ``tile_best(x, panels, p, r, bias, has_bias, best, where)``: :func:`tile_product`'s sums for the
    whole panel p, plus bias[p PANEL + j] where ``has_bias`` (bias: P PANEL entries), each taken into best[row, j]
    (float32) and its output into where[row, j] (int32), both (R, PANEL), where larger or the first NaN. No logit is
    written."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile_best(
        typingctx: Any, x: Any, panels: Any, p: Any, r: Any, bias: Any, has_bias: Any, best: Any, where: Any
    ) -> tuple[Any, Callable[..., Any]]:
        signature = types.void(x, panels, types.intp, types.intp, bias, types.boolean, best, where)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            sums = tile_sums(context, builder, signature, args, height)
            bias_array, best_array, where_array = (
                context.make_array(signature.args[at])(context, builder, args[at]) for at in (4, 6, 7)
            )
            index = context.get_value_type(types.intp)
            lanes = sums[0][0].type.count
            vector, int32 = sums[0][0].type, ir.IntType(32)
            base = builder.mul(args[2], ir.Constant(index, PANEL))
            offsets = ir.Constant(ir.VectorType(int32, lanes), list(range(lanes)))
            spread = builder.insert_element(
                ir.Constant(ir.VectorType(int32, lanes), ir.Undefined),
                builder.trunc(base, int32),
                ir.Constant(int32, 0),
            )
            spread = builder.shuffle_vector(spread, spread, ir.Constant(ir.VectorType(int32, lanes), [0] * lanes))
            for half in (0, 1):
                outputs = builder.add(
                    spread, builder.add(offsets, ir.Constant(ir.VectorType(int32, lanes), [lanes * half] * lanes))
                )
                offset = builder.add(base, ir.Constant(index, lanes * half))
                bias_vector = builder.load(
                    builder.bitcast(builder.gep(bias_array.data, [offset]), vector.as_pointer()), align=4
                )
                values = [
                    builder.select(args[5], builder.fadd(total[half], bias_vector), total[half]) for total in sums
                ]
                for k, value in enumerate(values):
                    at = builder.add(
                        builder.mul(builder.add(args[3], ir.Constant(index, k)), ir.Constant(index, PANEL)),
                        ir.Constant(index, lanes * half),
                    )
                    best_pointer = builder.bitcast(builder.gep(best_array.data, [at]), vector.as_pointer())
                    where_pointer = builder.bitcast(
                        builder.gep(where_array.data, [at]), ir.VectorType(int32, lanes).as_pointer()
                    )
                    held, held_at = builder.load(best_pointer, align=4), builder.load(where_pointer, align=4)
                    larger = builder.fcmp_ordered(">", value, held)
                    first_nan = builder.and_(
                        builder.fcmp_unordered("uno", value, value), builder.fcmp_ordered("ord", held, held)
                    )
                    take = builder.or_(larger, first_nan)
                    builder.store(builder.select(take, value, held), best_pointer, align=4)
                    builder.store(builder.select(take, outputs, held_at), where_pointer, align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile_best


def tile_sums(context: Any, builder: Any, signature: Any, args: Any, height: int) -> list[list[Any]]:
    """The tile intrinsics' shared LLVM code: for rows args[3] + k < ``height`` of x (args[0]), two 16-lane accumulators
    over panel args[2] of args[1], one ``llvm.fma`` per i, in order: a row's bits do not depend on the height. Returns
    per row its two vectors."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils

    lanes = PANEL // 2
    x_array, panel_array = (context.make_array(signature.args[at])(context, builder, args[at]) for at in (0, 1))
    index = context.get_value_type(types.intp)
    vector = ir.VectorType(ir.FloatType(), lanes)
    width = builder.extract_value(x_array.shape, 1)
    starts = [
        builder.gep(x_array.data, [builder.mul(builder.add(args[3], ir.Constant(index, k)), width)])
        for k in range(height)
    ]  # each tile row's first element in x
    panel = builder.gep(panel_array.data, [builder.mul(args[2], builder.mul(width, ir.Constant(index, PANEL)))])
    sums = [cgutils.alloca_once_value(builder, ir.Constant(vector, None)) for _ in range(2 * height)]
    undefined, first = ir.Constant(vector, ir.Undefined), ir.Constant(ir.IntType(32), 0)
    broadcast = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)  # lane 0 into every lane
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3), f"llvm.fma.v{lanes}f32")
    with cgutils.for_range(builder, width) as loop:
        weights_row = builder.gep(panel, [builder.mul(loop.index, ir.Constant(index, PANEL))])
        halves = [
            builder.load(
                builder.bitcast(builder.gep(weights_row, [ir.Constant(index, lanes * half)]), vector.as_pointer()),
                align=4,
            )
            for half in (0, 1)
        ]
        for k in range(height):
            value = builder.load(builder.gep(starts[k], [loop.index]))
            lane = builder.insert_element(undefined, value, first)
            spread = builder.shuffle_vector(lane, undefined, broadcast)
            for half in (0, 1):
                total = sums[2 * k + half]
                builder.store(builder.call(fma, [spread, halves[half], builder.load(total)]), total)
    return [[builder.load(sums[2 * k + half]) for half in (0, 1)] for k in range(height)]


def block_sparsemax(numba: ModuleType, size: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """Two numba intrinsics on the row-major ``size`` x ``size`` block at flat[start:] (C-contiguous float32), in place,
    columns in vector lanes: ``block_sparsemax(flat, start)``, each column's sparsemax;
    ``block_sparsemax_backward(output, grad, start)``, its backward into grad. The same operations in the same order as
    sparsemax.py's loops: the same bits (but a zero's sign in the backward)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def block_sparsemax(typingctx: Any, flat: Any, start: Any) -> tuple[Any, Callable[..., Any]]:
        signature = types.void(flat, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array = context.make_array(signature.args[0])(context, builder, args[0])
            index = context.get_value_type(types.intp)
            vector = ir.VectorType(ir.FloatType(), size)
            base = builder.gep(array.data, [args[1]])
            pointers = [
                builder.bitcast(builder.gep(base, [ir.Constant(index, m * size)]), vector.as_pointer())
                for m in range(size)
            ]
            rows = [builder.load(pointer, align=4) for pointer in pointers]  # row m: entry m of every column
            zero, one = ir.Constant(vector, [0.0] * size), ir.Constant(vector, [1.0] * size)
            support = total = zero
            for i in range(size):
                count = partial = zero
                for m in range(size):
                    taken = builder.uitofp(builder.fcmp_ordered(">=", rows[m], rows[i]), vector)
                    count = builder.fadd(count, taken)
                    partial = builder.fadd(partial, builder.fmul(taken, rows[m]))
                inside = builder.uitofp(
                    builder.fcmp_ordered(">", builder.fmul(count, rows[i]), builder.fsub(partial, one)), vector
                )
                support = builder.fadd(support, inside)
                total = builder.fadd(total, builder.fmul(inside, rows[i]))
            found = builder.fdiv(builder.fsub(total, one), support)
            tau = builder.select(
                builder.fcmp_ordered(">", support, zero), found, ir.Constant(vector, [float("nan")] * size)
            )
            for i in range(size):  # max(v - tau, 0) as Python's max: NaN stays NaN
                difference = builder.fsub(rows[i], tau)
                builder.store(
                    builder.select(builder.fcmp_ordered(">", zero, difference), zero, difference), pointers[i], align=4
                )
            return context.get_dummy_value()

        return signature, codegen

    @intrinsic
    def block_sparsemax_backward(typingctx: Any, output: Any, grad: Any, start: Any) -> tuple[Any, Callable[..., Any]]:
        signature = types.void(output, grad, types.intp)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            index = context.get_value_type(types.intp)
            vector = ir.VectorType(ir.FloatType(), size)
            bases = [
                builder.gep(context.make_array(signature.args[at])(context, builder, args[at]).data, [args[2]])
                for at in (0, 1)
            ]
            outputs, grads = (
                [
                    builder.bitcast(builder.gep(base, [ir.Constant(index, m * size)]), vector.as_pointer())
                    for m in range(size)
                ]
                for base in bases
            )
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


def bit_casts(numba: ModuleType) -> tuple[Callable[..., int], Callable[..., float]]:
    """Two numba intrinsics: a float32's bits as an int32, and back (LLVM bitcasts: a loop over them still
    vectorises)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def float_bits(typingctx: Any, value: Any) -> tuple[Any, Callable[..., Any]]:
        return types.int32(types.float32), lambda context, builder, signature, args: builder.bitcast(
            args[0], ir.IntType(32)
        )

    @intrinsic
    def bits_float(typingctx: Any, value: Any) -> tuple[Any, Callable[..., Any]]:
        return types.float32(types.int32), lambda context, builder, signature, args: builder.bitcast(
            args[0], ir.FloatType()
        )

    return float_bits, bits_float
