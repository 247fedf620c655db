"""AVX-512 VNNI kernels of the numba packed matmul, with the LLVM intrinsics they are built from.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (the backend functions and the
choice of kernel), ``_gemv.py`` (portable GEMV), ``_gemm_f64.py`` (portable GEMM),
``_decode.py``, ``_backward.py``, ``_fma.py``, ``_llvm.py`` (the IR helpers). The intrinsics
and every kernel that calls them live in this one file because Numba's on-disk cache
(``cache=True``) keys a kernel on its own source file: an intrinsic compiled into a kernel of
another file would not invalidate that kernel's cache.

LLVM does not form ``vpdpbusd`` (64 unsigned-by-signed byte products summed into sixteen int32
lanes, one instruction) from a plain Numba loop, so these kernels emit it directly.
``gemm_tile(rows)`` is the GEMM's register tile. Where the CPU lacks the instruction
(``AVAILABLE``) the package runs the 256-bit or the portable kernels. The GEMV of few rows is
``_avx2.py``'s, which runs on 512-bit vectors on these CPUs (``_avx2.WIDE``); ``_planes`` here
lays out the activation codes for it and for the GEMMs.

With stored codes ``c`` (ternary ``code + 1``, sign the bit) the kernels sum ``raw = sum codes_x
* c`` and the signed result follows from the row sum of the codes: ternary ``acc = raw -
sum(codes_x)``, sign ``acc = 2 raw - sum(codes_x)``; int8 weights become the unsigned operand
with their sign bit flipped, ``acc = raw - 128 sum(codes_x)``.

GEMM (``gemm``, more rows): spreads the codes of each panel of 64 output columns to one byte
each, four consecutive K to a 32-bit word (ternary through a 256-entry table, sign a 16-entry
one, int8 with the sign bit flipped), and runs a register tile of 6 rows x 64 columns of int32
accumulators over all of K: per four K, four weight vectors and one broadcast word per row feed
24 ``vpdpbusd``. Exact int32 accumulation; measured 11.9 ms for M = 256, K = N = 4096 (3.8x
NumPy float32 matmul, 3.2x the float64-field BLAS GEMM of ``_gemm_f64.py``).

dx of int8 gradients (``gemm_dx``): the same tiles with the reduction over the weight's N. Each
panel of 64 input features gathers the stored field of every feature from four weight rows at a
time into the four bytes of a word: the four rows' bytes side by side in one word, each field
one shift and mask away (tables, two words per packed byte and row, for a last group of fewer
rows); measured 14 ms on one core of a 2-core EPYC for M = 256, K = N = 4096 ternary, against
69 ms for NumPy's float32 ``dy @ w.T``. On two cores of an EPYC Zen 4 the word-at-a-time gather
took that dx from 17-25 ms (tables for every row) to 12-13 ms.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import counted_loop, host_features, is_array, ptr


#: True when the target CPU has AVX-512 VNNI (``vpdpbusd`` on 512-bit registers).
AVAILABLE = {"+avx512vnni", "+avx512bw"} <= host_features()

_VEC = ir.VectorType(ir.IntType(32), 16)


def _splat(value):
    return ir.Constant(_VEC, [value] * 16)


def _dpbusd(builder, acc, unsigned, signed):
    """acc + the sums of four u8 x s8 products per int32 lane."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3),
                                        "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, unsigned, signed])


#: Columns of a GEMM panel (four vectors of sixteen int32 lanes) and most rows of one tile.
PANEL = 64
TILE_ROWS = 6


def gemm_tile(rows):
    """Intrinsic ``tile(a, m0, panel, count, c)``: int32 ``c[:rows, :64]`` = products of ``rows``
    rows of int8 codes with one panel of byte weights, over ``count`` groups of four K.

    ``a``: C-contiguous int8 ``[M, >= 4 count]``, rows ``m0 .. m0 + rows``; ``panel``:
    C-contiguous uint32 ``[>= count, 64]``, ``panel[q, n]`` holding the four unsigned weight bytes
    of column ``n`` for K ``4q .. 4q + 3`` (lowest byte first); ``c``: C-contiguous int32
    ``[>= rows, 64]``, overwritten. ``rows * 4`` accumulators stay in registers for the whole of K;
    each step loads four weight vectors and broadcasts one 4-byte group per row into
    ``vpdpbusd`` (the broadcast folds into the instruction's memory operand).
    """
    vectors = PANEL // 16

    @intrinsic
    def tile(typingctx, a, m0, panel, count, c):
        if not (is_array(a, 2, (types.int8,)) and is_array(panel, 2, (types.uint32,))
                and is_array(c, 2, (types.int32,))):
            return None
        sig = types.void(a, types.intp, panel, types.intp, c)

        def codegen(context, builder, signature, args):
            arr_a = context.make_array(signature.args[0])(context, builder, args[0])
            arr_p = context.make_array(signature.args[2])(context, builder, args[2])
            arr_c = context.make_array(signature.args[4])(context, builder, args[4])
            i32 = ir.IntType(32)
            intp = context.get_value_type(types.intp)
            a_stride = cgutils.unpack_tuple(builder, arr_a.strides, 2)[0]
            c_stride = cgutils.unpack_tuple(builder, arr_c.strides, 2)[0]

            def const(value):
                return ir.Constant(intp, value)

            a_rows = [ptr(builder, arr_a.data, builder.mul(builder.add(args[1], const(r)),
                                                             a_stride)) for r in range(rows)]
            zero_mask = ir.Constant(ir.VectorType(i32, 16), [0] * 16)

            def step(it, accs):
                w_base = builder.mul(it, const(PANEL * 4))
                weights = [builder.load(ptr(builder, arr_p.data,
                                             builder.add(w_base, const(64 * v)), _VEC), align=4)
                           for v in range(vectors)]
                new = []
                for r in range(rows):
                    x = builder.load(ptr(builder, a_rows[r], builder.mul(it, const(4)), i32),
                                     align=1)
                    one = builder.insert_element(ir.Constant(_VEC, None), x, ir.Constant(i32, 0))
                    xb = builder.shuffle_vector(one, ir.Constant(_VEC, None), zero_mask)
                    for v in range(vectors):
                        new.append(_dpbusd(builder, accs[r * vectors + v], weights[v], xb))
                return new

            accs = counted_loop(builder, intp, args[3], [_splat(0)] * (rows * vectors), step,
                                 "tile")
            for r in range(rows):
                row = ptr(builder, arr_c.data, builder.mul(const(r), c_stride))
                for v in range(vectors):
                    builder.store(accs[r * vectors + v], ptr(builder, row, const(64 * v), _VEC),
                                  align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


@numba.njit(cache=True)
def _planes(codes_x, per, offset, planes, xsum):
    """planes[m, j, g] = codes_x[m, per * g + j] (zero past K); xsum[m] = offset * sum(codes_x[m]).
    One small serial pass (the NumPy pad, transpose and sum it replaced cost ~0.02 ms a call)."""
    M, K = codes_x.shape
    G = planes.shape[2]
    for m in range(M):
        for j in range(per):
            for g in range(G):
                k = g * per + j
                planes[m, j, g] = codes_x[m, k] if k < K else 0
        total = np.int32(0)
        for k in range(K):
            total += np.int32(codes_x[m, k])
        xsum[m] = total * np.int32(offset)


# ---------------------------------------------------------------------------------------------
# GEMM: a 6 x 64 register tile of int32 accumulators over all of K.
_TILE1 = gemm_tile(1)
_TILE2 = gemm_tile(2)
_TILE3 = gemm_tile(3)
_TILE4 = gemm_tile(4)
_TILE5 = gemm_tile(5)
_TILE6 = gemm_tile(6)


def _spread_tables():
    """uint32 spreads, four fields to four bytes: a ternary byte's 2-bit fields, a sign nibble's
    bits."""
    b = np.arange(256, dtype=np.uint32)
    two = sum(((b >> (2 * t)) & 3) << (8 * t) for t in range(4)).astype(np.uint32)
    one = sum(((b[:16] >> t) & 1) << (8 * t) for t in range(4)).astype(np.uint32)
    return two, one


_SPREAD2, _SPREAD1 = _spread_tables()


@numba.njit(cache=True)
def _row_tiles(a, panel, count, bits, xsum, scale_x, scale_w, n0, width, out):
    """The register tile over one panel for each group of six rows of ``a``, then
    ``out[m, n0 + j] = float32(acc) * scale_x[m] * scale_w[n0 + j]`` for the panel's ``width``
    columns (``scale_w`` of one element: the same for all); acc as in ``_gemv_kernel``."""
    M = a.shape[0]
    R = TILE_ROWS
    stride = scale_w.shape[0] > 1
    mult = 2 if bits == 1 else 1  # int32 wrap-around throughout: exact where the sum fits
    c = np.empty((R, PANEL), np.int32)
    for m0 in range(0, M, R):
        r = min(R, M - m0)
        if r == 6:
            _TILE6(a, m0, panel, count, c)
        elif r == 5:
            _TILE5(a, m0, panel, count, c)
        elif r == 4:
            _TILE4(a, m0, panel, count, c)
        elif r == 3:
            _TILE3(a, m0, panel, count, c)
        elif r == 2:
            _TILE2(a, m0, panel, count, c)
        else:
            _TILE1(a, m0, panel, count, c)
        for i in range(r):
            m = m0 + i
            sx = scale_x[m]
            xs = xsum[m]
            ci = c[i]
            dst = out[m, n0:n0 + width]
            # one loop per scale kind: an index that may or may not stride kept the loop scalar
            # (the dw of int8 gradients, 16M outputs over a short K, took 41 against 14 ms)
            if stride:
                sw = scale_w[n0:n0 + width]
                for j in range(width):
                    dst[j] = (np.float32(np.int32(np.int64(ci[j]) * mult - xs)) * sx) * sw[j]
            else:
                s0 = scale_w[0]
                for j in range(width):
                    dst[j] = (np.float32(np.int32(np.int64(ci[j]) * mult - xs)) * sx) * s0


@numba.njit(parallel=True, cache=True)
def _gemm_kernel(a, data, bits, xsum, scale_x, scale_w, out):
    """out = float32(acc) * scale_x[:, None] * scale_w, acc the exact int32 product of the codes.

    a: [M, 4 count] int8 activation codes, zero past K; xsum: as in ``_gemv_kernel``. Parallel
    over panels of 64 output columns: each task spreads its columns' codes into one byte each
    (uint32 ``panel[q, n]`` = the four codes of K ``4q .. 4q + 3``), then runs the register tile
    over all of K for each group of six rows (``_row_tiles``).
    """
    count = a.shape[1] // 4
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
            else:
                for g in range(count):
                    v = np.uint32(0)
                    for t in range(4):
                        k = 4 * g + t
                        if k < nbytes:
                            v |= np.uint32(np.uint8(row[k]) ^ np.uint8(128)) << np.uint32(8 * t)
                    panel[g, j] = v
        _row_tiles(a, panel, count, bits, xsum, scale_x, scale_w, n0, width, out)


def gemm(codes_x, scale_x, data, scale_w, bits, K, out):
    """As ``gemv`` for more rows: the register-tile GEMM."""
    M = codes_x.shape[0]
    a = np.empty((M, 1, 4 * -(-K // 4)), np.int8)  # one "plane": the codes, zero past K
    xsum = np.empty(M, dtype=np.int32)
    _planes(codes_x, 1, 128 if bits == 8 else 1, a, xsum)
    _gemm_kernel(a.reshape(M, -1), data, bits, xsum, scale_x, scale_w, out)
    return out


# ---------------------------------------------------------------------------------------------
# dx from int8 gradient codes: the same tiles, with the weight read across its packed rows.
def _transposed_tables():
    """uint64 [4, 256, per / 2] for 2- and 1-bit fields: what a packed byte of weight row
    ``4q + t`` adds to the panel words of its ``per`` features, ``[t, byte, w]`` holding the words
    of features ``2w`` (low half) and ``2w + 1`` (high half), each field in byte ``t``."""
    b = np.arange(256, dtype=np.uint64)
    tables = []
    for bits in (2, 1):
        per = 8 // bits
        table = np.zeros((4, 256, per // 2), np.uint64)
        for t in range(4):
            for f in range(per):
                field = (b >> np.uint64(bits * f)) & np.uint64((1 << bits) - 1)
                table[t, :, f // 2] |= field << np.uint64(8 * t + 32 * (f % 2))
        tables.append(table)
    return tables


_ACROSS2, _ACROSS1 = _transposed_tables()


@numba.njit(parallel=True, cache=True)
def _gemm_dx_kernel(a, data, bits, K, xsum, scale_g, scale, out):
    """out[m, k] = float32(acc) * scale_g[m] * scale[0], acc the exact int32
    ``sum_n codes_g[m, n] * code_w(k, n)``: the reduction runs over the weight's packed rows.

    a: [M, 4 count] int8 gradient codes, zero past N; xsum: as in ``_gemv_kernel``. Parallel over
    panels of 64 input features k: ``panel[q, j]`` gathers the stored fields of feature
    ``k0 + j`` from weight rows ``4q .. 4q + 3`` (one byte each): a word of the four rows' bytes
    shifted and masked per field, or, for a last group of fewer than four rows, two words at a
    time through ``_ACROSS*`` (int8 weights: their bytes with the sign bit flipped).
    """
    count = a.shape[1] // 4
    N, nbytes = data.shape
    P = PANEL
    per = 8 // bits if bits < 8 else 1
    half = per // 2
    across = _ACROSS2 if bits == 2 else _ACROSS1
    lanes = np.uint32(((1 << bits) - 1) * 0x01010101)  # the field mask in each byte of a word
    for p in numba.prange((K + P - 1) // P):
        k0 = p * P
        width = min(P, K - k0)
        b0 = k0 // per
        nb = min(P // per, nbytes - b0)
        panel = np.zeros((count, P), np.uint32)
        wide = panel.view(np.uint64)
        for q in range(count):
            if bits < 8 and 4 * q + 3 < N:  # four whole rows: each word written once
                r0, r1 = data[4 * q, b0:b0 + nb], data[4 * q + 1, b0:b0 + nb]
                r2, r3 = data[4 * q + 2, b0:b0 + nb], data[4 * q + 3, b0:b0 + nb]
                pq = panel[q]
                for i in range(nb):
                    # the four rows' bytes in one word: field f of each byte is one shift away
                    u = (np.uint32(r0[i]) | (np.uint32(r1[i]) << np.uint32(8))
                         | (np.uint32(r2[i]) << np.uint32(16))
                         | (np.uint32(r3[i]) << np.uint32(24)))
                    for f in range(per):
                        pq[per * i + f] = (u >> np.uint32(bits * f)) & lanes
                continue
            for t in range(min(4, N - 4 * q)):
                row = data[4 * q + t, b0:b0 + nb]
                if bits == 8:
                    shift = np.uint32(8 * t)
                    for j in range(nb):
                        panel[q, j] |= np.uint32(np.uint8(row[j]) ^ np.uint8(128)) << shift
                else:
                    table = across[t]
                    for i in range(nb):
                        src = table[row[i]]
                        for w in range(half):
                            wide[q, half * i + w] |= src[w]
        _row_tiles(a, panel, count, bits, xsum, scale_g, scale, k0, width, out)


def gemm_dx(codes_g, scale_g, data, bits, K, scale, out):
    """out [M, K] float32 = float32(codes_g @ codes_w.T) * scale_g[:, None] * scale.

    codes_g: [M, N] int8 gradient codes; data: packed [N, bytes] of ``bits``-bit codes; scale: a
    float32 scalar; out: overwritten.
    """
    M, N = codes_g.shape
    a = np.empty((M, 1, 4 * -(-N // 4)), np.int8)
    xsum = np.empty(M, dtype=np.int32)
    _planes(codes_g, 1, 128 if bits == 8 else 1, a, xsum)
    _gemm_dx_kernel(a.reshape(M, -1), data, bits, K, xsum, scale_g,
                    np.full(1, scale, np.float32), out)
    return out
