"""Weight decodings of the numba packed matmul: packed bytes to codes in float, field-major.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (the backend functions),
``_gemv.py``, ``_gemm_f64.py`` (the user of ``decode_packed_f64``), ``_backward.py``,
``_vnni.py``. Two decodings:

- ``decode_codes_f32``: one signed code per float32 (the float32 BLAS tiles of
  ``matmul_float``; ``decode_codes_f32_into``, into a given buffer, those of
  ``_backward.dx_blocks``);
- ``decode_packed_f64``: up to three weight columns' codes packed into one float64,
  ``w0 + 2^s w1 + 2^2s w2`` (the exact float64 GEMM of ``_gemm_f64.py``).

Both write field-major tiles: each packed row's first fields, then its second ones, ...
(column ``j * G + g`` holds K ``per * g + j``, G bytes a tile row), so every store runs over
contiguous memory and vectorizes (measured 9x faster than a byte-by-byte table decode into K
order); ``field_major`` permutes the activations (or, read backwards, the output columns of dx)
to match.

Serial on purpose: the decodings alternate with BLAS calls, and a Numba parallel region right
after one ran up to 2x slower against OpenBLAS's spinning workers (measured: ternary/None GEMM
M = 256, K = N = 4096 116 -> 69 ms serial).
"""

import numba
import numpy as np

from ...quantize import WEIGHT_FORMATS as _BITS


@numba.njit(cache=True)
def decode_codes_f32_into(data, bits, n0, g0, out):
    """out[i, j * G + g] = float32 signed code of field j of byte g0 + g of row n0 + i, where
    G = out.shape[1] // (8 // bits)."""
    rows = out.shape[0]
    per = 8 // bits
    G = out.shape[1] // per
    mask = (1 << bits) - 1
    for i in range(rows):
        src = data[n0 + i, g0:g0 + G]
        dst = out[i]
        for j in range(per):
            seg = dst[j * G:(j + 1) * G]
            shift = j * bits
            for g in range(G):
                if bits == 8:
                    seg[g] = np.float32(src[g])
                else:
                    f = (np.int32(src[g]) >> shift) & mask
                    seg[g] = np.float32(f - 1 if bits == 2 else 2 * f - 1)


def decode_codes_f32(data, format, n0, n1, k0, k1):
    """Signed float32 codes of W[k0:k1, n0:n1], transposed and field-major:
    ``[n1 - n0, per * G]`` with column ``j * G + g`` holding K ``k0 + per * g + j`` (k0 a
    multiple of ``per``; columns past k1 hold padding codes)."""
    bits = _BITS[format]
    per = 8 // bits
    G = -(-(k1 - k0) // per)
    out = np.empty((n1 - n0, per * G), dtype=np.float32)
    decode_codes_f32_into(data, bits, n0, k0 // per, out)
    return out


def field_major(x, per, G):
    """[M, K] -> [M, per * G]: column ``j * G + g`` = ``x[:, per * g + j]``, zero past K (the
    activations of the float paths; reshaped [M, per, G], the portable GEMV's planes)."""
    M, K = x.shape
    padded = np.zeros((M, G * per), dtype=x.dtype)
    padded[:, :K] = x
    return np.ascontiguousarray(padded.reshape(M, G, per).transpose(0, 2, 1)).reshape(M, per * G)


@numba.njit(cache=True)
def _packed_field_f64(a, b, c, bits, j, w1, w2, dst):
    """dst[g] = code_j(a[g]) + w1 code_j(b[g]) + w2 code_j(c[g]), an exact integer in float64.

    ``code_j(byte)`` is the signed code of field j of a packed byte. One pass per field j over
    contiguous bytes and stores, integer arithmetic converted once (vectorizes).
    """
    if bits == 8:
        for g in range(dst.shape[0]):
            dst[g] = np.float64(np.int64(a[g]) + w1 * np.int64(b[g]) + w2 * np.int64(c[g]))
    elif bits == 2:
        s = 2 * j
        off = 1 + w1 + w2
        for g in range(dst.shape[0]):
            dst[g] = np.float64((np.int64(a[g]) >> s & 3) + w1 * (np.int64(b[g]) >> s & 3)
                                + w2 * (np.int64(c[g]) >> s & 3) - off)
    else:
        off = 1 + w1 + w2
        for g in range(dst.shape[0]):
            dst[g] = np.float64(2 * ((np.int64(a[g]) >> j & 1) + w1 * (np.int64(b[g]) >> j & 1)
                                     + w2 * (np.int64(c[g]) >> j & 1)) - off)


@numba.njit(cache=True)
def decode_packed_f64(data, bits, fields, shift, g0, out):
    """out[q, j * G + g] = sum_i 2^(i shift) * code(k = per (g0 + g) + j, n = i * P + q).

    Field-major within the tile (K permuted to ``j * G + g``, G = bytes per tile row; the GEMM
    permutes the activations the same way). Three (or two) weight columns share one float64;
    columns past N add nothing.
    """
    P = out.shape[0]
    N = data.shape[0]
    per = 8 // bits
    G = out.shape[1] // per
    for q in range(P):
        a = data[q, g0:g0 + G]
        b = a
        c = a
        w1 = np.int64(0)
        w2 = np.int64(0)
        if fields > 1 and P + q < N:
            b = data[P + q, g0:g0 + G]
            w1 = np.int64(1) << shift
        if fields > 2 and 2 * P + q < N:
            c = data[2 * P + q, g0:g0 + G]
            w2 = np.int64(1) << (2 * shift)
        for j in range(per):
            _packed_field_f64(a, b, c, bits, j, w1, w2, out[q, j * G:(j + 1) * G])
