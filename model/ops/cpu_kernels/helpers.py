"""Numba pieces the CPU decode kernels' families share (model/ops/cpu_kernels/): the width of a panel, the jit options
of every kernel that may reassociate its sums, and the LLVM intrinsics written out as vector code (a tile of the
panel product, its greedy picks, the column sparsemax of a block and its backward, float32 bit casts). Each factory
takes the imported ``numba`` module and imports numba's and llvmlite's parts only when called."""

from __future__ import annotations

import functools
from collections.abc import Callable

PANEL = 32  # outputs per panel of the row-invariant product (tile_product: two vectors of 16 lanes per row)


def reassociating_jit(numba) -> Callable[..., Callable]:
    """``numba.njit`` with the options of every kernel but the panel product's (which keeps its sums in order): the
    sums may be reassociated, NaN and inf keep their meaning, no bounds checks, no GIL, numpy's error model."""
    # reassoc only: sums may run in any order (what vectorises the dot products); NaN and inf keep their meaning
    # (full fastmath would assume neither occurs). numpy's error model: a division by zero gives inf or NaN, as
    # torch's, where Python's would raise; and a loop with a division in it vectorises (no check per value).
    return functools.partial(numba.njit, fastmath={"reassoc"}, boundscheck=False, nogil=True, error_model="numpy")


def tile_rows(numba) -> int:
    """Rows per tile of the panel product: 4 where numba compiles for this machine and it has AVX-512 (32 vector
    registers: four rows' eight 16-lane accumulators, the two weight vectors and a broadcast), else 2 (with 16
    registers of 8 lanes, two rows' accumulators are eight of them)."""
    import llvmlite.binding

    if numba.config.CPU_NAME is not None:  # compiled for another target (NUMBA_CPU_NAME, e.g. a portable cache)
        return 2
    return 4 if llvmlite.binding.get_host_cpu_features().get("avx512f", False) else 2


def tile_product(numba, height: int) -> Callable[..., None]:
    """A numba intrinsic, ``tile_product(x, panels, p, r, out, row, column)``: out[row + k, column : column + PANEL] =
    sum over i of x[r + k, i] * panels[p, i, :] for k < ``height`` (:func:`tile_sums`): into a scratch tile (row and
    column 0), or straight into the product's output where a whole panel fits there. x (R, in), panels (P, in,
    PANEL) and out (>= row + height, >= column + PANEL) are C-contiguous float32."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile_product(typingctx, x, panels, p, r, out, row, column):
        signature = types.void(x, panels, types.intp, types.intp, out, types.intp, types.intp)

        def codegen(context, builder, signature, args):
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


def tile_best(numba, height: int) -> Callable[..., None]:
    """A numba intrinsic, ``tile_best(x, panels, p, r, bias, has_bias, best, where)``: the sums of
    :func:`tile_product` for rows r .. r + ``height`` - 1 and a whole panel p, plus bias[p PANEL + j] where
    ``has_bias`` (as :func:`model.ops.cpu_decode.linear` adds it; bias has P PANEL entries, read either way), each
    compared in its lane with best[row, j] (float32) and where[row, j] (int32, the output it came from), all (R,
    PANEL): it takes the lane where it is larger, or NaN where the lane holds none (numpy's argmax: the first NaN
    wins, then the first of the largest; a lane sees its outputs in order). Vector compares and selects on the
    registers the sums are in: no logit is written to memory."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def tile_best(typingctx, x, panels, p, r, bias, has_bias, best, where):
        signature = types.void(x, panels, types.intp, types.intp, bias, types.boolean, best, where)

        def codegen(context, builder, signature, args):
            sums = tile_sums(context, builder, signature, args, height)
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


def tile_sums(context, builder, signature, args, height: int) -> list[list]:
    """The sums of a tile, as LLVM vector code (the codegen :func:`tile_product` and :func:`tile_best` share):
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


def block_sparsemax(numba, size: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """Two numba intrinsics. ``block_sparsemax(flat, start)``: the sparsemax of every column of the row-major
    ``size`` x ``size`` block at flat[start:] (a C-contiguous float32 array), in place, as LLVM vector code: the
    block's rows held in ``size``-lane registers, the columns side by side in the lanes. The same operations in the
    same order as ``sparsemax_block``'s loop (:func:`model.ops.cpu_kernels.sparsemax.build_sparsemax`), so the same
    bits, NaN columns included: entry i is in the support where 1 + k_i v_i > s_i, k_i and s_i the count and sum of
    the column's entries >= v_i, and tau = (s - 1) / k over the support's k entries. The loop runs its columns
    through scratch memory at ~6 ns an entry on one AVX-512 core; this 1.4 ns at size 16 and 0.7 ns at size 8
    (docs/benchmarks.md).
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


def bit_casts(numba) -> tuple[Callable[[float], int], Callable[[int], float]]:
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
