"""Few rows of float32 activations times the rows of a matrix stored narrower (int8 codes,
bfloat16 or float16 bits, or float32): each element is widened to float32 in registers as its
row is read, so nothing is decoded to memory (decoding a row into a float32 buffer and a second
pass over it took ~25% longer on BitNet 2B's bf16 head, 128256 x 2560). ``matmul_float`` of int8 weights runs it (below
``F32_GEMV_ROWS`` rows), and so does the BitNet output head (``lowbit/models/bitnet/_head.py``:
the 16-bit tied embedding, or its int8 quantization).

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (``matmul_float``; more rows,
and CPUs where ``ready`` is false, decode tiles of the weight to float32 for BLAS),
``_lut_gemv.py`` (the same product for ternary and sign codes), ``_llvm.py`` (the IR helpers).
Reference ``reference/packed_matmul.py``.

The sum of one activation row with one stored row runs in 64 lanes: lane ``l`` adds ``x[k] *
w[k]`` for ``k = l, l + 64, ...`` in order of ``k`` by fused multiply-adds; then lanes ``l`` and
``l + 32`` are added, then those sums' lanes ``l`` and ``l + 16``, ``l + 8``, ``l + 4``, ``l +
2``, ``l + 1``: a tree of fixed shape. These are LLVM vector operations on four 16-lane vectors,
whose results do not depend on how the target splits them (one zmm register, two ymm, four NEON
registers): the same bits on every CPU. An int8 row that ends inside its last block of 64 is
read on into the next row, whose codes meet activations that are zero past K and add +-0. A
float row could hold an infinity or a NaN, whose product with zero is NaN, so float rows that end
inside a block, and the last int8 rows (whose block would end past the matrix), are copied into
a zero-padded row first: a row's result never depends on where it sits. With AVX-512 (32
registers) a read of a row serves four activation rows.
"""

import platform

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._llvm import counted_loop, host_features, is_array, ptr

_FEATURES = host_features()
_ARM = platform.machine().lower() in ("aarch64", "arm64")
#: Whether the kernel runs here: compiled code (no ``NUMBA_DISABLE_JIT``) on a CPU with fused
#: multiply-adds in hardware (x86 FMA3, every 64-bit ARM CPU; elsewhere ``llvm.fma`` would be a
#: library call per element).
AVAILABLE = bool(_FEATURES) and ("+fma" in _FEATURES or _ARM)
#: Elements of a row per loop iteration (the lanes of the sum).
BLOCK = 64
#: Stored rows of one parallel task.
TASK_ROWS = 16
#: Activation rows one read of a stored row serves: four with AVX-512's 32 registers (16
#: accumulators), else one.
GROUP = 4 if "+avx512f" in _FEATURES else 1
#: The element types the kernel takes, by the name of what they hold (float16 and bfloat16 as
#: their bits: Numba has no 16-bit float arrays).
STORED = {"int8": np.int8, "bfloat16": np.uint16, "float16": np.int16, "float32": np.float32}

_LANES = 16
_F32, _I32 = ir.FloatType(), ir.IntType(32)
_FV = ir.VectorType(_F32, _LANES)
_KINDS = {types.int8: ("int8", ir.IntType(8), 1), types.uint16: ("bfloat16", ir.IntType(16), 2),
          types.int16: ("float16", ir.IntType(16), 2), types.float32: ("float32", _F32, 4)}


def ready(dtype):
    """Whether ``gemv`` runs for rows of ``dtype`` (a ``STORED`` name) on this CPU: ``AVAILABLE``
    and, for float16, a CPU that widens half floats in hardware (x86 F16C, 64-bit ARM)."""
    return AVAILABLE and (dtype != "float16" or "+f16c" in _FEATURES or _ARM)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FV, [_FV] * 3),
                                        "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _widen(builder, v, kind):
    """float32 lanes of a vector of stored elements."""
    if kind == "int8":
        return builder.sitofp(v, _FV)
    if kind == "bfloat16":
        return builder.bitcast(builder.shl(builder.zext(v, ir.VectorType(_I32, _LANES)),
                                           ir.Constant(ir.VectorType(_I32, _LANES),
                                                       [16] * _LANES)), _FV)
    if kind == "float16":
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), _LANES)), _FV)
    return v


def _dot_rows(rows):
    """Intrinsic ``dot(x, m0, data, n, nvec, s, out, col)``: ``out[m0 + r, col] = (sum of
    x[m0 + r, k] * w[n, k] over k < 64 nvec) * s`` for ``r < rows``, each sum in the lane order
    of the module docstring; every element is widened once for all rows. ``x``: C-contiguous
    float32 [M, >= 64 nvec]; ``data``: C-contiguous, one of ``STORED``'s types, with at least
    ``64 nvec`` elements from row ``n`` on; ``out``: C-contiguous float32."""

    @intrinsic
    def dot(typingctx, x, m0, data, n, nvec, s, out, col):
        if not (is_array(x, 2, (types.float32,)) and is_array(data, 2, tuple(_KINDS))
                and is_array(out, 2, (types.float32,))):
            return None
        sig = types.void(x, types.intp, data, types.intp, types.intp, types.float32, out,
                         types.intp)
        kind, element, width = _KINDS[data.dtype]

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
            stored = ir.VectorType(element, _LANES)

            def step(it, accs):
                first = builder.mul(it, const(BLOCK))
                new = list(accs)
                for v in range(vectors):
                    k = builder.add(first, const(v * _LANES))
                    w = _widen(builder, builder.load(
                        ptr(builder, d_row, builder.mul(k, const(width)), stored), align=1), kind)
                    for r in range(rows):
                        xv = builder.load(ptr(builder, x_rows[r], builder.mul(k, const(4)), _FV),
                                          align=4)
                        i = r * vectors + v
                        new[i] = _fma(builder, xv, w, new[i])
                return new

            zero = ir.Constant(_FV, [0.0] * _LANES)
            accs = counted_loop(builder, intp, args[4], [zero] * (rows * vectors), step,
                                "f32dot")
            for r in range(rows):
                v = accs[r * vectors:(r + 1) * vectors]
                lanes = builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))
                half = _LANES
                while half > 1:  # lanes l and l + half / 2, down to one
                    half //= 2
                    lo, hi = (builder.shuffle_vector(lanes, lanes, ir.Constant(
                        ir.VectorType(_I32, half), list(range(o, o + half))))
                        for o in (0, half))
                    lanes = builder.fadd(lo, hi)
                total = builder.extract_element(lanes, ir.Constant(_I32, 0))
                at = ptr(builder, row(arr_o, builder.add(args[1], const(r))),
                         builder.mul(args[7], const(4)), _F32)
                builder.store(builder.fmul(total, args[5]), at, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return dot


_DOT1, _DOTG = _dot_rows(1), _dot_rows(GROUP)


@numba.njit(cache=True)
def _row(x, data, n, nvec, s, out, col):
    """Every activation row against stored row ``n`` of ``data``, into column ``col`` of out."""
    M = x.shape[0]
    m = 0
    while m + GROUP <= M:
        _DOTG(x, m, data, n, nvec, s, out, col)
        m += GROUP
    for r in range(m, M):
        _DOT1(x, r, data, n, nvec, s, out, col)


@numba.njit(parallel=True, cache=True)
def _kernel(x, data, nvec, inside, scale_w, out):
    """out[m, n] = (sum_k x[m, k] * w[n, k]) * scale_w[n or 0]; rows from ``inside`` on go
    through a zero-padded copy."""
    N, K = data.shape
    stride = 1 if scale_w.shape[0] > 1 else 0
    for p in numba.prange((N + TASK_ROWS - 1) // TASK_ROWS):
        n0, n1 = p * TASK_ROWS, min(N, p * TASK_ROWS + TASK_ROWS)
        for n in range(n0, min(n1, inside)):
            _row(x, data, n, nvec, scale_w[n * stride], out, n)
        if n1 > inside:
            pad = np.zeros((1, nvec * BLOCK), data.dtype)
            for n in range(max(n0, inside), n1):
                pad[0, :K] = data[n]
                _row(x, pad, 0, nvec, scale_w[n * stride], out, n)


def gemv(x, data, scale_w, out, dtype="int8"):
    """out [M, N] = ``(x @ w.T) * scale_w`` for float32 ``x`` [M, K] and rows ``w`` [N, K]
    stored in ``data`` (C-contiguous) as ``dtype`` (a ``STORED`` name; float16 and bfloat16 as
    any 2-byte view of their bits); ``scale_w``: float32 [1] or [N]. Where ``ready(dtype)``."""
    M, K = x.shape
    N = data.shape[0]
    data = data.view(STORED[dtype])
    nvec = -(-K // BLOCK)
    xp = np.zeros((M, nvec * BLOCK), np.float32)
    xp[:, :K] = x
    # Rows whose last block, read whole, ends inside data; none of a float matrix's rows is
    # read on into its neighbour (an infinity or NaN there times a zero activation is NaN).
    if K % BLOCK == 0:
        inside = N
    elif dtype == "int8":
        inside = max(0, N - (nvec * BLOCK - 1) // K)
    else:
        inside = 0
    _kernel(xp, data, nvec, inside, np.ascontiguousarray(scale_w, np.float32).reshape(-1), out)
    return out
