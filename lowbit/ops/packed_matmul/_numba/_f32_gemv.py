"""Few rows of float32 activations times int8 weight codes (``matmul_float`` of int8 weights,
``act_format=None``) on AVX2 or AVX-512: each code is converted to float32 in registers as its
weight row is read, so nothing is decoded to memory.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (``matmul_float``, which runs
this below ``F32_GEMV_ROWS`` rows where ``AVAILABLE``; more rows, and other CPUs, decode tiles of
the weight to float32 for BLAS), ``_lut_gemv.py`` (the same product for ternary and sign codes),
``_llvm.py`` (the IR helpers). Reference ``reference/packed_matmul.py``.

The sum of one activation row with one weight row runs in 64 lanes: lane ``l`` adds ``x[k] *
code[k]`` for ``k = l, l + 64, ...`` in order of ``k`` by fused multiply-adds, on four 16-lane
(AVX-512) or eight 8-lane (AVX2) vectors; then lanes ``l`` and ``l + 32`` are added, those sums'
lanes ``l`` and ``l + 16``, and the 16 results in order. Both widths do the same operations in the
same order: the same bits. A row ends inside its last block of 64 codes with the activations
zero past K (the row is read on into the next one, whose codes meet those zeros and add +-0);
the last rows, whose block would end past the weight, are copied into a zero-padded row first,
so a row's result never depends on where it sits.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import counted_loop, host_features, is_array, ptr

_FEATURES = host_features()
_WIDE = "+avx512f" in _FEATURES
#: Whether this kernel runs here: AVX-512F, or AVX2 with FMA.
AVAILABLE = _WIDE or {"+avx2", "+fma"} <= _FEATURES
#: Codes of a weight row per loop iteration (the lanes of the sum).
BLOCK = 64
#: Weight rows of one parallel task.
TASK_ROWS = 16

_LANES = 16 if _WIDE else 8
_F32 = ir.FloatType()
_FV = ir.VectorType(_F32, _LANES)


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module,
                                        ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _dot_rows(rows):
    """Intrinsic ``dot(x, m0, data, n, nvec, s, out, col)``: ``out[m0 + r, col] = (sum of
    x[m0 + r, k] * data[n, k] over k < 64 nvec) * s`` for ``r < rows``, each sum in the lane
    order of the module docstring; every code is converted once for all rows. ``x``:
    C-contiguous float32 [M, >= 64 nvec]; ``data``: C-contiguous int8 with at least ``64 nvec``
    bytes from row ``n`` on; ``out``: C-contiguous float32."""

    @intrinsic
    def dot(typingctx, x, m0, data, n, nvec, s, out, col):
        if not (is_array(x, 2, (types.float32,)) and is_array(data, 2, (types.int8,))
                and is_array(out, 2, (types.float32,))):
            return None
        sig = types.void(x, types.intp, data, types.intp, types.intp, types.float32, out,
                         types.intp)

        def codegen(context, builder, signature, args):
            arr_x, arr_d, arr_o = (context.make_array(signature.args[i])(context, builder,
                                                                         args[i])
                                   for i in (0, 2, 6))
            intp = context.get_value_type(types.intp)

            def const(value):
                return ir.Constant(intp, value)

            def row(arr, i):
                return ptr(builder, arr.data, builder.mul(
                    i, cgutils.unpack_tuple(builder, arr.strides, 2)[0]))

            x_rows = [row(arr_x, builder.add(args[1], const(r))) for r in range(rows)]
            d_row = row(arr_d, args[3])
            vectors = BLOCK // _LANES
            codes = ir.VectorType(ir.IntType(8), _LANES)

            def step(it, accs):
                first = builder.mul(it, const(BLOCK))
                new = list(accs)
                for v in range(vectors):
                    k = builder.add(first, const(v * _LANES))
                    w = builder.sitofp(builder.load(ptr(builder, d_row, k, codes), align=1), _FV)
                    for r in range(rows):
                        xv = builder.load(ptr(builder, x_rows[r], builder.mul(k, const(4)), _FV),
                                          align=4)
                        i = r * vectors + v
                        new[i] = _call(builder, f"llvm.fma.v{_LANES}f32", _FV, [xv, w, new[i]])
                return new

            zero = ir.Constant(_FV, [0.0] * _LANES)
            accs = counted_loop(builder, intp, args[4], [zero] * (rows * vectors), step,
                                "f32dot")
            for r in range(rows):
                v = accs[r * vectors:(r + 1) * vectors]
                half = vectors // 2
                v = [builder.fadd(v[i], v[i + half]) for i in range(half)]  # lanes l, l + 32
                quarter = half // 2
                v = [builder.fadd(v[i], v[i + quarter]) for i in range(quarter)]  # l, l + 16
                total = ir.Constant(_F32, -0.0)  # ordered: (((-0 + lane 0) + lane 1) + ...)
                for part in v:
                    total = _call(builder, f"llvm.vector.reduce.fadd.v{_LANES}f32", _F32,
                                  [total, part])
                at = ptr(builder, row(arr_o, builder.add(args[1], const(r))),
                         builder.mul(args[7], const(4)), _F32)
                builder.store(builder.fmul(total, args[5]), at, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return dot


#: Activation rows one read of a weight row serves: four with AVX-512's 32 registers (16
#: accumulators), one with AVX2's 16.
GROUP = 4 if _WIDE else 1
_DOT1, _DOTG = _dot_rows(1), _dot_rows(GROUP)


@numba.njit(cache=True)
def _row(x, data, n, nvec, s, out, col):
    """Every activation row against weight row ``n`` of ``data``, into column ``col`` of out."""
    M = x.shape[0]
    m = 0
    while m + GROUP <= M:
        _DOTG(x, m, data, n, nvec, s, out, col)
        m += GROUP
    for r in range(m, M):
        _DOT1(x, r, data, n, nvec, s, out, col)


@numba.njit(parallel=True, cache=True)
def _kernel(x, data, nvec, inside, scale_w, out):
    """out[m, n] = (sum_k x[m, k] * data[n, k]) * scale_w[n or 0]; rows from ``inside`` on go
    through a zero-padded copy."""
    N, K = data.shape
    stride = 1 if scale_w.shape[0] > 1 else 0
    for p in numba.prange((N + TASK_ROWS - 1) // TASK_ROWS):
        for n in range(p * TASK_ROWS, min(N, p * TASK_ROWS + TASK_ROWS)):
            if n < inside:
                _row(x, data, n, nvec, scale_w[n * stride], out, n)
            else:
                pad = np.zeros((1, nvec * BLOCK), np.int8)
                pad[0, :K] = data[n]
                _row(x, pad, 0, nvec, scale_w[n * stride], out, n)


def gemv(x, data, scale_w, out):
    """out [M, N] = ``(x @ codes_w) * scale_w`` for float32 ``x`` [M, K] and int8 codes ``data``
    [N, K] (C-contiguous); ``scale_w``: float32 [1] or [N]."""
    M, K = x.shape
    N = data.shape[0]
    nvec = -(-K // BLOCK)
    xp = np.zeros((M, nvec * BLOCK), np.float32)
    xp[:, :K] = x
    # rows whose last block, read whole, ends inside data
    inside = N if K % BLOCK == 0 else max(0, N - (nvec * BLOCK - 1) // K)
    _kernel(xp, data, nvec, inside, scale_w, out)
    return out
