"""float32 register-tile GEMM kernels (AVX-512, or AVX2 with FMA) of the numba packed matmul's
straight-through backward, also the products of the attention, low-rank residual and chunked
gated delta kernels.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (``matmul_dx`` /
``matmul_dw``, which run these where ``AVAILABLE``), ``_vnni.py`` (the integer kernels),
``_llvm.py`` (the IR helpers), ``_backward.py`` (the BLAS paths),
``_decode.py``. Reference ``reference/packed_matmul.py``; tests ``tests/test_packed_matmul.py``.

``fma_tile(rows, load)`` is a register tile of ``rows`` x 64 float32 accumulators (``rows * 4``
zmm registers) fed by ``llvm.fma.v16f32``: per reduction step it loads four vectors of one panel
row and broadcasts one float per tile row. Without AVX-512 (16 ymm registers) the same tile runs
as four passes of ``rows`` x 16 (``llvm.fma.v8f32``), each output by the same multiply-adds in
the same order, so the two give the same bits. Both backward products are this tile over panels
of 64 output columns, in parallel over panels:

- ``dx = dy @ codes_w.T``: the panel rows are the signed codes of 64 input features of one weight
  row, decoded straight from the packed bytes into the panel (a byte-to-codes table for ternary
  and sign), so the float32 weight never exists in full and each code is decoded once;
- ``dw = Qa(x).T @ dy``: the panel rows are 64 columns of ``dy``, the broadcast values the
  dequantized activations (transposed first when large).

Every product and sum is float32 (fused multiply-add), in a fixed order: deterministic. Why not
BLAS: NumPy's OpenBLAS runs its AVX2 ("Haswell") kernels on AMD Zen CPUs, half the vector width
of these tiles (measured on one core of a 2-core EPYC, 256 x 4096 x 4096: sgemm 69 ms; dx here
39 ms with the decode, dw 36 ms on transposed activations), and BLAS needs the decoded weight in
memory first. The 256-bit tiles do not beat OpenBLAS's Haswell kernels on this backward (see
``__init__.USE_FMA``); they do win on the attention-like products of the other ops, whose BLAS
calls are small (2-core EPYC Zen 3, one thread a product, against SciPy's OpenBLAS: the low-rank
residual's causal-linear attention 4.6 against 5.3 ms forward, 11.6 against 14.2 ms backward;
segmented attention forward + backward 940-1011 against 1090-1129 ms; the chunked gated delta
scan against the token-by-token kernels 1.3-1.6x forward, 1.1-1.2x backward at B = 4 and 1,
T = 2048, 0.95x backward at B = 2, T = 256).
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import counted_loop, host_features, is_array, ptr


_FEATURES = host_features()
#: True when the target CPU has AVX-512F (sixteen float32 lanes a register, 32 registers).
WIDE = "+avx512f" in _FEATURES
#: True when the tiles can run: AVX-512F, or AVX2 with FMA (eight lanes, 16 registers).
AVAILABLE = WIDE or {"+avx2", "+fma"} <= _FEATURES

#: Output columns of a panel (four vectors of sixteen float32 lanes) and most rows of one tile.
PANEL = 64
TILE_ROWS = 6
#: Reduction steps per panel block: a [KC, 64] float32 panel (64 KiB) stays in L2 while every
#: row tile runs over it (128 and 512 measured no faster for dx, 128 5% slower for dw).
KC = 256

#: float32 lanes of a vector and vectors of accumulators per tile row in one pass over a panel.
_LANES, _PASS_VECTORS = (16, 4) if WIDE else (8, 2)
_F32 = ir.FloatType()
_FVEC = ir.VectorType(_F32, _LANES)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FVEC, [_FVEC] * 3),
                                        f"llvm.fma.v{_LANES}f32")
    return builder.call(fn, [a, b, c])


def fma_tile(rows, load):
    """Intrinsic ``tile(a, i0, r0, si, sr, panel, count, c, c0, j0)``: float32
    ``c[c0:c0 + rows, j0:j0 + 64] (+)= A[i0:i0 + rows, r0:r0 + count] @ panel[:count, :64]``.

    ``A[i, r]`` is the float32 at element offset ``i * si + r * sr`` of the C-contiguous array
    ``a`` (``si = R, sr = 1``: ``a`` is A [I, R]; ``si = 1, sr = I``: ``a`` is A transposed);
    ``panel``: C-contiguous float32 ``[>= count, 64]``;
    ``c``: C-contiguous float32 ``[>= c0 + rows, >= j0 + 64]``. The accumulators start from ``c``
    (``load``) or zero, stay in registers over the ``count`` steps, and are stored back; each step
    adds ``a[i, r] * panel[r, :]`` in order of ``r``. With AVX-512 the 64 columns are one pass of
    ``rows * 4`` zmm accumulators; with AVX2 four passes of 16 columns (``rows * 2`` ymm), so both
    compute every output by the same fused multiply-adds in the same order: bit for bit equal.
    """
    width = _LANES * _PASS_VECTORS  # columns a pass

    @intrinsic
    def tile(typingctx, a, i0, r0, si, sr, panel, count, c, c0, j0):
        if not (is_array(a, 2, (types.float32,)) and is_array(panel, 2, (types.float32,))
                and is_array(c, 2, (types.float32,))):
            return None
        sig = types.void(a, types.intp, types.intp, types.intp, types.intp, panel, types.intp, c,
                         types.intp, types.intp)

        def codegen(context, builder, signature, args):
            arr_a = context.make_array(signature.args[0])(context, builder, args[0])
            arr_p = context.make_array(signature.args[5])(context, builder, args[5])
            arr_c = context.make_array(signature.args[7])(context, builder, args[7])
            intp = context.get_value_type(types.intp)
            i32 = ir.IntType(32)

            def const(value):
                return ir.Constant(intp, value)

            def rows_at(arr, row0, col0, stride, step):
                first = builder.mul(col0, step)
                return [ptr(builder, arr.data, builder.add(
                    builder.mul(builder.add(row0, const(r)), stride), first))
                    for r in range(rows)]

            p_stride = cgutils.unpack_tuple(builder, arr_p.strides, 2)[0]
            c_stride = cgutils.unpack_tuple(builder, arr_c.strides, 2)[0]
            a_step = builder.mul(args[4], const(4))  # bytes from A[i, r] to A[i, r + 1]
            a_rows = rows_at(arr_a, args[1], args[2], builder.mul(args[3], const(4)), a_step)
            c_rows = rows_at(arr_c, args[8], args[9], c_stride, const(4))
            zero_mask = ir.Constant(ir.VectorType(i32, _LANES), [0] * _LANES)
            def one_pass(pass_index, _):
                # byte offsets of the pass's vectors in a panel row and a row of c
                first = builder.mul(pass_index, const(4 * width))
                offsets = [builder.add(first, const(4 * _LANES * v))
                           for v in range(_PASS_VECTORS)]
                if load:
                    initial = [builder.load(ptr(builder, c_rows[r], o, _FVEC), align=4)
                               for r in range(rows) for o in offsets]
                else:
                    initial = [ir.Constant(_FVEC, [0.0] * _LANES)] * (rows * _PASS_VECTORS)

                def step(it, accs):
                    base = builder.mul(it, p_stride)
                    weights = [builder.load(ptr(builder, arr_p.data, builder.add(base, o),
                                                _FVEC), align=4)
                               for o in offsets]
                    new = []
                    for r in range(rows):
                        x = builder.load(ptr(builder, a_rows[r], builder.mul(it, a_step), _F32),
                                         align=4)
                        one = builder.insert_element(ir.Constant(_FVEC, None), x,
                                                     ir.Constant(i32, 0))
                        xb = builder.shuffle_vector(one, ir.Constant(_FVEC, None), zero_mask)
                        for v in range(_PASS_VECTORS):
                            new.append(_fma(builder, xb, weights[v],
                                            accs[r * _PASS_VECTORS + v]))
                    return new

                accs = counted_loop(builder, intp, args[6], initial, step, "ftile")
                for r in range(rows):
                    for v, o in enumerate(offsets):
                        builder.store(accs[r * _PASS_VECTORS + v],
                                      ptr(builder, c_rows[r], o, _FVEC), align=4)
                return []

            # One pass with AVX-512; four with AVX2, as a loop (not unrolled: a quarter of the
            # code for LLVM to compile into every kernel that calls the tiles).
            counted_loop(builder, intp, const(PANEL // width), [], one_pass, "fpass")
            return context.get_dummy_value()

        return sig, codegen

    return tile


# Six rows and fewer for the last rows of a panel; _S* start from zero, _L* from c.
_S1, _S2, _S3, _S4, _S5, _S6 = (fma_tile(r, False) for r in range(1, 7))
_L1, _L2, _L3, _L4, _L5, _L6 = (fma_tile(r, True) for r in range(1, 7))


@numba.njit(cache=True)
def panel_block(a, rows, si, sr, r0, panel, count, c, j0, load):
    """c[:rows, j0:j0 + 64] (+)= A[:rows, r0:r0 + count] @ panel[:count], six rows a tile
    (A read from ``a`` through the strides ``si``, ``sr`` as in ``fma_tile``; ``load``: add to c,
    else overwrite it)."""
    for i0 in range(0, rows, TILE_ROWS):
        r = min(TILE_ROWS, rows - i0)
        if load:
            if r == 6:
                _L6(a, i0, r0, si, sr, panel, count, c, i0, j0)
            elif r == 5:
                _L5(a, i0, r0, si, sr, panel, count, c, i0, j0)
            elif r == 4:
                _L4(a, i0, r0, si, sr, panel, count, c, i0, j0)
            elif r == 3:
                _L3(a, i0, r0, si, sr, panel, count, c, i0, j0)
            elif r == 2:
                _L2(a, i0, r0, si, sr, panel, count, c, i0, j0)
            else:
                _L1(a, i0, r0, si, sr, panel, count, c, i0, j0)
        elif r == 6:
            _S6(a, i0, r0, si, sr, panel, count, c, i0, j0)
        elif r == 5:
            _S5(a, i0, r0, si, sr, panel, count, c, i0, j0)
        elif r == 4:
            _S4(a, i0, r0, si, sr, panel, count, c, i0, j0)
        elif r == 3:
            _S3(a, i0, r0, si, sr, panel, count, c, i0, j0)
        elif r == 2:
            _S2(a, i0, r0, si, sr, panel, count, c, i0, j0)
        else:
            _S1(a, i0, r0, si, sr, panel, count, c, i0, j0)


@numba.njit(parallel=True, cache=True)
def dx_kernel(g, data, bits, K, scale, kc, out):
    """out [M, K] float32 = ``(g @ codes_w.T) * scale`` from packed weight bytes ``data``
    [N, bytes] (``scale`` a float32 scalar; g [M, N] float32 C-contiguous).

    Parallel over panels of 64 input features; each decodes the codes of its features for ``kc``
    weight rows at a time into the panel and runs the row tiles over it, accumulating in a
    [M, 64] scratch tile that is scaled into ``out`` at the end. The panel is field-major (column
    ``f * G + q`` holds feature ``per * q + f``, G = 64 / per): each field of the packed bytes
    decodes in one vectorized pass (a byte-to-codes table ran ~6 ms longer at 256 x 4096 x 4096),
    and the copy out puts the features back in order.
    """
    M, N = g.shape
    nbytes = data.shape[1]
    per = 8 // bits
    G = PANEL // per
    mask = (1 << bits) - 1
    for p in numba.prange((K + PANEL - 1) // PANEL):
        k0 = p * PANEL
        width = min(PANEL, K - k0)
        b0 = k0 // per
        nb = min(PANEL // per, nbytes - b0)
        panel = np.zeros((kc, PANEL), np.float32)  # columns past K stay zero
        c = np.empty((M, PANEL), np.float32)
        for r0 in range(0, N, kc):
            count = min(kc, N - r0)
            for i in range(count):
                row = data[r0 + i, b0:b0 + nb]
                dst = panel[i]
                for f in range(per):
                    seg = dst[f * G:f * G + nb]
                    for q in range(nb):
                        if bits == 8:
                            seg[q] = np.float32(np.int8(row[q]))
                        else:
                            v = (np.int32(row[q]) >> (bits * f)) & mask
                            seg[q] = np.float32(v - 1 if bits == 2 else 2 * v - 1)
            panel_block(g, M, N, 1, r0, panel, count, c, 0, r0 > 0)
        for m in range(M):
            for f in range(per):
                for q in range(G):
                    k = per * q + f
                    if k < width:
                        out[m, k0 + k] = c[m, f * G + q] * scale


@numba.njit(parallel=True, cache=True)
def dw_kernel(a, transposed, g, kc, out):
    """out [K, N] float32 = ``A.T @ g``: A [M, K] (the dequantized activations) held as ``a`` =
    A itself or, with ``transposed``, A.T [K, M]; g [M, N] float32; all C-contiguous.

    Parallel over panels of 64 columns of ``g``, copied ``kc`` rows at a time; the tile rows are
    features k, broadcast from rows of A.T (contiguous) or down columns of A (six adjacent floats
    a step, no transpose needed: cheaper for small A, see ``__init__.DW_TRANSPOSE_MIN``). Whole
    panels accumulate in ``out`` itself (a [K, 64] scratch tile would be written and copied once
    more), the last partial one in a scratch tile.
    """
    K, M = a.shape if transposed else a.shape[::-1]
    si, sr = (M, 1) if transposed else (1, K)
    N = g.shape[1]
    for p in numba.prange((N + PANEL - 1) // PANEL):
        n0 = p * PANEL
        width = min(PANEL, N - n0)
        panel = np.zeros((kc, PANEL), np.float32)
        c = out if width == PANEL else np.empty((K, PANEL), np.float32)
        j0 = n0 if width == PANEL else 0
        for r0 in range(0, M, kc):
            count = min(kc, M - r0)
            for i in range(count):
                for j in range(width):
                    panel[i, j] = g[r0 + i, n0 + j]
            panel_block(a, K, si, sr, r0, panel, count, c, j0, r0 > 0)
        if width < PANEL:
            for k in range(K):
                for j in range(width):
                    out[k, n0 + j] = c[k, j]
