"""Portable GEMV of the numba packed matmul: a few rows, each packed weight byte read once.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (the backend functions; it
runs this GEMV where ``_vnni.py`` cannot), ``_decode.py`` (``field_major``, the planes),
``_gemm_f64.py``, ``_backward.py``, ``_vnni.py``.

The activation codes are laid out as int16 "planes", ``plane[j][g] = codes_x[per * g + j]``, and
each stored field of a weight byte multiplies its plane in plain loops that LLVM vectorizes. With
stored codes ``c`` (ternary ``code + 1``, sign the bit) the kernels sum ``raw = sum codes_x * c``;
the signed result follows from the row sum of the codes: ternary ``acc = raw - sum(codes_x)``,
sign ``acc = 2 raw - sum(codes_x)``. int8 weights are the codes.
"""

import numba
import numpy as np

from ...quantize import WEIGHT_FORMATS as _BITS
from ._decode import field_major


# Products of int16-cast operands summed in int32: LLVM turns this form into vpmaddwd (16-bit
# multiply, pairwise add into 32 bits; 11% faster than int16 products, measured); without the
# casts Numba widens integer arithmetic to int64, several times slower. Each row's dot product is
# its own function: inlined into the row loop, the reduction over bytes did not vectorize (4x
# slower).


@numba.njit(cache=True)
def _dot2(p0, p1, p2, p3, row):
    three = np.int16(3)
    acc = np.int32(0)
    for g in range(row.shape[0]):
        b = np.int16(row[g])
        acc = np.int32(acc + np.int32(p0[g]) * np.int32(b & three)
                       + np.int32(p1[g]) * np.int32((b >> np.int16(2)) & three)
                       + np.int32(p2[g]) * np.int32((b >> np.int16(4)) & three)
                       + np.int32(p3[g]) * np.int32(b >> np.int16(6)))
    return acc


@numba.njit(cache=True)
def _dot1(pl, row):
    one = np.int16(1)
    acc = np.int32(0)
    for g in range(row.shape[0]):
        b = np.int16(row[g])
        acc = np.int32(acc + np.int32(pl[0, g]) * np.int32(b & one)
                       + np.int32(pl[1, g]) * np.int32((b >> np.int16(1)) & one)
                       + np.int32(pl[2, g]) * np.int32((b >> np.int16(2)) & one)
                       + np.int32(pl[3, g]) * np.int32((b >> np.int16(3)) & one)
                       + np.int32(pl[4, g]) * np.int32((b >> np.int16(4)) & one)
                       + np.int32(pl[5, g]) * np.int32((b >> np.int16(5)) & one)
                       + np.int32(pl[6, g]) * np.int32((b >> np.int16(6)) & one)
                       + np.int32(pl[7, g]) * np.int32(b >> np.int16(7)))
    return acc


@numba.njit(cache=True)
def _dot8(xr, row):
    acc = np.int32(0)
    for k in range(row.shape[0]):
        acc = np.int32(acc + np.int32(np.int16(xr[k])) * np.int32(np.int16(row[k])))
    return acc


@numba.njit(parallel=True, cache=True)
def _gemv2(planes, data, out):
    """out[m, n] = sum_g sum_j planes[m, j, g] * field_j(data[n, g]) for 2-bit fields."""
    M = planes.shape[0]
    for n in numba.prange(data.shape[0]):
        for m in range(M):
            out[m, n] = _dot2(planes[m, 0], planes[m, 1], planes[m, 2], planes[m, 3], data[n])


@numba.njit(parallel=True, cache=True)
def _gemv1(planes, data, out):
    """As ``_gemv2`` for 1-bit fields (8 planes)."""
    M = planes.shape[0]
    for n in numba.prange(data.shape[0]):
        for m in range(M):
            out[m, n] = _dot1(planes[m], data[n])


@numba.njit(parallel=True, cache=True)
def _gemv8(codes_x, data, out):
    """out[m, n] = sum_k codes_x[m, k] * data[n, k] (int8 weights)."""
    M = codes_x.shape[0]
    for n in numba.prange(data.shape[0]):
        for m in range(M):
            out[m, n] = _dot8(codes_x[m], data[n])


def gemv_acc(codes_x, data, format):
    """Exact int32 ``codes_x @ codes_w`` [M, N] for few rows."""
    M, K = codes_x.shape
    N = data.shape[0]
    acc = np.empty((M, N), dtype=np.int32)
    if M == 0:  # no rows: nothing to sum (and no plane layout to reshape)
        return acc
    if format == "int8":
        _gemv8(codes_x, data, acc)
        return acc
    per = 8 // _BITS[format]
    planes = field_major(codes_x.astype(np.int16), per, data.shape[1]).reshape(M, per, -1)
    (_gemv2 if per == 4 else _gemv1)(planes, data, acc)
    rowsum = codes_x.sum(axis=1, dtype=np.int32)[:, None]
    return acc - rowsum if format == "ternary" else 2 * acc - rowsum


@numba.njit(parallel=True, cache=True)
def _scale_rows(acc, scale_x, scale_w, out):
    """out = float32(acc) * scale_x[m] * scale_w[n or 0], rounded in float32 in that order."""
    M, N = acc.shape
    stride = 1 if scale_w.shape[0] > 1 else 0
    for m in numba.prange(M):
        sx = scale_x[m]
        for n in range(N):
            out[m, n] = (np.float32(acc[m, n]) * sx) * scale_w[n * stride]


def gemv(codes_x, scale_x, data, scale_w, format, out):
    """out = float32(codes_x @ codes_w) * scale_x[:, None] * scale_w for few rows.

    scale_w: [1] or [N] float32; out: [M, N] float32, overwritten.
    """
    _scale_rows(gemv_acc(codes_x, data, format), scale_x, scale_w, out)
