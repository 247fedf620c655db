"""The output head and the embedding lookup on a ``Dense`` matrix (16- or 32-bit).

``head_logits(x, head)``: ``x @ head.T`` in float32 for a ``Dense`` head (the tied embedding of a
BitNet checkpoint, kept in its 16-bit precision: it is a decode step's largest single read), or
``x @ codes * scale`` for ``quantize_head``'s int8 ``PackedWeight`` (float activations: the
logits keep their precision).

Numba runs a row-parallel GEMV over the 16-bit (or int8) rows for few rows of ``x`` (decode:
below ``lowbit.ops.packed_matmul._numba.F32_GEMV_ROWS``, as for the int8 weights' forward),
each row widened to float32 in registers as it is read (the packed matmul's
``_numba/_f32_gemv.py``, which also runs its int8 weights with float activations); more rows
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

#: Head rows decoded to float32 per BLAS call on the blocked path.
BLOCK_ROWS = 4096


def head_logits(x: Array, head: Dense | PackedWeight) -> Array:
    """Logits [M, vocab] float32 of final hidden states ``x`` [M, hidden] float32."""
    xp = _backend.array_module(x, head.data)
    M = x.shape[0]
    backend = _dispatch.select_backend(x, head.data)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    dtype = "int8" if isinstance(head, PackedWeight) else head.dtype
    if backend == "numba":
        from ...ops.packed_matmul._numba import F32_GEMV_ROWS, _f32_gemv

        if M < F32_GEMV_ROWS and _f32_gemv.ready(dtype):
            scale = head.scale if isinstance(head, PackedWeight) else np.ones(1, np.float32)
            return _f32_gemv.gemv(x, np.ascontiguousarray(head.data), scale,
                                  np.empty((M, head.data.shape[0]), np.float32), dtype)
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
