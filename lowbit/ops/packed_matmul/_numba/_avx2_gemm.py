"""AVX2 and AVX-VNNI (256-bit) GEMM of the numba packed matmul: ``y = x @ w`` (``gemm``) and
the dx of int8 gradients, ``dx = dy @ w.T`` (``gemm_dx``), exact in int32.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``_avx2.py`` (the GEMV, the feature flags and
the IR helpers the tile intrinsic is emitted with), ``__init__.py`` (the choice of kernel),
``_vnni.py`` (the AVX-512 VNNI kernels these follow, ``_planes``).

GEMM (``gemm``, more rows): the codes of each panel of 16 output columns are spread to one byte
each, four consecutive K to a 32-bit word (int8 weights on AVX2: two int16 to a word, against
int16 activation codes), and a 6 x 16 register tile (12 ymm accumulators) runs over all of K
with one broadcast word per row and step. AVX2 2- and 1-bit: ``vpmaddubsw`` into int16
accumulators for a bounded run of steps, then ``vpmaddwd`` with ones into the int32 tile kept
in memory.

``gemm_dx`` runs the same tiles with the roles of the weight's axes swapped: its panels hold 64
input features (the output columns of dx) and, a word at a time, four consecutive output
features (the sum), read across four packed rows; the gradient codes take the activations'
place, with the same stored-field offsets (``xsum``).
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._avx2 import (_I32, _V8, _W16, AVX_VNNI, INT8_OFFSET, INT16_STEPS, _dpbusd, _madd,
                    _maddubs, _splat, _widen)
from ._llvm import counted_loop, is_array, ptr
from ._vnni import _planes

#: Columns of a GEMM panel, of one register tile (two vectors of eight int32 lanes), and most
#: rows of a tile.
PANEL = 64
SUB = 16
TILE_ROWS = 6


def gemm_tile(rows):
    """Intrinsic ``tile(a, m0, panel, col0, count, steps, c)``: int32 ``c[:rows, col0:col0 + 16]``
    = products of ``rows`` rows of activation codes with 16 columns of a panel, over ``count``
    words of K.

    ``a``: C-contiguous, rows ``m0 .. m0 + rows``; int8 ``[M, >= 4 count]`` against a panel of
    four unsigned weight bytes a word, or (int8 weights on AVX2) int16 ``[M, >= 2 count]``
    against two int16 weights a word; ``panel``: C-contiguous uint32 ``[>= count, PANEL]``,
    ``panel[q, n]`` the word of column ``n`` for K word ``q`` (lowest byte first); ``steps``: how
    many words the AVX2 ``vpmaddubsw`` sums in int16 before widening (``INT16_STEPS``; unused
    otherwise); ``c``: C-contiguous int32 ``[>= rows, PANEL]``, columns ``col0 .. col0 + 16``
    overwritten. Each step loads two weight vectors and broadcasts one word per row.
    """
    vectors = SUB // 8

    @intrinsic
    def tile(typingctx, a, m0, panel, col0, count, steps, c):
        if not (is_array(a, 2, (types.int8, types.int16))
                and is_array(panel, 2, (types.uint32,)) and is_array(c, 2, (types.int32,))):
            return None
        pairs = a.dtype == types.int16
        sig = types.void(a, types.intp, panel, types.intp, types.intp, types.intp, c)

        def codegen(context, builder, signature, args):
            arr_a = context.make_array(signature.args[0])(context, builder, args[0])
            arr_p = context.make_array(signature.args[2])(context, builder, args[2])
            arr_c = context.make_array(signature.args[6])(context, builder, args[6])
            intp = context.get_value_type(types.intp)
            a_stride = cgutils.unpack_tuple(builder, arr_a.strides, 2)[0]
            p_stride = cgutils.unpack_tuple(builder, arr_p.strides, 2)[0]
            c_stride = cgutils.unpack_tuple(builder, arr_c.strides, 2)[0]

            def const(value):
                return ir.Constant(intp, value)

            col = builder.mul(args[3], const(4))
            a_rows = [ptr(builder, arr_a.data, builder.mul(builder.add(args[1], const(r)),
                                                             a_stride)) for r in range(rows)]
            p_base = ptr(builder, arr_p.data, col)
            c_at = [[ptr(builder, arr_c.data, builder.add(builder.mul(const(r), c_stride),
                                                          builder.add(col, const(32 * v))), _V8)
                     for v in range(vectors)] for r in range(rows)]
            zero_mask = ir.Constant(_V8, [0] * 8)

            def operands(q):
                w_row = ptr(builder, p_base, builder.mul(q, p_stride))
                weights = [builder.load(ptr(builder, w_row, const(32 * v), _V8), align=4)
                           for v in range(vectors)]
                xs = []
                for r in range(rows):
                    x = builder.load(ptr(builder, a_rows[r], builder.mul(q, const(4)), _I32),
                                     align=1)
                    one = builder.insert_element(ir.Constant(_V8, None), x, ir.Constant(_I32, 0))
                    xs.append(builder.shuffle_vector(one, ir.Constant(_V8, None), zero_mask))
                return weights, xs

            def step(q, accs):
                weights, xs = operands(q)
                new = []
                for r in range(rows):
                    for v in range(vectors):
                        acc = accs[r * vectors + v]
                        if pairs:
                            new.append(builder.add(acc, _madd(
                                builder, builder.bitcast(weights[v], _W16),
                                builder.bitcast(xs[r], _W16))))
                        elif AVX_VNNI:
                            new.append(_dpbusd(builder, acc, weights[v], xs[r]))
                        else:
                            new.append(builder.add(acc, _maddubs(builder, weights[v], xs[r])))
                return new

            if pairs or AVX_VNNI:
                accs = counted_loop(builder, intp, args[4], [_splat(_V8, 0)] * (rows * vectors),
                                    step, "tile")
                for r in range(rows):
                    for v in range(vectors):
                        builder.store(accs[r * vectors + v], c_at[r][v], align=4)
                return context.get_dummy_value()

            # AVX2 bytes: runs of ``steps`` words summed in int16, widened into c
            for r in range(rows):
                for v in range(vectors):
                    builder.store(_splat(_V8, 0), c_at[r][v], align=4)
            count, run = args[4], args[5]
            nruns = builder.sdiv(builder.add(count, builder.sub(run, const(1))), run)

            def chunk(i, _):
                q0 = builder.mul(i, run)
                left = builder.sub(count, q0)
                n = builder.select(builder.icmp_signed("<", left, run), left, run)
                sums = counted_loop(builder, intp, n, [_splat(_W16, 0)] * (rows * vectors),
                                    lambda q, accs: step(builder.add(q0, q), accs), "run")
                for r in range(rows):
                    for v in range(vectors):
                        old = builder.load(c_at[r][v], align=4)
                        wide = _widen(builder, sums[r * vectors + v])
                        builder.store(builder.add(old, wide), c_at[r][v], align=4)
                return []

            counted_loop(builder, intp, nruns, [], chunk, "tile")
            return context.get_dummy_value()

        return sig, codegen

    return tile


_T1, _T2, _T3, _T4, _T5, _T6 = (gemm_tile(r) for r in range(1, 7))


def _spread_tables():
    """uint32 spreads, four fields to four bytes: a ternary byte's 2-bit fields, a sign nibble's
    bits."""
    b = np.arange(256, dtype=np.uint32)
    two = sum(((b >> (2 * t)) & 3) << (8 * t) for t in range(4)).astype(np.uint32)
    one = sum(((b[:16] >> t) & 1) << (8 * t) for t in range(4)).astype(np.uint32)
    return two, one


_SPREAD2, _SPREAD1 = _spread_tables()


@numba.njit(cache=True)
def _row_tiles(a, panel, count, steps, bits, xsum, scale_x, scale_w, n0, width, out):
    """The register tiles over one panel for each group of six rows of ``a``, then
    ``out[m, n0 + j] = float32(acc) * scale_x[m] * scale_w[n0 + j]`` for the panel's ``width``
    columns (``scale_w`` of one element: the same for all); acc as in ``_gemv_kernel``."""
    M = a.shape[0]
    R = TILE_ROWS
    stride = scale_w.shape[0] > 1
    mult = 2 if bits == 1 else 1  # int32 wrap-around throughout: exact where the sum fits
    c = np.empty((R, PANEL), np.int32)
    for m0 in range(0, M, R):
        r = min(R, M - m0)
        for col0 in range(0, width, SUB):
            if r == 6:
                _T6(a, m0, panel, col0, count, steps, c)
            elif r == 5:
                _T5(a, m0, panel, col0, count, steps, c)
            elif r == 4:
                _T4(a, m0, panel, col0, count, steps, c)
            elif r == 3:
                _T3(a, m0, panel, col0, count, steps, c)
            elif r == 2:
                _T2(a, m0, panel, col0, count, steps, c)
            else:
                _T1(a, m0, panel, col0, count, steps, c)
        for i in range(r):
            m = m0 + i
            sx = scale_x[m]
            xs = xsum[m]
            ci = c[i]
            dst = out[m, n0:n0 + width]
            if stride:  # one loop per scale kind (see ``_vnni._row_tiles``)
                sw = scale_w[n0:n0 + width]
                for j in range(width):
                    dst[j] = (np.float32(np.int32(np.int64(ci[j]) * mult - xs)) * sx) * sw[j]
            else:
                s0 = scale_w[0]
                for j in range(width):
                    dst[j] = (np.float32(np.int32(np.int64(ci[j]) * mult - xs)) * sx) * s0


@numba.njit(parallel=True, cache=True)
def _gemm_kernel(a, data, bits, steps, xsum, scale_x, scale_w, out):
    """out = float32(acc) * scale_x[:, None] * scale_w, acc the exact int32 product of the codes.

    a: [M, 4 count] int8 activation codes (int16 ``[M, 2 count]`` for int8 weights on AVX2),
    zero past K; xsum: as in ``_gemv_kernel``. Parallel over panels of 64 output columns: each
    task spreads its columns' codes into ``panel`` (``gemm_tile``), then runs the register tiles
    for each group of six rows (``_row_tiles``).
    """
    count = a.shape[1] * a.itemsize // 4
    N, nbytes = data.shape
    P = PANEL
    spread2 = _SPREAD2
    spread1 = _SPREAD1
    for p in numba.prange((N + P - 1) // P):
        n0 = p * P
        width = min(P, N - n0)
        panel = np.zeros((count, P), np.uint32)
        for j in range(width):
            row = data[n0 + j]
            if bits == 2:
                for g in range(nbytes):
                    panel[g, j] = spread2[row[g]]
            elif bits == 1:
                for g in range(nbytes):
                    b = row[g]
                    panel[2 * g, j] = spread1[b & 15]
                    if 2 * g + 1 < count:
                        panel[2 * g + 1, j] = spread1[b >> 4]
            elif a.itemsize == 2:  # int8 weights, two int16 a word
                for g in range(count):
                    lo = np.uint32(np.uint16(np.int16(np.int8(row[2 * g]))))
                    hi = np.uint32(0)
                    if 2 * g + 1 < nbytes:
                        hi = np.uint32(np.uint16(np.int16(np.int8(row[2 * g + 1]))))
                    panel[g, j] = lo | (hi << np.uint32(16))
            else:  # int8 weights with the sign bit flipped, four a word
                for g in range(count):
                    v = np.uint32(0)
                    for t in range(4):
                        k = 4 * g + t
                        if k < nbytes:
                            v |= np.uint32(np.uint8(row[k]) ^ np.uint8(128)) << np.uint32(8 * t)
                    panel[g, j] = v
        _row_tiles(a, panel, count, steps, bits, xsum, scale_x, scale_w, n0, width, out)


@numba.njit(cache=True)
def _codes16(codes_x, a):
    """a[m, k] = codes_x[m, k] as int16 (zero past K)."""
    M, K = codes_x.shape
    for m in range(M):
        for k in range(a.shape[1]):
            a[m, k] = codes_x[m, k] if k < K else 0


def gemm(codes_x, scale_x, data, scale_w, bits, K, out):
    """As ``gemv`` for more rows: the register-tile GEMM."""
    M = codes_x.shape[0]
    xsum = np.zeros(M, dtype=np.int32)
    if bits == 8 and not AVX_VNNI:
        a = np.empty((M, 2 * -(-K // 2)), np.int16)
        _codes16(codes_x, a)
    else:
        a3 = np.empty((M, 1, 4 * -(-K // 4)), np.int8)  # one "plane": the codes, zero past K
        _planes(codes_x, 1, INT8_OFFSET if bits == 8 else 1, a3, xsum)
        a = a3.reshape(M, -1)
    _gemm_kernel(a, data, bits, INT16_STEPS.get(bits, 1), xsum, scale_x, scale_w, out)
    return out


@numba.njit(parallel=True, cache=True)
def _gemm_dx_kernel(a, data, bits, steps, xsum, scale_x, scale_w, K, out):
    """out[m, k] = float32(acc) * scale_x[m] * scale_w[0], acc the exact int32 sum over n of
    ``a[m, n] * code(n, k)``: ``_gemm_kernel`` with the weight read across its rows.

    a: [M, 4 count] int8 gradient codes (int16 ``[M, 2 count]`` for int8 weights on AVX2), zero
    past N; data: packed [N, bytes] of K codes a row. Parallel over panels of 64 input features:
    panel word ``q`` of feature ``k`` holds the stored fields of rows ``4q .. 4q + 3`` (two int16
    codes of rows ``2q, 2q + 1`` against int16 gradients).
    """
    count = a.shape[1] * a.itemsize // 4
    N = data.shape[0]
    P = PANEL
    per = 8 // bits if bits < 8 else 1
    mask = (1 << bits) - 1 if bits < 8 else 255
    for p in numba.prange((K + P - 1) // P):
        k0 = p * P
        width = min(P, K - k0)
        panel = np.zeros((count, P), np.uint32)
        for q in range(count):
            pq = panel[q]
            if bits == 8 and a.itemsize == 2:  # two int16 a word
                for t in range(2):
                    n = 2 * q + t
                    if n < N:
                        row = data[n]
                        for j in range(width):
                            pq[j] |= (np.uint32(np.uint16(np.int16(np.int8(row[k0 + j]))))
                                      << np.uint32(16 * t))
                continue
            if bits < 8 and 4 * q + 3 < N:  # four whole rows: each word written once
                g0 = k0 // per  # k0 is a multiple of every format's codes per byte
                r0, r1, r2, r3 = data[4 * q], data[4 * q + 1], data[4 * q + 2], data[4 * q + 3]
                for g in range(-(-width // per)):
                    b0, b1 = np.uint32(r0[g0 + g]), np.uint32(r1[g0 + g])
                    b2, b3 = np.uint32(r2[g0 + g]), np.uint32(r3[g0 + g])
                    for f in range(min(per, width - g * per)):
                        sh = np.uint32(bits * f)
                        pq[g * per + f] = (((b0 >> sh) & mask) | (((b1 >> sh) & mask) << 8)
                                           | (((b2 >> sh) & mask) << 16)
                                           | (((b3 >> sh) & mask) << 24))
                continue
            for t in range(4):
                n = 4 * q + t
                if n >= N:
                    break
                row = data[n]
                shift = np.uint32(8 * t)
                if bits == 8:  # the sign bit flipped, four a word
                    for j in range(width):
                        pq[j] |= np.uint32(np.uint8(row[k0 + j]) ^ np.uint8(128)) << shift
                else:  # k0 is a multiple of every format's codes per byte
                    g0 = k0 // per
                    for g in range(-(-width // per)):
                        b = np.uint32(row[g0 + g])
                        for f in range(min(per, width - g * per)):
                            pq[g * per + f] |= ((b >> np.uint32(bits * f)) & mask) << shift
        _row_tiles(a, panel, count, steps, bits, xsum, scale_x, scale_w, k0, width, out)


def gemm_dx(dy_codes, dy_scale, data, bits, K, scale, out):
    """out [M, K] = float32(dy_codes @ codes_w.T) * dy_scale[:, None] * scale, exact int32 sums
    (``_numpy.matmul_dx_int``'s contract): dy_codes [M, N] int8, data packed [N, bytes] of K
    ``bits``-bit codes a row, scale a float32 for every element."""
    M, N = dy_codes.shape
    xsum = np.zeros(M, dtype=np.int32)
    if bits == 8 and not AVX_VNNI:
        a = np.empty((M, 2 * -(-N // 2)), np.int16)
        _codes16(dy_codes, a)
    else:
        a3 = np.empty((M, 1, 4 * -(-N // 4)), np.int8)
        _planes(dy_codes, 1, INT8_OFFSET if bits == 8 else 1, a3, xsum)
        a = a3.reshape(M, -1)
    scale_w = np.full(1, scale, np.float32)
    _gemm_dx_kernel(a, data, bits, INT16_STEPS.get(bits, 1), xsum, dy_scale, scale_w, K, out)
    return out
