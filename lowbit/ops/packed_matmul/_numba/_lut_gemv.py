"""The float-activation forward of few rows with ternary and sign weights (``_lut.py``'s
products, one activation row at a time): ``out[n] = sum_j T_j(n) * scale * col_scale[n]``, each
group's entry ``T_j`` the signed sum of its four codes' activations added in order, the groups
added in order of ``j``, as ``_lut.gemm`` adds them: the same bits.

- On a CPU with AVX2 or AVX-512F (``LANES`` 8 or 16 weight rows a vector), ``_tile``: table
  lookups in registers (``vpermps``, which reads only the low 3 or 4 bits of each index), so the
  packed word of a weight row shifted right to a code's field indexes its table directly. A
  group's first codes share one table of their joint values (``_first_codes``: 2 ternary or 4
  sign codes with 16 lanes, 1 or 3 with 8), built in ``_lut._table``'s order; each later code
  has a table of its values ``[-x_i, 0, x_i, x_i + x_i]`` (ternary fields 0-3, a field of 3
  read as code 2 as the reference reads it) or ``[-x_i, x_i]`` (sign), added in order; every
  table repeats over the lanes. ``ROW_VECTORS`` vectors of rows run at a time. Their words come
  ``LANES`` at a time as ``LANES`` rows' loads transposed in registers (gathering each word took
  half the time: K = N = 4096 ternary 0.8 against 0.36-0.42 ms), the rest of a row's words by
  gathers, its last bytes from the word that ends it.
- Elsewhere (ARM, x86 without AVX2), and for rows of fewer than four bytes: ``_scalar_rows``,
  scalar tables indexed by the packed bits themselves (256 entries a ternary byte, 16 a sign
  nibble), one scalar add a group, four weight rows side by side.

Measured on a 2-core AMD EPYC Zen 4, one row, K = N = 4096 (in one process, best of 60): ternary
0.36-0.42 ms, sign 0.14-0.18 ms (the scalar tables 2.4 and 3.6-4.3 ms; NumPy's float32 ``x @ W``
1.5-2.3 ms on OpenBLAS's SkylakeX kernels); compiled for Haswell (8 lanes) 0.51 and 0.34 ms
against NumPy's 2.3 ms on OpenBLAS's Haswell kernels.

Siblings: ``_lut.py`` (``gemm``, the tables for 16 rows of activations), ``__init__.py``
(``_lut_product``, which calls ``gemv`` below ``LUT_GEMM_ROWS`` rows), ``_llvm.py``. Tests
``tests/test_packed_matmul_float.py`` (against ``_lut_oracle`` bit for bit, and the Haswell
digest in ``tests/test_packed_matmul_targets.py``).
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import counted_loop, host_features, is_array, ptr

_FEATURES = host_features()
#: Weight rows a vector of the SIMD kernel: 16 with AVX-512F, 8 with AVX2, 0 (scalar) else.
LANES = 16 if "+avx512f" in _FEATURES else 8 if "+avx2" in _FEATURES else 0
#: Vectors of weight rows ``_tile`` sums at once (their words, entries and sums in registers).
ROW_VECTORS = 4

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)


def _gather(builder, base, index, mask):
    """The 32-bit words at byte offsets ``index`` from ``base`` where ``mask``, else 0."""
    lanes = index.type.count
    vec = ir.VectorType(_I32, lanes)
    zero = ir.Constant(vec, [0] * lanes)
    if lanes == 16:
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vec, [vec, _I8P, vec, mask.type, _I32]),
            "llvm.x86.avx512.mask.gather.dpi.512")
        return builder.call(fn, [zero, base, index, mask, ir.Constant(_I32, 1)])
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vec, [vec, _I8P, vec, vec, ir.IntType(8)]),
        "llvm.x86.avx2.gather.d.d.256")
    return builder.call(fn, [zero, base, index, builder.sext(mask, vec),
                             ir.Constant(ir.IntType(8), 1)])


def _permute(builder, table, index):
    """``table[index & (lanes - 1)]`` lane by lane (``vpermps``)."""
    lanes = index.type.count
    fvec = ir.VectorType(ir.FloatType(), lanes)
    name = "llvm.x86.avx512.permvar.sf.512" if lanes == 16 else "llvm.x86.avx2.permps"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fvec, [fvec, index.type]),
                                        name)
    return builder.call(fn, [table, index])


def _transpose(builder, rows):
    """The columns of a square of vectors (``rows[l][d]`` -> ``out[d][l]``): for each bit k of
    the index, rows that differ in bit k swap the halves of their elements that do, one
    two-source shuffle a vector."""
    n = len(rows)
    k = 1
    while k < n:
        out = list(rows)
        for i in range(n):
            if i & k:
                continue
            for b, target in ((0, i), (1, i | k)):
                mask = [(n if c & k else 0) + ((c & ~k) | (b * k)) for c in range(n)]
                out[target] = builder.shuffle_vector(rows[i], rows[i | k],
                                                     ir.Constant(ir.VectorType(_I32, n), mask))
        rows = out
        k *= 2
    return rows


def _first_codes(bits, lanes):
    """Codes of a group whose joint values one table of ``lanes`` entries holds (the first
    ones; each later code has its own table): 2 ternary or 4 sign with 16 lanes, 1 ternary or 3
    sign with 8."""
    return (lanes.bit_length() - 1) // bits


def _make_tile(bits, lanes):
    """Intrinsic ``tile(data, n0, tables, acc)``: ``acc[:ROW_VECTORS * lanes]`` = the sums of
    weight rows ``n0 ..`` of ``data`` (C-contiguous uint8 [N, nbytes], nbytes >= 4; rows past N
    read nothing and sum 0) against ``tables`` (C-contiguous float32 [nbytes * 8 // bits,
    lanes]: code i's table in row i)."""
    groups_per_byte = 2 // bits
    first = _first_codes(bits, lanes)
    parts = 5 - first
    fvec = ir.VectorType(ir.FloatType(), lanes)
    ivec = ir.VectorType(_I32, lanes)

    @intrinsic
    def tile(typingctx, data, n0, tables, acc):
        if not (is_array(data, 2, (types.uint8,)) and is_array(tables, 2, (types.float32,))
                and is_array(acc, 1, (types.float32,))):
            return None
        sig = types.void(data, types.intp, tables, acc)

        def codegen(context, builder, signature, args):
            arr_d = context.make_array(signature.args[0])(context, builder, args[0])
            arr_t = context.make_array(signature.args[2])(context, builder, args[2])
            arr_a = context.make_array(signature.args[3])(context, builder, args[3])
            intp = context.get_value_type(types.intp)

            def const(value):
                return ir.Constant(intp, value)

            N, nbytes = cgutils.unpack_tuple(builder, arr_d.shape, 2)
            n0 = args[1]
            stride = builder.trunc(nbytes, _I32)
            lane = ir.Constant(ivec, list(range(lanes)))
            splat = builder.shuffle_vector(
                builder.insert_element(ir.Constant(ivec, None), stride, ir.Constant(_I32, 0)),
                ir.Constant(ivec, None), ir.Constant(ivec, [0] * lanes))
            index = builder.mul(lane, splat)
            left = builder.trunc(builder.sub(N, n0), _I32)  # rows of the tile that exist
            bases, masks = [], []
            for r in range(ROW_VECTORS):
                start = builder.mul(builder.add(n0, const(r * lanes)), nbytes)
                bases.append(builder.gep(builder.bitcast(arr_d.data, _I8P), [start]))
                limit = builder.sub(left, ir.Constant(_I32, r * lanes))
                bound = builder.shuffle_vector(
                    builder.insert_element(ir.Constant(ivec, None), limit, ir.Constant(_I32, 0)),
                    ir.Constant(ivec, None), ir.Constant(ivec, [0] * lanes))
                masks.append(builder.icmp_signed("<", lane, bound))

            def table(row):
                return builder.load(ptr(builder, arr_t.data,
                                        builder.mul(row, const(4 * lanes)), fvec), align=4)

            def group_step(words, shift0, group, sums):
                """Group ``group``'s codes, at bit ``shift0`` of ``words``: its first part's
                entry, each later code's value added in order; then the entries to ``sums``."""
                row = builder.mul(group, const(parts))
                entries = [_permute(builder, table(row), w if shift0 is None else
                                    builder.lshr(w, shift0)) for w in words]
                for i in range(first, 4):
                    t = table(builder.add(row, const(1 + i - first)))
                    shift = ir.Constant(ivec, [bits * i] * lanes)
                    if shift0 is not None:
                        shift = builder.add(shift0, shift)
                    entries = [builder.fadd(e, _permute(builder, t, builder.lshr(w, shift)))
                               for e, w in zip(entries, words)]
                return [builder.fadd(s, e) for s, e in zip(sums, entries)]

            def gather(offset):
                return [_gather(builder, builder.gep(bases[r], [offset]), index, masks[r])
                        for r in range(ROW_VECTORS)]

            zero = ir.Constant(fvec, [0.0] * lanes)
            last_row = builder.sub(N, const(1))
            # The transposed words of a block: stored, then read one a step (all of them in
            # registers at once spilled).
            buffer = cgutils.alloca_once(builder,
                                         ir.ArrayType(ir.ArrayType(ivec, lanes), ROW_VECTORS))

            def block_step(b, sums):
                """Words ``b * lanes ..`` of every row: ``lanes`` rows' words loaded and
                transposed (rows past N read row N - 1 and are never stored), then their
                groups in order."""
                for r in range(ROW_VECTORS):
                    rows = []
                    for l in range(lanes):
                        n = builder.add(n0, const(r * lanes + l))
                        n = builder.select(builder.icmp_signed("<", n, N), n, last_row)
                        at = builder.add(builder.mul(n, nbytes), builder.mul(b, const(4 * lanes)))
                        rows.append(builder.load(ptr(builder, arr_d.data, at, ivec), align=1))
                    for d, word in enumerate(_transpose(builder, rows)):
                        builder.store(word, builder.gep(buffer, [const(0), const(r), const(d)]))

                def column_step(d, sums):
                    words = [builder.load(builder.gep(buffer, [const(0), const(r), d]))
                             for r in range(ROW_VECTORS)]
                    for g in range(4 * groups_per_byte):
                        group = builder.add(builder.mul(builder.add(
                            builder.mul(b, const(lanes)), d), const(4 * groups_per_byte)),
                            const(g))
                        shift0 = ir.Constant(ivec, [4 * bits * g] * lanes) if g else None
                        sums = group_step(words, shift0, group, sums)
                    return sums

                return counted_loop(builder, intp, const(lanes), sums, column_step, "columns")

            sums = counted_loop(builder, intp, builder.sdiv(nbytes, const(4 * lanes)),
                                [zero] * ROW_VECTORS, block_step, "blocks")

            def word_step(d, sums):
                d = builder.add(d, builder.mul(builder.sdiv(nbytes, const(4 * lanes)),
                                               const(lanes)))
                words = gather(builder.mul(d, const(4)))
                for g in range(4 * groups_per_byte):
                    group = builder.add(builder.mul(d, const(4 * groups_per_byte)), const(g))
                    shift0 = ir.Constant(ivec, [4 * bits * g] * lanes) if g else None
                    sums = group_step(words, shift0, group, sums)
                return sums

            sums = counted_loop(builder, intp,
                                builder.srem(builder.sdiv(nbytes, const(4)), const(lanes)),
                                sums, word_step, "words")
            # The last nbytes % 4 bytes: the word that ends the row, shifted down to each.
            rem = builder.srem(nbytes, const(4))
            last = gather(builder.sub(nbytes, const(4)))

            def tail_step(b, sums):
                byte = builder.add(builder.sub(nbytes, rem), b)
                shift = builder.trunc(builder.mul(builder.add(builder.sub(const(4), rem), b),
                                                  const(8)), _I32)
                splat_shift = builder.shuffle_vector(
                    builder.insert_element(ir.Constant(ivec, None), shift, ir.Constant(_I32, 0)),
                    ir.Constant(ivec, None), ir.Constant(ivec, [0] * lanes))
                for g in range(groups_per_byte):
                    group = builder.add(builder.mul(byte, const(groups_per_byte)), const(g))
                    shift0 = builder.add(splat_shift, ir.Constant(ivec, [4 * bits * g] * lanes))
                    sums = group_step(last, shift0, group, sums)
                return sums

            sums = counted_loop(builder, intp, rem, sums, tail_step, "tail")
            for r, s in enumerate(sums):
                builder.store(s, ptr(builder, arr_a.data, const(4 * lanes * r), fvec), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


if LANES:
    _TERNARY_TILE, _SIGN_TILE = _make_tile(2, LANES), _make_tile(1, LANES)
else:  # never called: ``gemv`` takes the scalar kernel
    _TERNARY_TILE = _SIGN_TILE = None


@numba.njit(cache=True)
def _joint_table(x, i0, count, bits, t):
    """``t[e]``: the signed sum of ``x[i0:i0 + count]`` (zeros past the end of x) for the packed
    field bits ``e`` of ``count`` codes (ternary fields 0-3 as -1, 0, 1 and, for 3, 2 as the
    reference reads it; sign bits as -1, 1), added in order of the codes: a code 0 keeps the
    entry of the codes before it, as ``_lut._table`` builds ``gemm``'s entries."""
    x0 = x[i0] if i0 < x.shape[0] else np.float32(0)
    t[0] = -x0
    if bits == 2:
        t[1] = 0.0
        t[2] = x0
        t[3] = x0 + x0
    else:
        t[1] = x0
    n = 4 if bits == 2 else 2
    for i in range(1, count):
        xi = x[i0 + i] if i0 + i < x.shape[0] else np.float32(0)
        for s in range(n):
            v = t[s]
            if bits == 2:
                t[s + n] = v
                t[s + 2 * n] = v + xi
                t[s + 3 * n] = v + (xi + xi)
            else:
                t[s + n] = v + xi
            t[s] = v - xi
        n *= 4 if bits == 2 else 2


@numba.njit(parallel=True, cache=True)
def _lane_tables(x, bits, first, tables):
    """``_tile``'s tables of one activation row, ``parts = 5 - first`` rows a group, each
    repeated over the lanes: the joint values of the group's ``first`` codes, then one table of
    each later code's values; zeros past K."""
    lanes = tables.shape[1]
    parts = 5 - first
    size = 1 << (bits * first)
    for j in numba.prange(tables.shape[0] // parts):
        row = tables[j * parts]
        _joint_table(x, 4 * j, first, bits, row)
        for lane in range(size, lanes):
            row[lane] = row[lane - size]
        for i in range(first, 4):
            row = tables[j * parts + 1 + i - first]
            _joint_table(x, 4 * j + i, 1, bits, row)
            for lane in range(1 << bits, lanes):
                row[lane] = row[lane - (1 << bits)]


@numba.njit(parallel=True, cache=True)
def _simd_rows(tables, data, bits, scale, col_scale, out):
    """out[n] = (sum of row n's groups) * scale * col_scale[n], ``ROW_VECTORS * LANES`` weight
    rows a task."""
    N = data.shape[0]
    step = ROW_VECTORS * LANES
    for task in numba.prange(-(-N // step)):
        n0 = task * step
        acc = np.empty(step, np.float32)
        if bits == 2:
            _TERNARY_TILE(data, n0, tables, acc)
        else:
            _SIGN_TILE(data, n0, tables, acc)
        for n in range(n0, min(N, n0 + step)):
            out[n] = acc[n - n0] * (scale * (col_scale[n] if col_scale.size else np.float32(1)))


@numba.njit(parallel=True, cache=True)
def _scalar_tables(x, bits, tables):
    """One activation row's tables for ``_scalar_rows``: ``tables[j, e]`` is group j's signed sum
    for the packed field bits ``e`` of its four codes (ternary: the byte itself, a field of 3 read
    as code 2 as the reference reads it; sign: the nibble), built like ``_lut._table``'s entries
    (a code 0 keeps the entry before it; zeros past K)."""
    for j in numba.prange(tables.shape[0]):
        _joint_table(x, 4 * j, 4, bits, tables[j])


#: Groups a task of ``_scalar_rows`` reads at a time for all its weight rows: 16 ternary tables
#: of 256 entries (16 KiB, L1).
SCALAR_BLOCK = 16


@numba.njit(cache=True, inline="always")
def _entry(tables, row, j, bits):
    """Group j's table entry for a packed weight row."""
    if bits == 2:
        return tables[j, row[j]]
    return tables[j, (np.int32(row[j >> 1]) >> (4 * (j & 1))) & 15]


@numba.njit(parallel=True, cache=True)
def _scalar_rows(tables, data, bits, scale, col_scale, out):
    """out[n] = (sum_j tables[j, field bits of group j of row n]) * scale * col_scale[n]: the
    groups added in order of j. Tasks of 64 weight rows, each reading SCALAR_BLOCK groups'
    tables for all its rows at a time, four rows side by side (one row's sum is a chain of
    dependent adds: 2.9 ms one row at a time, K = N = 4096 on 2 cores)."""
    N = data.shape[0]
    G = tables.shape[0]
    chunk = 64
    for task in numba.prange(-(-N // chunk)):
        n0 = task * chunk
        n1 = min(N, n0 + chunk)
        acc = np.zeros(n1 - n0, np.float32)
        for j0 in range(0, G, SCALAR_BLOCK):
            j1 = min(G, j0 + SCALAR_BLOCK)
            n = n0
            while n + 4 <= n1:
                r0, r1, r2, r3 = data[n], data[n + 1], data[n + 2], data[n + 3]
                a0, a1, a2, a3 = acc[n - n0], acc[n - n0 + 1], acc[n - n0 + 2], acc[n - n0 + 3]
                for j in range(j0, j1):
                    a0 += _entry(tables, r0, j, bits)
                    a1 += _entry(tables, r1, j, bits)
                    a2 += _entry(tables, r2, j, bits)
                    a3 += _entry(tables, r3, j, bits)
                acc[n - n0], acc[n - n0 + 1], acc[n - n0 + 2], acc[n - n0 + 3] = a0, a1, a2, a3
                n += 4
            for n in range(n, n1):
                a = acc[n - n0]
                for j in range(j0, j1):
                    a += _entry(tables, data[n], j, bits)
                acc[n - n0] = a
        for n in range(n0, n1):
            out[n] = acc[n - n0] * (scale * (col_scale[n] if col_scale.size else np.float32(1)))


def gemv(x, data, bits, scale, col_scale, out, simd=None):
    """out [M, N] float32 = ``(x @ codes.T) * scale * col_scale`` for few rows of x [M, K] (the
    forward's weight rows ``data`` [N, nbytes] as outputs), one activation row at a time, in
    ``_lut.gemm``'s order of adds (the same bits). ``simd``: the lookup kernel (default: where
    the CPU has it and rows have at least four bytes), else the scalar tables."""
    if simd is None:
        simd = bool(LANES) and data.shape[1] >= 4
    if simd:
        first = _first_codes(bits, LANES)
        tables = np.empty((data.shape[1] * (2 // bits) * (5 - first), LANES), np.float32)
        for m in range(x.shape[0]):
            _lane_tables(x[m], bits, first, tables)
            _simd_rows(tables, data, bits, scale, col_scale, out[m])
        return
    tables = np.empty((-(-x.shape[1] // 4), 256 if bits == 2 else 16), np.float32)
    for m in range(x.shape[0]):
        _scalar_tables(x[m], bits, tables)
        _scalar_rows(tables, data, bits, scale, col_scale, out[m])
