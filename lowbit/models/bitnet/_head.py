"""The output head and the embedding lookup on a ``Dense`` matrix (16- or 32-bit).

``head_logits(x, head)``: ``x @ head.T`` in float32 for a ``Dense`` head (the tied embedding of a
BitNet checkpoint, kept in its 16-bit precision: it is a decode step's largest single read), or
``x @ codes * scale`` for ``quantize_head``'s int8 ``PackedWeight`` (float activations: the
logits keep their precision).

Numba runs a row-parallel GEMV over the 16-bit (or int8) rows for few rows of ``x`` (decode);
more rows (prefill) and the numpy backend decode blocks of rows to float32 and call the BLAS
(the int8 head: ``lowbit.packed_matmul`` without activation quantization); cupy arrays take the
same blocked path on the GPU.
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


def _gemv_kernel(dtype: str):
    """``out[m, v] = sum_k float32(w[v, k]) * x[m, k]`` over bf16 (uint16), f16 or f32 rows."""
    if dtype in _kernels:
        return _kernels[dtype]
    import numba

    @numba.njit(parallel=True, cache=True, fastmath={"contract", "reassoc"})
    def gemv_bf16(x, w, out):
        M, K = x.shape
        V = w.shape[0]
        chunk = 64
        for c in numba.prange((V + chunk - 1) // chunk):
            bits = np.empty(K, np.uint32)
            for v in range(c * chunk, min(V, c * chunk + chunk)):
                for k in range(K):
                    bits[k] = np.uint32(w[v, k]) << np.uint32(16)
                row = bits.view(np.float32)
                for m in range(M):
                    acc = np.float32(0.0)
                    for k in range(K):
                        acc += row[k] * x[m, k]
                    out[m, v] = acc

    @numba.njit(parallel=True, cache=True, fastmath={"contract", "reassoc"})
    def gemv_f16(x, w, out):
        # w: the float16 bits as uint16 (numba has no float16); decoded exactly to float32
        M, K = x.shape
        V = w.shape[0]
        chunk = 64
        for c in numba.prange((V + chunk - 1) // chunk):
            bits = np.empty(K, np.uint32)
            for v in range(c * chunk, min(V, c * chunk + chunk)):
                for k in range(K):
                    h = np.uint32(w[v, k])
                    e = (h >> np.uint32(10)) & np.uint32(31)
                    m = h & np.uint32(1023)
                    s = (h & np.uint32(0x8000)) << np.uint32(16)
                    if e == 0:  # zero or subnormal: m * 2^-24, exact in float32
                        f = np.float32(m) * np.float32(5.9604644775390625e-08)
                        bits[k] = s | np.asarray(f).view(np.uint32)[()]
                    elif e == 31:
                        bits[k] = s | np.uint32(0x7F800000) | (m << np.uint32(13))
                    else:
                        bits[k] = s | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
                row = bits.view(np.float32)
                for m_ in range(M):
                    acc = np.float32(0.0)
                    for k in range(K):
                        acc += row[k] * x[m_, k]
                    out[m_, v] = acc

    @numba.njit(parallel=True, cache=True, fastmath={"contract", "reassoc"})
    def gemv_f32(x, w, out):
        M, K = x.shape
        V = w.shape[0]
        for v in numba.prange(V):
            for m in range(M):
                acc = np.float32(0.0)
                for k in range(K):
                    acc += w[v, k] * x[m, k]
                out[m, v] = acc

    @numba.njit(parallel=True, cache=True, fastmath={"contract", "reassoc"})
    def gemv_i8(x, w, scale, out):
        # out[m, v] = (sum_k x[m, k] * float32(w[v, k])) * scale[v]: quantize_head's rows
        M, K = x.shape
        V = w.shape[0]
        for v in numba.prange(V):
            for m in range(M):
                acc = np.float32(0.0)
                for k in range(K):
                    acc += np.float32(w[v, k]) * x[m, k]
                out[m, v] = acc * scale[v]

    _kernels.update(bfloat16=gemv_bf16, float16=gemv_f16, float32=gemv_f32, int8=gemv_i8)
    return _kernels[dtype]


def head_logits(x: Array, head: Dense | PackedWeight) -> Array:
    """Logits [M, vocab] float32 of final hidden states ``x`` [M, hidden] float32."""
    xp = _backend.array_module(x, head.data)
    M = x.shape[0]
    backend = _dispatch.select_backend(x, head.data)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    if isinstance(head, PackedWeight):
        if backend == "numba" and M <= GEMV_ROWS:
            out = np.empty((M, head.shape[1]), np.float32)
            _gemv_kernel("int8")(x, head.data, head.scale, out)
            return out
        return packed_matmul(x, head, act_format=None)
    V = head.shape[0]
    if backend == "numba" and M <= GEMV_ROWS:
        out = np.empty((M, V), np.float32)
        data = head.data.view(np.uint16) if head.dtype == "float16" else head.data
        _gemv_kernel(head.dtype)(x, data, out)
        return out
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
