"""Backward kernels of the numba packed matmul: ``dx = dy @ Qw(w).T`` and the dequantized
activations of ``dw``.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (the backend functions
``matmul_dx`` / ``matmul_dw``, which choose between these by row count), ``_decode.py``
(``decode_codes_f32``, the tiles of ``dx_tiled``), ``_gemv.py``, ``_gemm_f64.py``, ``_vnni.py``.

For few rows ``dx_gemv`` walks every packed weight row once (a transposed GEMV); for more rows
on CPUs without AVX-512 ``dx_tiled`` decodes tiles of codes to float32 for BLAS (with AVX-512,
``_fma.py`` runs instead). ``dw`` multiplies the dequantized saved activations
(``dequantize_rows``, transposed for ``_fma.py``'s tiles).
"""

import numba
import numpy as np

from ...quantize import WEIGHT_FORMATS as _BITS
from ._decode import decode_codes_f32

#: K columns of dx decoded per tile (a multiple of every format's codes per byte).
TILE_K = 512
#: Packed bytes of a weight row each task of the transposed GEMV covers (one cache line).
DX_BLOCK_BYTES = 64


@numba.njit(cache=True)
def _axpy_fields(d, src, bits, acc):
    """acc[j, i] += d * field_j(src[i]) for the 8 / bits fields of each byte.

    One loop per field: with all fields in one loop body the loop did not vectorize (14x slower,
    measured).
    """
    mask = (1 << bits) - 1
    for j in range(8 // bits):
        a = acc[j]
        shift = j * bits
        for i in range(src.shape[0]):
            a[i] += d * np.float32((np.int32(src[i]) >> shift) & mask)


@numba.njit(cache=True)
def _axpy_codes8(d, src, acc):
    a = acc[0]
    for i in range(src.shape[0]):
        a[i] += d * np.float32(src[i])


@numba.njit(parallel=True, cache=True)
def _dx_small(g, data, bits, K, out):
    """Transposed GEMV over packed bytes: out[m, k] = sum_n g[m, n] * code(k, n).

    Each task owns DX_BLOCK_BYTES bytes of every weight row and walks the rows n in order, adding
    ``g[m, n]`` times the stored field of each code to per-field accumulators (the loop over bytes
    vectorizes; the order over n is fixed, so results are deterministic). Stored fields map back
    to codes through the row sum of ``g``: ternary ``code = field - 1``, sign
    ``code = 2 field - 1``; int8 bytes are the codes.
    """
    M, N = g.shape
    nbytes = data.shape[1]
    per = 8 // bits
    blocks = -(-nbytes // DX_BLOCK_BYTES)
    for blk in numba.prange(blocks):
        b0 = blk * DX_BLOCK_BYTES
        b1 = min(nbytes, b0 + DX_BLOCK_BYTES)
        acc = np.empty((per, b1 - b0), dtype=np.float32)
        for m in range(M):
            acc[:, :] = 0.0
            total = np.float32(0.0)
            for n in range(N):
                d = g[m, n]
                total += d
                if bits == 8:
                    _axpy_codes8(d, data[n, b0:b1], acc)
                else:
                    _axpy_fields(d, data[n, b0:b1], bits, acc)
            for i in range(b1 - b0):
                for j in range(per):
                    k = (b0 + i) * per + j
                    if k < K:
                        v = acc[j, i]
                        if bits == 2:
                            v = v - total
                        elif bits == 1:
                            v = 2 * v - total
                        out[m, k] = v



def dx_gemv(g, data, format, K, out):
    """out [M, K] float32 = ``g @ codes_w.T`` for few rows (the transposed GEMV)."""
    _dx_small(g, data, _BITS[format], K, out)


def dx_tiled(g, data, format, K, out):
    """out [M, K] float32 = ``g @ codes_w.T``: decode the codes of TILE_K input features for all
    N outputs (field-major) and multiply with BLAS."""
    M, N = g.shape
    per = 8 // _BITS[format]
    for k0 in range(0, K, TILE_K):
        k1 = min(K, k0 + TILE_K)
        tile = decode_codes_f32(data, format, 0, N, k0, k1)
        G = tile.shape[1] // per
        # columns j * G + g of the product are K k0 + per * g + j: back to K order
        part = (g @ tile).reshape(M, per, G).transpose(0, 2, 1).reshape(M, per * G)
        out[:, k0:k1] = part[:, :k1 - k0]


# Serial: it feeds a BLAS call straight away, and a Numba parallel region just before one leaves
# its workers spinning against OpenBLAS's (measured 8.0 ms against 0.58 ms for the dequantize and
# dw product of 256 x 256 by 256 x 1024 on 2 cores); the loop itself takes microseconds.
@numba.njit(cache=True)
def _dequantize_rows(codes, scale, out):
    M, K = codes.shape
    for m in range(M):
        s = scale[m]
        for k in range(K):
            out[m, k] = np.float32(codes[m, k]) * s


#: Rows and columns of the blocks ``_dequantize_transposed`` moves at a time (a block's 64-byte
#: output rows are written whole).
TRANSPOSE_BLOCK = 16


@numba.njit(cache=True)
def _dequantize_transposed(codes, scale, out):
    """out[k, m] = codes[m, k] * scale[m], block by block; serial like ``_dequantize_rows``
    (about 2 ms at M = 256, K = 4096, measured)."""
    M, K = codes.shape
    B = TRANSPOSE_BLOCK
    for k0 in range(0, K, B):
        k1 = min(K, k0 + B)
        for m0 in range(0, M, B):
            m1 = min(M, m0 + B)
            for k in range(k0, k1):
                for m in range(m0, m1):
                    out[k, m] = np.float32(codes[m, k]) * scale[m]


def dequantize_rows(codes, scale, transposed=False):
    """float32 ``codes * scale[:, None]`` (int8 codes [M, K], [M] float32 scales): [M, K], or
    its transpose [K, M] C-contiguous with ``transposed``."""
    if transposed:
        out = np.empty(codes.shape[::-1], dtype=np.float32)
        _dequantize_transposed(codes, scale, out)
    else:
        out = np.empty(codes.shape, dtype=np.float32)
        _dequantize_rows(codes, scale, out)
    return out
