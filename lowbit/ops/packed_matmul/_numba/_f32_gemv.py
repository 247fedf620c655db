"""Few rows of float32 activations times the rows of a matrix stored narrower (int8 codes, bfloat16
or float16 bits, or float32): each element is widened to float32 in registers as its row is read,
so nothing is decoded to memory (decoding a row into a float32 buffer and a second pass over it
took ~25% longer on BitNet 2B's bf16 head, 128256 x 2560). ``matmul_float`` of int8 weights runs it
(below ``F32_GEMV_ROWS`` rows), and so does the BitNet output head
(``lowbit/models/bitnet/_head.py``: the 16-bit tied embedding, or its int8 quantization). The
numba decode attention (``lowbit/ops/segmented_attention/_numba_decode.py``) runs its float32
tiles on the keys (``T_*``: the scores transposed).

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (``matmul_float``; more rows, and
CPUs where ``ready`` is false, decode tiles of the weight to float32 for BLAS), ``_lut_gemv.py``
(the same product for ternary and sign codes), ``_llvm.py`` (the IR helpers). Reference
``reference/packed_matmul.py``.

The sum of one activation row with one stored row runs in 16 lanes: lane ``l`` adds ``x[k] * w[k]``
for ``k = l, l + 16, ...`` in order of ``k`` by fused multiply-adds; then lanes ``l`` and ``l + 8``
are added, then those sums' lanes ``l`` and ``l + 4``, ``l + 2``, ``l + 1``: a tree of fixed shape.
These are LLVM operations on 16-lane vectors, whose results do not depend on how the target splits
them (one zmm register, two ymm, four NEON registers): the same bits on every CPU. The kernel runs
tiles of ``GROUP`` activation rows by ``COLS`` stored rows, one vector of lanes per sum, so that
each vector of x and of w read serves several fused multiply-adds: 16 rows of 6912 x 2560 int8 took
3.4 ms against 6.9 for the previous kernel, which read each stored row once for four activation
rows but summed 64 lanes per pair (16 vector registers for one stored row). An int8 row that ends
inside its last vector of 16 is read on into the next row, whose codes meet activations that are
zero past K and add +-0. A float row could hold an infinity or a NaN, whose product with zero is
NaN, so float rows that end inside a vector, and the last int8 rows (whose vector would end past
the matrix), are copied into a zero-padded row first: a row's result never depends on where it
sits.
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
#: Stored rows of one parallel task.
TASK_ROWS = 16
#: Activation rows of a tile: four with AVX-512's 32 registers (16 accumulators for a tile of
#: four stored rows), else one.
GROUP = 4 if "+avx512f" in _FEATURES else 1
#: Stored rows one read of an activation row serves (a tile is GROUP x COLS sums, each one
#: vector of lanes).
COLS = 4
#: Bytes of stored rows from which rows outside a group of GROUP (all of them at one activation
#: row, or without AVX-512) take one stored row at a time: a matrix read from memory streams
#: faster one row after the next than four rows side by side (one row of BitNet 2B's int8 head,
#: 128256 x 2560 on the 2-core EPYC Zen 4: 9.7 ms against 14.1), one in cache the other way round
#: (6912 x 2560 int8: 0.53 ms against 0.35; a stored row at a time its sums are one chain of
#: fused multiply-adds each).
STREAM_BYTES = 64 << 20
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


def _lane_sums(builder, vectors):
    """The tree sum of each 16-lane vector (lanes ``l`` and ``l + 8``, then ``l + 4``, ``l + 2``,
    ``l + 1``), as scalars: the vectors are reduced in pairs, each step halving the lanes of
    every sum and packing two vectors' halves into one, so that 16 vectors take 15 steps of two
    shuffles and an add (the same additions as one tree per vector, in a quarter of the
    operations)."""
    parts = [(v, [i]) for i, v in enumerate(vectors)]  # (vector, the sums its segments hold)
    width = _LANES  # lanes of one sum's segment
    while width > 1:
        half = width // 2
        if len(parts) % 2:
            parts.append((parts[-1][0], [None] * len(parts[-1][1])))
        paired = []
        for (a, ia), (b, ib) in zip(parts[::2], parts[1::2]):
            lo = [base + s * width + o for base in (0, _LANES) for s in range(_LANES // width)
                  for o in range(half)]
            lo_v, hi_v = (builder.shuffle_vector(a, b, ir.Constant(
                ir.VectorType(_I32, _LANES), [i + shift for i in lo])) for shift in (0, half))
            paired.append((builder.fadd(lo_v, hi_v), ia + ib))
        parts, width = paired, half
    sums = [None] * len(vectors)
    for vector, ids in parts:
        for lane, i in enumerate(ids):
            if i is not None and sums[i] is None:
                sums[i] = builder.extract_element(vector, ir.Constant(_I32, lane))
    return sums


def _tile(rows, cols, transposed=False):
    """Intrinsic ``dot(x, m0, data, n0, step, nvec, scale, stride, out, col0)``: ``out[m0 + r,
    col0 + j] = (sum of x[m0 + r, k] * w[n0 + j step, k] over k < 16 nvec) * scale[(col0 + j)
    stride]`` for ``r < rows``, ``j < cols`` (``transposed``: into ``out[col0 + j, m0 + r]``),
    each sum in the lane order of the module docstring; each element of ``x`` and of ``w`` is
    read (and widened) once for the tile. ``x``: C-contiguous float32 [M, >= 16 nvec]; ``data``:
    C-contiguous, one of ``STORED``'s types, with at least ``16 nvec`` elements from row ``n0 +
    j step`` on; ``scale``, ``out``: C-contiguous float32."""

    @intrinsic
    def dot(typingctx, x, m0, data, n0, step, nvec, scale, stride, out, col0):
        if not (is_array(x, 2, (types.float32,)) and is_array(data, 2, tuple(_KINDS))
                and is_array(scale, 1, (types.float32,))
                and is_array(out, 2, (types.float32,))):
            return None
        sig = types.void(x, types.intp, data, types.intp, types.intp, types.intp, scale,
                         types.intp, out, types.intp)
        kind, element, width = _KINDS[data.dtype]

        def codegen(context, builder, signature, args):
            arr_x, arr_d, arr_s, arr_o = (
                context.make_array(signature.args[i])(context, builder, args[i])
                for i in (0, 2, 6, 8))
            intp = context.get_value_type(types.intp)

            def const(value):
                return ir.Constant(intp, value)

            def row(arr, i):
                return ptr(builder, arr.data, builder.mul(
                    i, cgutils.unpack_tuple(builder, arr.strides, 2)[0]))

            x_rows = [row(arr_x, builder.add(args[1], const(r))) for r in range(rows)]
            d_rows = [row(arr_d, builder.add(args[3], builder.mul(args[4], const(j))))
                      for j in range(cols)]
            stored = ir.VectorType(element, _LANES)

            def step(it, accs):
                k = builder.mul(it, const(_LANES))
                ws = [_widen(builder, builder.load(ptr(builder, d, builder.mul(
                    k, const(width)), stored), align=1), kind) for d in d_rows]
                new = list(accs)
                for r in range(rows):
                    xv = builder.load(ptr(builder, x_rows[r], builder.mul(k, const(4)), _FV),
                                      align=4)
                    for j in range(cols):
                        new[r * cols + j] = _fma(builder, xv, ws[j], new[r * cols + j])
                return new

            zero = ir.Constant(_FV, [0.0] * _LANES)
            accs = counted_loop(builder, intp, args[5], [zero] * (rows * cols), step, "f32dot")
            sums = _lane_sums(builder, accs)
            for r in range(rows):
                m = builder.add(args[1], const(r))
                for j in range(cols):
                    col = builder.add(args[9], const(j))
                    s = builder.load(ptr(builder, arr_s.data, builder.mul(
                        builder.mul(col, args[7]), const(4)), _F32), align=4)
                    at = ((col, m) if transposed else (m, col))
                    builder.store(builder.fmul(sums[r * cols + j], s), ptr(
                        builder, row(arr_o, at[0]), builder.mul(at[1], const(4)), _F32),
                        align=4)
            return context.get_dummy_value()

        return sig, codegen

    return dot


_GC, _1C, _G1, _11 = _tile(GROUP, COLS), _tile(1, COLS), _tile(GROUP, 1), _tile(1, 1)
#: Tiles with ``out`` transposed (``out[col0 + j, m0 + r]``; float32 rows) of four rows by one
#: stored row (8 ymm registers of sums with AVX2) and one by one: the numba decode attention's
#: scores [keys, query rows].
T_41, T_11 = _tile(4, 1, True), _tile(1, 1, True)


@numba.njit(cache=True)
def _rows(x, data, r0, r1, nvec, scale_w, stride, out, col0, narrow):
    """Every activation row against stored rows ``r0 .. r1`` of ``data``, into columns ``col0
    ..`` of out (scaled by ``scale_w`` at those columns, times ``stride``): groups of GROUP (> 1)
    activation rows by COLS stored rows, the other activation rows by COLS stored rows or, when
    ``narrow``, one."""
    M = x.shape[0]
    grouped = M - M % GROUP if GROUP > 1 else 0
    n = r0
    while n < r1:
        col = col0 + n - r0
        if n + COLS <= r1:
            for m in range(0, grouped, GROUP):
                _GC(x, m, data, n, 1, nvec, scale_w, stride, out, col)
            for r in range(grouped, M):
                if narrow:
                    for j in range(COLS):
                        _11(x, r, data, n + j, 1, nvec, scale_w, stride, out, col + j)
                else:
                    _1C(x, r, data, n, 1, nvec, scale_w, stride, out, col)
            n += COLS
        else:
            for m in range(0, grouped, GROUP):
                _G1(x, m, data, n, 1, nvec, scale_w, stride, out, col)
            for r in range(grouped, M):
                _11(x, r, data, n, 1, nvec, scale_w, stride, out, col)
            n += 1


@numba.njit(parallel=True, cache=True)
def _kernel(x, data, nvec, inside, scale_w, out, narrow):
    """out[m, n] = (sum_k x[m, k] * w[n, k]) * scale_w[n or 0]; rows from ``inside`` on go
    through a zero-padded copy; ``narrow``: see ``_rows``."""
    N, K = data.shape
    stride = 1 if scale_w.shape[0] > 1 else 0
    for p in numba.prange((N + TASK_ROWS - 1) // TASK_ROWS):
        n0, n1 = p * TASK_ROWS, min(N, p * TASK_ROWS + TASK_ROWS)
        p0 = max(n0, inside)
        _rows(x, data, n0, min(n1, inside), nvec, scale_w, stride, out, n0, narrow)
        if n1 > p0:
            pad = np.zeros((n1 - p0, nvec * _LANES), data.dtype)
            for n in range(p0, n1):
                pad[n - p0, :K] = data[n]
            _rows(x, pad, 0, n1 - p0, nvec, scale_w, stride, out, p0, narrow)


def gemv(x, data, scale_w, out, dtype="int8"):
    """out [M, N] = ``(x @ w.T) * scale_w`` for float32 ``x`` [M, K] and rows ``w`` [N, K]
    stored in ``data`` (C-contiguous) as ``dtype`` (a ``STORED`` name; float16 and bfloat16 as
    any 2-byte view of their bits); ``scale_w``: float32 [1] or [N]. Where ``ready(dtype)``."""
    M, K = x.shape
    N = data.shape[0]
    data = data.view(STORED[dtype])
    nvec = -(-K // _LANES)
    xp = np.zeros((M, nvec * _LANES), np.float32)
    xp[:, :K] = x
    # Rows whose last vector, read whole, ends inside data; none of a float matrix's rows is
    # read on into its neighbour (an infinity or NaN there times a zero activation is NaN).
    if K % _LANES == 0:
        inside = N
    elif dtype == "int8":
        inside = max(0, N - (nvec * _LANES - 1) // K)
    else:
        inside = 0
    _kernel(xp, data, nvec, inside, np.ascontiguousarray(scale_w, np.float32).reshape(-1), out,
            data.nbytes >= STREAM_BYTES)
    return out
