"""Numba quantization kernels: per-column weight codes, per-row activation codes (serial).

Siblings: ``__init__.py``, ``_numpy.py``, ``_cuda.py``; reference ``reference/quantize.py``.
Quotients are formed in the input's dtype and rounded half to even (``np.rint``), as in the
reference, so codes agree exactly. The scale floor and the format constants come from
``__init__``; Numba freezes them into the cached kernels (its cache tracks only this file), so
``numba_cache_guard`` below clears them when a file of this folder changes.
"""

import numba
import numpy as np

from ... import _backend
from . import EPS, WEIGHT_FORMATS, WEIGHT_QMAX

_backend.numba_cache_guard(__file__)  # the kernels freeze constants of ``__init__.py``

#: Largest int8 weight code (the kernels read it as a compile-time constant).
_INT8_QMAX = WEIGHT_QMAX["int8"]
_TERNARY, _SIGN, _INT8 = 0, 1, 2

# The weight kernels are serial, like the others here: quantize_layer_weights runs between a
# step's BLAS calls, and with another process on one of the 2 cores every parallel region waited
# for a time slice (the BDH layer's weights, best of 10: 2.4 ms serial, 25 ms with these kernels
# parallel over column blocks; on idle cores the kernels took 1.25 ms serial, 0.7 ms parallel).

#: Columns a kernel walks at once: it reads rows of this many contiguous values (row-major, the
#: weight's own layout; walking columns, stride N, cost 4-10x). 1024 was 5-10% faster than 256
#: or 512 on [4096, 4096] and the BDH layer's weights (measured).
_BLOCK = 1024
#: Packed bytes a row of ``_weight_codes``' tile holds (32 KiB of words at 1024 columns: in L1):
#: the transposed codes gather there and go out in runs of a row (stored straight into [N, K]
#: rows a power of two apart, they aliased in L1 and thrashed it: 4x slower at K = 4096).
_TILE = 32


@numba.njit(cache=True)
def _column_abs_sums(w, out):
    """out[n] = sum over k of |w[k, n]| in float64, summed in order of k (as ever: the ternary
    scale depends on that order), walked row by row in blocks of columns."""
    K, N = w.shape
    for n0 in range(0, N, _BLOCK):
        n1 = min(n0 + _BLOCK, N)
        acc = out[n0:n1]
        acc[:] = 0.0
        for k in range(K):
            row = w[k, n0:n1]
            for i in range(n1 - n0):
                acc[i] += abs(np.float64(row[i]))


@numba.njit(cache=True)
def _column_scales(w, out):
    """out[n] = max(max_k |w[k, n]|, eps) / qmax in w's dtype (qmax 127), by blocks of columns."""
    K, N = w.shape
    eps = w.dtype.type(EPS)
    top = w.dtype.type(_INT8_QMAX)
    for n0 in range(0, N, _BLOCK):
        n1 = min(n0 + _BLOCK, N)
        m = out[n0:n1]
        m[:] = 0
        for k in range(K):
            row = w[k, n0:n1]
            for i in range(n1 - n0):
                a = abs(row[i])
                if a > m[i] or a != a:  # a NaN must reach the scale: the caller's finiteness check
                    m[i] = a
        for i in range(n1 - n0):
            m[i] = (m[i] if m[i] > eps or m[i] != m[i] else eps) / top


# error_model="numpy": no ZeroDivisionError check in the division (its branch kept the loops
# scalar); every scale is at least EPS.
@numba.njit(cache=True, error_model="numpy")
def _weight_codes(w, fmt, scale, out):
    """The stored codes of w [K, N], transposed and packed along K, LSB-first, into ``out``
    [N, ceil(K * bits / 8)] uint8 (ternary ``code + 1`` in 2 bits, sign ``w >= 0`` in 1, int8
    codes as their two's complement byte); ``scale`` [N] in w's dtype (ternary: N copies).

    Row by row over a block of columns, the codes of a 64-bit word (``64 / bits`` rows) gather
    in one uint64 a column; a tile of words goes out by shifts (so the bytes do not depend on
    the byte order), in runs along each output row. Ternary's clip(rint(q), -1, 1) is +1
    exactly when q > 0.5 and -1 when q < -0.5 (rint takes ties to even, to 0), so the quotient
    is compared instead of rounded. The bytes are those of packing the [N, K] stored codes.
    """
    K, N = w.shape
    bits = 8 if fmt == _INT8 else (2 if fmt == _TERNARY else 1)
    per = 64 // bits  # codes a word
    half = w.dtype.type(0.5)
    top = w.dtype.type(_INT8_QMAX)
    width = min(N, _BLOCK)
    acc = np.empty(width, np.uint64)
    words = np.empty((width, _TILE // 8), np.uint64)
    nbytes = out.shape[1]
    for n0 in range(0, N, _BLOCK):
        m = min(N - n0, _BLOCK)
        s = scale[n0:n0 + m]
        for t0 in range(0, nbytes, _TILE):
            for j in range(-(-min(_TILE, nbytes - t0) // 8)):
                k0 = (t0 // 8 + j) * per
                acc[:m] = 0
                for k in range(k0, min(k0 + per, K)):
                    row = w[k, n0:n0 + m]
                    shift = np.uint64((k - k0) * bits)
                    # one loop a format, each vectorized (a branch inside kept them scalar)
                    if fmt == _INT8:
                        for i in range(m):
                            c = min(max(np.rint(row[i] / s[i]), -top), top)
                            acc[i] |= np.uint64(np.int64(c) & 0xFF) << shift
                    elif fmt == _TERNARY:
                        for i in range(m):
                            q = row[i] / s[i]
                            c = 1 + np.int64(q > half) - np.int64(q < -half)
                            acc[i] |= np.uint64(c) << shift
                    else:
                        for i in range(m):
                            acc[i] |= np.uint64(row[i] >= 0) << shift
                for i in range(m):
                    words[i, j] = acc[i]
            for i in range(m):
                dst = out[n0 + i]
                for b in range(min(_TILE, nbytes - t0)):
                    dst[t0 + b] = (words[i, b // 8] >> np.uint64(8 * (b % 8))) & 0xFF


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
# times, and the following dgemm 29 -> 35 ms).
@numba.njit(cache=True)
def _quantize_rows(x, bits, magnitude, inf, qmax, codes, scale, cell, cell_bits):
    """Per-row codes and scales of ``x`` [M, K]; ``bits`` is x viewed as unsigned integers of
    its width, ``magnitude`` the mask of all bits but the sign, ``inf`` the pattern of +inf, and
    ``cell`` / ``cell_bits`` one scratch element of x's dtype and its integer view.

    The absmax is a max over the magnitudes' bit patterns: non-negative floats order as their
    patterns do, and a NaN (exponent all ones, some mantissa bit set) sorts above inf, so one
    integer max, which vectorizes where the float compare-and-branch did not (5.5x on [512,
    256] float32, AMD EPYC, measured), finds the absmax and any non-finite value at once."""
    M, K = x.shape
    # every constant in x's dtype, so that the scale and the quotients are formed in it (a
    # float64 scale let a float32 tie round away from the reference's code)
    eps = x.dtype.type(EPS)
    top = x.dtype.type(qmax)
    for m in range(M):
        b = bits[m, 0] & magnitude
        for k in range(1, K):
            v = bits[m, k] & magnitude
            b = v if v > b else b
        if b >= inf:  # inf or NaN
            scale[m] = np.nan
            continue
        cell_bits[0] = b
        s = max(cell[0], eps) / top
        scale[m] = s
        for k in range(K):
            codes[m, k] = min(max(np.rint(x[m, k] / s), -top), top)


_UNSIGNED = {np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 0x7F800000),
             np.dtype(np.float64): (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}


def weight_codes(w, format):
    """w: [K, N] float -> (data, scale in w's dtype): data [N, K] int8 codes ("int8") or, for
    ternary and sign, the codes already packed along K, [N, ceil(K / per)] uint8."""
    K, N = w.shape
    w = _backend.read_only(w)
    if format == "int8":
        scale = _backend.empty((N,), w.dtype)
        _column_scales(w, scale)
        stored = _backend.empty((N, K), np.int8)
        _weight_codes(w, _INT8, scale, stored.view(np.uint8))
        return stored, scale
    sums = np.empty(N, dtype=np.float64)
    _column_abs_sums(w, sums)
    scale = np.array(max(sums.sum() / w.size, EPS), dtype=w.dtype)
    stored = _backend.empty((N, -(-K // (8 // WEIGHT_FORMATS[format]))), np.uint8)
    fmt = _TERNARY if format == "ternary" else _SIGN
    _weight_codes(w, fmt, np.full(N, scale, w.dtype), stored)
    return stored, scale


def unpack_weight(data, format, K):
    """Packed data [N, bytes] -> signed codes [N, K] int8."""
    out = _backend.empty((data.shape[0], K), np.int8)
    if format == "int8":
        out[...] = data
    elif out.size:
        _unpack_weight(_backend.read_only(data), WEIGHT_FORMATS[format], format == "ternary", K,
                       out)
    return out


def row_codes(x, qmax):
    """x: [M, K] float -> (codes [M, K] int8, scale [M] float32; NaN for non-finite rows)."""
    codes = _backend.empty(x.shape, np.int8)
    scale = _backend.empty(x.shape[:1], np.float32)
    if x.size:
        x = _backend.read_only(np.ascontiguousarray(x))
        kind, magnitude, inf = _UNSIGNED[x.dtype]
        cell = np.empty(1, x.dtype)
        _quantize_rows(x, x.view(kind), kind(magnitude), kind(inf), qmax, codes, scale, cell,
                       cell.view(kind))
    return codes, scale
