"""The output head and the embedding lookup on a ``Dense`` matrix (16- or 32-bit).

``head_logits(x, head)``: ``x @ head.T`` in float32 for a ``Dense`` head (the tied embedding of a
BitNet checkpoint, kept in its 16-bit precision: it is a decode step's largest single read), or
``x @ codes * scale`` for ``quantize_head``'s int8 ``PackedWeight`` (float activations: the
logits keep their precision).

Numba runs a row-parallel GEMV over the 16-bit (or int8) rows for few rows of ``x`` (decode),
each row widened to float32 in registers as it is read (``_dot_intrinsic``); more rows
(prefill) and the numpy backend decode blocks of rows to float32 and call the BLAS (the int8
head: ``lowbit.packed_matmul`` without activation quantization); cupy arrays take the same
blocked path on the GPU.
"""

from __future__ import annotations

import numpy as np

from ... import _backend, _dispatch
from ..._typing import Array
from ...ops.packed_matmul import packed_matmul
from ...ops.quantize import PackedWeight, quantize_weight
from ._params import Dense

#: Rows of ``x`` up to which numba's GEMV runs (above it, the blocked BLAS path).
GEMV_ROWS = 8
#: Head rows decoded to float32 per BLAS call on the blocked path.
BLOCK_ROWS = 4096

_kernels: dict[str, object] = {}

#: Elements of a head row per step of the GEMV's dot product (four vectors of sixteen lanes).
STEP = 64


def _dot_intrinsic(dtype: str):
    """Numba intrinsic ``dot(w, x) -> float32``: ``sum_k float32(w[k]) * x[k]`` of a head row
    ``w`` (bfloat16 or float16 bits as uint16, float32 or int8) and float32 ``x``, both
    C-contiguous 1-D of the same length. Each element is widened to float32 in the register it
    was loaded into (bfloat16: zero-extend and shift; float16: ``fpext``; int8: ``sitofp``), so
    the row is read once (a decode of the row into a float32 buffer and a second pass over it
    took ~25% longer on BitNet 2B's bf16 head, 128256 x 2560). Four accumulator vectors of fused
    multiply-adds over ``STEP`` elements a step, reduced once, then the last ``len % STEP``
    elements one at a time."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from ...ops.packed_matmul._numba._llvm import counted_loop, ptr

    f32, i32 = ir.FloatType(), ir.IntType(32)
    lanes = 16
    fvec = ir.VectorType(f32, lanes)
    width = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1}[dtype]
    stored = {"bfloat16": ir.IntType(16), "float16": ir.HalfType(), "float32": f32,
              "int8": ir.IntType(8)}[dtype]

    def widen(builder, v, count):
        """float32 of ``v``: one stored element (``count`` 0) or a vector of ``count``."""
        to = ir.VectorType(f32, count) if count else f32
        if dtype == "bfloat16":
            wide = builder.zext(v, ir.VectorType(i32, count) if count else i32)
            sixteen = ir.Constant(wide.type, [16] * count if count else 16)
            return builder.bitcast(builder.shl(wide, sixteen), to)
        if dtype == "float16":
            return builder.fpext(v, to)
        if dtype == "int8":
            return builder.sitofp(v, to)
        return v

    @intrinsic
    def dot(typingctx, w, x):
        sig = types.float32(w, x)

        def codegen(context, builder, signature, args):
            aw = context.make_array(signature.args[0])(context, builder, args[0])
            ax = context.make_array(signature.args[1])(context, builder, args[1])
            intp = context.get_value_type(types.intp)
            size = cgutils.unpack_tuple(builder, aw.shape, 1)[0]
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(fvec, [fvec] * 3), "llvm.fma.v16f32")

            def step(it, accs):
                new = []
                for u, acc in enumerate(accs):
                    k = builder.add(builder.mul(it, ir.Constant(intp, STEP)),
                                    ir.Constant(intp, lanes * u))
                    wv = builder.load(ptr(builder, aw.data, builder.mul(
                        k, ir.Constant(intp, width)), ir.VectorType(stored, lanes)), align=1)
                    xv = builder.load(ptr(builder, ax.data, builder.mul(
                        k, ir.Constant(intp, 4)), fvec), align=4)
                    new.append(builder.call(fma, [widen(builder, wv, lanes), xv, acc]))
                return new

            zero = ir.Constant(fvec, [0.0] * lanes)
            steps = builder.sdiv(size, ir.Constant(intp, STEP))
            accs = counted_loop(builder, intp, steps, [zero] * (STEP // lanes), step, "hdot")
            total = builder.fadd(builder.fadd(accs[0], accs[1]), builder.fadd(accs[2], accs[3]))
            reduce = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f32, [f32, fvec]), "llvm.vector.reduce.fadd.v16f32")
            head = builder.call(reduce, [ir.Constant(f32, 0.0), total], fastmath=("reassoc",))
            first = builder.mul(steps, ir.Constant(intp, STEP))

            def tail(it, acc):
                k = builder.add(first, it)
                wk = builder.load(ptr(builder, aw.data, builder.mul(k, ir.Constant(intp, width)),
                                      stored), align=1)
                xk = builder.load(ptr(builder, ax.data, builder.mul(k, ir.Constant(intp, 4)),
                                      f32), align=4)
                return [builder.fadd(acc[0], builder.fmul(widen(builder, wk, 0), xk))]

            return counted_loop(builder, intp, builder.sub(size, first), [head], tail,
                                "htail")[0]

        return sig, codegen

    return dot


def _gemv_ready(dtype: str) -> bool:
    """Whether numba's GEMV runs for a head of ``dtype``: compiled code whose target is known
    (``_llvm.host_features`` is empty under ``NUMBA_DISABLE_JIT``, where intrinsics do not
    exist) and, for float16, a CPU that widens half floats in hardware (x86 F16C, every 64-bit
    ARM CPU); else the blocked BLAS path."""
    import platform

    from ...ops.packed_matmul._numba import _llvm

    features = _llvm.host_features()
    if not features:
        return False
    return dtype != "float16" or ("+f16c" in features
                                  or platform.machine().lower() in ("aarch64", "arm64"))


def _gemv_kernel(dtype: str):
    """``out[m, v] = (sum_k float32(w[v, k]) * x[m, k]) * scale[v]`` over bf16 (uint16), f16,
    f32 or int8 rows (``scale``: [V] float32, or [1] for none: 1.0), parallel over groups of
    rows, one ``_dot_intrinsic`` pass per row and row of ``x`` plus a scalar tail."""
    if dtype in _kernels:
        return _kernels[dtype]
    import numba

    from ...ops.packed_matmul._numba import _llvm

    # The intrinsic is emitted with the IR helpers of ``_llvm.py``, on which Numba's cache of
    # this file's kernels is not keyed.
    _backend.numba_cache_guard(__file__, _llvm.__file__)
    dot = _dot_intrinsic(dtype)

    @numba.njit(parallel=True, cache=True)
    def gemv(x, w, scale, out):
        M = x.shape[0]
        V = w.shape[0]
        chunk = 16
        per_row = scale.shape[0] > 1
        for c in numba.prange((V + chunk - 1) // chunk):
            for v in range(c * chunk, min(V, c * chunk + chunk)):
                for m in range(M):
                    out[m, v] = dot(w[v], x[m]) * scale[v if per_row else 0]

    _kernels[dtype] = gemv
    return gemv


def head_logits(x: Array, head: Dense | PackedWeight) -> Array:
    """Logits [M, vocab] float32 of final hidden states ``x`` [M, hidden] float32."""
    xp = _backend.array_module(x, head.data)
    M = x.shape[0]
    backend = _dispatch.select_backend(x, head.data)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    dtype = "int8" if isinstance(head, PackedWeight) else head.dtype
    if backend == "numba" and M <= GEMV_ROWS and _gemv_ready(dtype):
        out = np.empty((M, head.data.shape[0]), np.float32)
        data = head.data.view(np.uint16) if dtype == "float16" else head.data
        scale = head.scale if isinstance(head, PackedWeight) else np.ones(1, np.float32)
        _gemv_kernel(dtype)(x, data, np.ascontiguousarray(scale, dtype=np.float32).reshape(-1),
                            out)
        return out
    if isinstance(head, PackedWeight):
        return packed_matmul(x, head, act_format=None)
    V = head.shape[0]
    out = xp.empty((M, V), xp.float32)
    for v0 in range(0, V, BLOCK_ROWS):
        v1 = min(V, v0 + BLOCK_ROWS)
        out[:, v0:v1] = x @ head.float32(slice(v0, v1)).T
    return out


def embed(ids: Array, table: Dense) -> Array:
    """Rows ``ids`` of the embedding, float32 [len(ids), hidden]."""
    return table.float32(ids)


def quantize_head(head: Dense) -> PackedWeight:
    """An int8 per-row head (``lowbit.quantize_weight``'s "int8": one scale per vocabulary row,
    the largest magnitude of that row over 127), of shape (hidden, vocab)."""
    xp = _backend.array_module(head.data)
    V, H = head.shape
    codes = xp.empty((V, H), xp.int8)
    scales = xp.empty(V, xp.float32)
    for v0 in range(0, V, BLOCK_ROWS):  # by blocks: no float32 copy of the whole matrix
        v1 = min(V, v0 + BLOCK_ROWS)
        pw = quantize_weight(head.float32(slice(v0, v1)).T, "int8")
        codes[v0:v1] = pw.data
        scales[v0:v1] = pw.scale
    return PackedWeight("int8", (H, V), codes, scales)
