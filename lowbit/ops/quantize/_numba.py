"""Numba quantization kernels: per-column weight codes, per-row activation codes (parallel).

Siblings: ``__init__.py``, ``_numpy.py``, ``_cuda.py``; reference ``reference/quantize.py``.
Quotients are formed in the input's dtype and rounded half to even (``np.rint``), as in the
reference, so codes agree exactly. The scale floor and the format constants come from
``__init__``; Numba freezes them into the cached kernels (its cache tracks only this file).
"""

import numba
import numpy as np

from ... import _backend
from . import EPS, WEIGHT_FORMATS, WEIGHT_QMAX

#: Largest int8 weight code (the kernels read it as a compile-time constant).
_INT8_QMAX = WEIGHT_QMAX["int8"]
_TERNARY, _SIGN, _INT8 = 0, 1, 2
_FORMAT_ID = {"ternary": _TERNARY, "sign": _SIGN, "int8": _INT8}


@numba.njit(parallel=True, cache=True)
def _column_abs_sums(w, out):
    K, N = w.shape
    for n in numba.prange(N):
        total = 0.0
        for k in range(K):
            total += abs(np.float64(w[k, n]))
        out[n] = total


@numba.njit(parallel=True, cache=True)
def _column_scales(w, out):
    """out[n] = max(max_k |w[k, n]|, eps) / qmax in w's dtype (qmax 127)."""
    K, N = w.shape
    zero = w.dtype.type(0)
    eps = w.dtype.type(EPS)
    top = w.dtype.type(_INT8_QMAX)
    for n in numba.prange(N):
        m = zero
        for k in range(K):
            a = abs(w[k, n])
            if a > m or a != a:  # a NaN must reach the scale: the caller's finiteness check
                m = a
        out[n] = (m if m > eps or m != m else eps) / top


@numba.njit(parallel=True, cache=True)
def _weight_codes(w, fmt, scale, out):
    """out[n, k]: stored code of w[k, n]; ``scale`` has one entry (per tensor) or N."""
    K, N = w.shape
    stride = 1 if scale.shape[0] > 1 else 0
    for n in numba.prange(N):
        s = scale[n * stride]
        for k in range(K):
            v = w[k, n]
            if fmt == _SIGN:
                out[n, k] = 1 if v >= 0 else 0
            elif fmt == _TERNARY:
                out[n, k] = min(max(np.rint(v / s), -1), 1) + 1
            else:
                out[n, k] = min(max(np.rint(v / s), -_INT8_QMAX), _INT8_QMAX)


# Serial, byte by byte: 0.65 ms for 4096 x 256 ternary codes against 1.5 ms for the parallel
# per-code loop it replaced (a division per code), and 5 ms for that one between the BLAS calls of
# a layer's backward, where OpenBLAS's spinning workers took its cores (measured).
@numba.njit(cache=True)
def _unpack_weight(data, bits, ternary, K, out):
    N = data.shape[0]
    per = 8 // bits
    mask = (1 << bits) - 1
    full = K // per
    for n in range(N):
        src = data[n]
        dst = out[n]
        for g in range(full):
            b = np.int32(src[g])
            for j in range(per):
                c = (b >> (j * bits)) & mask
                dst[g * per + j] = c - 1 if ternary else 2 * c - 1
        for k in range(full * per, K):
            c = (np.int32(src[k // per]) >> ((k % per) * bits)) & mask
            dst[k] = c - 1 if ternary else 2 * c - 1


# Serial on purpose: it runs right before the packed GEMM's BLAS call, and a Numba parallel
# region there collides with OpenBLAS's spinning workers (measured: quantization 0.5 -> 8 ms at
# times, and the following dgemm 29 -> 35 ms); one pass over the rows costs about 1 ms.
@numba.njit(cache=True)
def _quantize_rows(x, qmax, codes, scale):
    M, K = x.shape
    # every constant in x's dtype, so that the scale and the quotients are formed in it (a
    # float64 scale let a float32 tie round away from the reference's code)
    zero = x.dtype.type(0)
    eps = x.dtype.type(EPS)
    top = x.dtype.type(qmax)
    for m in range(M):
        a = zero
        finite = True
        for k in range(K):
            v = abs(x[m, k])
            if v > a:
                a = v
            elif not v <= a:  # NaN: found in the absmax pass itself
                finite = False
        if not finite or a == np.inf:
            scale[m] = np.nan
            continue
        s = max(a, eps) / top
        scale[m] = s
        for k in range(K):
            codes[m, k] = min(max(np.rint(x[m, k] / s), -qmax), qmax)


def weight_codes(w, format):
    """w: [K, N] float -> (stored [N, K] uint8 (int8 for "int8"), scale in w's dtype)."""
    K, N = w.shape
    if format == "int8":
        scale = _backend.empty((N,), w.dtype)
        _column_scales(w, scale)
        stored = _backend.empty((N, K), np.int8)
        _weight_codes(w, _INT8, scale, stored)
        return stored, scale
    sums = np.empty(N, dtype=np.float64)
    _column_abs_sums(w, sums)
    scale = np.array(max(sums.sum() / w.size, EPS), dtype=w.dtype)
    stored = _backend.empty((N, K), np.uint8)
    _weight_codes(w, _FORMAT_ID[format], scale.reshape(1), stored)
    return stored, scale


def unpack_weight(data, format, K):
    """Packed data [N, bytes] -> signed codes [N, K] int8."""
    out = _backend.empty((data.shape[0], K), np.int8)
    if format == "int8":
        out[...] = data
    elif out.size:
        _unpack_weight(data, WEIGHT_FORMATS[format], format == "ternary", K, out)
    return out


def row_codes(x, qmax):
    """x: [M, K] float -> (codes [M, K] int8, scale [M] float32; NaN for non-finite rows)."""
    codes = _backend.empty(x.shape, np.int8)
    scale = _backend.empty(x.shape[:1], np.float32)
    if x.size:
        _quantize_rows(x, qmax, codes, scale)
    return codes, scale
