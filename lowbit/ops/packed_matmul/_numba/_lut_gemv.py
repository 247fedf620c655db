"""The float-activation forward of few rows with ternary and sign weights (``_lut.py``'s
products, one activation row at a time): ``out[n] = sum_j T_j(n) * scale * col_scale[n]``, each
group's entry ``T_j = (c_0 x_0 + c_1 x_1) + (c_2 x_2 + c_3 x_3)`` over its four codes, the groups
added in order of ``j``, as ``_lut.gemm`` adds them: the same bits.

- On a CPU with AVX2 or AVX-512F (``LANES`` 8 or 16 weight rows a vector), ``_tile``: table
  lookups in registers (``vpermps``, which reads only the low 3 or 4 bits of each index), so the
  packed word of a weight row shifted right to a field indexes a table directly. A group takes
  ``_parts`` lookups: one of the joint values of its four codes where they fit a register (sign,
  16 lanes), else one of each pair's (ternary with 16 lanes, sign with 8), else one of each
  code's values (ternary with 8: ``[-x_i, 0, x_i, x_i + x_i]``); a ternary field of 3 reads as
  code 2, as the reference reads it. The lookups add as the entries are built: pairs, then the
  pairs. Every table repeats over the lanes. ``ROW_VECTORS`` vectors of rows run at a time. Their
  words come ``LANES`` at a time as ``LANES`` rows' loads transposed in registers (gathering each
  word took half the time: K = N = 4096 ternary 0.8 against 0.36-0.42 ms), the rest of a row's
  words by gathers, its last bytes from the word that ends it.
- Elsewhere (ARM, x86 without AVX2), and for rows of fewer than four bytes: ``_scalar_rows``,
  scalar tables of each group's joint values indexed by the packed bits themselves (256 entries a
  ternary byte, 16 a sign nibble), one scalar add a group, four weight rows side by side.

Measured on a 2-core AMD EPYC Zen 4, one row, K = N = 4096 (in one process, best of 60): ternary
0.32-0.33 ms (0.36-0.42 with a lookup a code after the first pair), sign 0.14-0.17 ms (the
scalar tables 2.4 and 3.6-4.3 ms; NumPy's float32 ``x @ W`` 1.5-2.3 ms on OpenBLAS's SkylakeX
kernels); compiled for Haswell (8 lanes) 0.47 and 0.23 ms against NumPy's 2.3 ms on OpenBLAS's
Haswell kernels.

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


def _parts(bits, lanes):
    """Lookups a group of four codes takes in registers of ``lanes`` entries: 1 where its joint
    values fit (sign, 16 lanes), 2 where a pair's do (one a pair: ternary with 16, sign with 8),
    else 4 (one a code: ternary with 8)."""
    return 1 if 1 << 4 * bits <= lanes else 2 if 1 << 2 * bits <= lanes else 4


def _make_tile(bits, lanes):
    """Intrinsic ``tile(data, n0, tables, acc)``: ``acc[:ROW_VECTORS * lanes]`` = the sums of
    weight rows ``n0 ..`` of ``data`` (C-contiguous uint8 [N, nbytes], nbytes >= 4) against
    ``tables`` (C-contiguous float32 [groups * parts, lanes], ``_lane_tables``: group g's
    lookup i in row ``g * parts + i``). Lanes of rows past N read row N - 1 or nothing (never
    past ``data``) and hold no sum the caller may use."""
    groups_per_byte = 2 // bits
    parts = _parts(bits, lanes)
    width = 4 // parts * bits  # bits of the packed word a lookup reads
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
            def splat(value):  # an i32 in every lane
                one = builder.insert_element(ir.Constant(ivec, None), value, ir.Constant(_I32, 0))
                return builder.shuffle_vector(one, ir.Constant(ivec, None),
                                              ir.Constant(ivec, [0] * lanes))

            index = builder.mul(lane, splat(stride))
            left = builder.trunc(builder.sub(N, n0), _I32)  # rows of the tile that exist
            bases, masks = [], []
            for r in range(ROW_VECTORS):
                start = builder.mul(builder.add(n0, const(r * lanes)), nbytes)
                bases.append(builder.gep(builder.bitcast(arr_d.data, _I8P), [start]))
                limit = builder.sub(left, ir.Constant(_I32, r * lanes))
                masks.append(builder.icmp_signed("<", lane, splat(limit)))

            def table(row):
                return builder.load(ptr(builder, arr_t.data,
                                        builder.mul(row, const(4 * lanes)), fvec), align=4)

            def group_step(words, shift0, group, sums):
                """Group ``group``'s codes, at bit ``shift0`` of ``words`` (None: 0): its
                ``parts`` lookups, added as ``_lut._table`` adds its entries (pairs of codes,
                then the pairs), then to ``sums``."""
                row = builder.mul(group, const(parts))
                looked = []
                for i in range(parts):
                    t = table(builder.add(row, const(i)))
                    shift = ir.Constant(ivec, [width * i] * lanes)
                    if shift0 is not None:
                        shift = builder.add(shift0, shift) if i else shift0
                    looked.append([_permute(builder, t, w if i == 0 and shift0 is None
                                            else builder.lshr(w, shift)) for w in words])
                while len(looked) > 1:
                    looked = [[builder.fadd(a, b) for a, b in zip(looked[i], looked[i + 1])]
                              for i in range(0, len(looked), 2)]
                return [builder.fadd(s, e) for s, e in zip(sums, looked[0])]

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
                splat_shift = splat(shift)
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


@numba.njit(cache=True, inline="always")
def _value(field, x, bits):
    """A code's stored field times x, exactly: ternary fields 0-3 as -1, 0, 1 and (a field of 3,
    as the reference reads it) 2; sign bits as -1, 1."""
    if bits == 1:
        return x if field else -x
    return -x if field == 0 else np.float32(0) if field == 1 else x if field == 2 else x + x


@numba.njit(cache=True, inline="always")
def _pair(e, xa, xb, bits):
    """The sum of two codes (fields ``e``: the first in the low bits) times ``xa``, ``xb``."""
    return _value(e & ((1 << bits) - 1), xa, bits) + _value(e >> bits, xb, bits)


@numba.njit(cache=True, inline="always")
def _at(x, i):
    return x[i] if i < x.shape[0] else np.float32(0)


@numba.njit(cache=True)
def _group_table(x, i0, codes, bits, t):
    """``t[e]`` for the packed fields ``e`` of ``codes`` (1, 2 or 4) codes times ``x[i0 ..]``
    (zeros past the end of x), added as ``_lut._table`` adds: a code's value, a pair's sum, or
    four codes' two pair sums added. A second code of 0 adds +0 where ``_table`` keeps the first
    code's value: they differ at most in the sign of a zero, which reaches no output (a row's
    sum starts from +0, and +0 + -0 is +0)."""
    for e in range(1 << codes * bits):
        if codes == 1:
            t[e] = _value(e, _at(x, i0), bits)
        elif codes == 2:
            t[e] = _pair(e, _at(x, i0), _at(x, i0 + 1), bits)
        else:
            t[e] = (_pair(e & ((1 << 2 * bits) - 1), _at(x, i0), _at(x, i0 + 1), bits)
                    + _pair(e >> 2 * bits, _at(x, i0 + 2), _at(x, i0 + 3), bits))


@numba.njit(parallel=True, cache=True)
def _lane_tables(x, bits, parts, tables):
    """``_tile``'s tables of one activation row, ``parts`` rows a group (``_parts``): the
    values of its 4 / parts codes a row, each repeated over the lanes; zeros past K."""
    lanes = tables.shape[1]
    codes = 4 // parts
    size = 1 << codes * bits
    for j in numba.prange(tables.shape[0] // parts):
        for i in range(parts):
            row = tables[j * parts + i]
            _group_table(x, 4 * j + codes * i, codes, bits, row)
            for lane in range(size, lanes):
                row[lane] = row[lane - size]


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
    (two pairs' sums added; zeros past K)."""
    for j in numba.prange(tables.shape[0]):
        _group_table(x, 4 * j, 4, bits, tables[j])


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
        parts = _parts(bits, LANES)
        tables = np.empty((data.shape[1] * (2 // bits) * parts, LANES), np.float32)
        for m in range(x.shape[0]):
            _lane_tables(x[m], bits, parts, tables)
            _simd_rows(tables, data, bits, scale, col_scale, out[m])
        return
    tables = np.empty((-(-x.shape[1] // 4), 256 if bits == 2 else 16), np.float32)
    for m in range(x.shape[0]):
        _scalar_tables(x[m], bits, tables)
        _scalar_rows(tables, data, bits, scale, col_scale, out[m])
