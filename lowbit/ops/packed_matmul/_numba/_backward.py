"""Backward kernels of the numba packed matmul: ``dx = dy @ Qw(w).T`` and ``dw = Qa(x).T @ dy``
where the float32 tiles of ``_fma.py`` do not run, and the dequantized activations of ``dw``.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (the backend functions
``matmul_dx`` / ``matmul_dw``, which choose between these by row count and CPU), ``_decode.py``
(the field-major float32 decoding the dx tiles use), ``_blas.py`` (SciPy's BLAS from Numba),
``_fma.py``, ``_gemv.py``, ``_vnni.py``.

For one row of ternary or sign weights (more where their tables cannot run) ``dx_gemv`` walks
every packed weight row once (a transposed GEMV). Otherwise ``dx_blocks`` and ``dw_blocks`` run
SciPy's BLAS one single-threaded call per block inside a Numba parallel region (BLAS held at one
thread): each task decodes its slice of the weight codes (or dequantizes its activations) into
cache right before its call, and no second thread pool spins against Numba's. The serial decode
of whole 512-feature tiles between multithreaded BLAS calls it replaced spent 10-17 ms of a
59-72 ms dx on a 2-core EPYC Zen 4 (NumPy's ``dy @ w.T``: 47-50 ms; the blocks: 45 ms).
``dequantize_rows`` feeds ``_fma.py``'s dw tiles.
"""

import numba
import numpy as np

from .... import _backend
from ...quantize import WEIGHT_FORMATS as _BITS
from ._blas import gemm
from ._decode import decode_codes_f32_into

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


@numba.njit(parallel=True, cache=True)
def _dx_small(g, data, bits, K, out):
    """Transposed GEMV over packed bytes: out[m, k] = sum_n g[m, n] * code(k, n).

    Each task owns DX_BLOCK_BYTES bytes of every weight row and walks the rows n in order, adding
    ``g[m, n]`` times the stored field of each code to per-field accumulators (the loop over bytes
    vectorizes; the order over n is fixed, so results are deterministic). Stored fields map back
    to codes through the row sum of ``g``: ternary ``code = field - 1``, sign
    ``code = 2 field - 1`` (int8 weights take the blocks or the tiles at every row count).
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
                _axpy_fields(d, data[n, b0:b1], bits, acc)
            for i in range(b1 - b0):
                for j in range(per):
                    k = (b0 + i) * per + j
                    if k < K:
                        v = acc[j, i]
                        out[m, k] = v - total if bits == 2 else 2 * v - total



def dx_gemv(g, data, format, K, out):
    """out [M, K] float32 = ``g @ codes_w.T`` for few rows of ternary or sign weights (the
    transposed GEMV)."""
    _dx_small(g, data, _BITS[format], K, out)


#: Input features (columns of dx) a task of ``_dx_blocks`` covers, weight rows (the sum over N)
#: decoded per BLAS call, and rows of dy a task takes: a [1024, 256] float32 tile (1 MiB, in L2)
#: per call, a [<= 1024, 256] partial product per task. Measured on a 2-core EPYC Zen 4 (OpenBLAS
#: SkylakeX), M = 256, K = N = 4096 ternary: 45 ms (256 x 1024 tiles), 48 (128 x 4096), 56
#: (512 x 4096), against 50 ms for NumPy's ``dy @ w.T`` and 59-72 ms for the serial decode of
#: 512 whole columns at a time between multithreaded BLAS calls that this replaced.
DX_COLS = 256
DX_ROWS = 1024
BLOCK_M = 1024


@numba.njit(cache=True)
def _task_ranges(task, inner, outer_size, outer_total, inner_size, inner_total):
    """The two index ranges of block ``task`` of a grid walked ``inner`` blocks at a time:
    ``(o0, o1, i0, i1)``, blocks of ``outer_size`` and ``inner_size``, cut at the totals."""
    o0 = (task // inner) * outer_size
    i0 = (task % inner) * inner_size
    return o0, min(outer_total, o0 + outer_size), i0, min(inner_total, i0 + inner_size)


@numba.njit(parallel=True, cache=True)
def _dx_blocks(g, data, bits, K, scale, cols, rows, block_m, out):
    """out[m, k] = (sum_n g[m, n] * code(k, n)) * scale, per task of ``cols`` input features
    (a multiple of a byte's codes) and ``block_m`` rows: decode ``rows`` weight rows of the
    task's features into a float32 tile (field-major, as ``decode_codes_f32``), multiply-add it
    into the task's partial product with one single-threaded BLAS call, then put the columns back
    in K order."""
    M, N = g.shape
    per = 8 // bits
    nk = -(-K // cols)
    nm = -(-M // block_m)
    for task in numba.prange(nk * nm):
        k0, k1, m0, m1 = _task_ranges(task, nm, cols, K, block_m, M)
        G = -(-(k1 - k0) // per)
        tile = np.empty((min(N, rows), per * G), np.float32)
        part = np.empty((m1 - m0, per * G), np.float32)
        ints = np.empty(8, np.int32)
        scalars = np.empty(2, np.float32)
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            decode_codes_f32_into(data, bits, n0, k0 // per, tile[:n1 - n0])
            gemm(g[m0:m1, n0:n1], False, tile[:n1 - n0], part, 0.0 if n0 == 0 else 1.0, ints,
                 scalars)
        for i in range(m1 - m0):
            src = part[i]
            dst = out[m0 + i]
            for j in range(per):
                for q in range(G):
                    k = k0 + per * q + j
                    if k < k1:
                        dst[k] = src[j * G + q] * scale


def dx_blocks(g, data, format, K, scale, out):
    """out [M, K] float32 = ``(g @ codes_w.T) * scale`` (``scale`` a float32 scalar) through
    SciPy's BLAS on decoded tiles, one single-threaded call per block on Numba's threads."""
    if g.shape[1] == 0:  # an empty sum
        out[...] = 0
        return
    with _backend.single_threaded_blas():
        _dx_blocks(g, data, _BITS[format], K, np.float32(scale), DX_COLS, DX_ROWS, BLOCK_M, out)


@numba.njit(parallel=True, cache=True)
def _dw_blocks(a, scale_a, g, rows, cols, block_m, out):
    """out[k, n] = sum_m (a[m, k] * scale_a[m]) * g[m, n], per task of ``rows`` x ``cols``
    outputs: the task's activations, dequantized ``block_m`` rows at a time, times ``g`` with
    one single-threaded BLAS call each (the first overwrites, the next add)."""
    M, K = a.shape
    N = g.shape[1]
    nk = -(-K // rows)
    nn = -(-N // cols)
    for task in numba.prange(nk * nn):
        k0, k1, n0, n1 = _task_ranges(task, nn, rows, K, cols, N)
        act = np.empty((min(M, block_m), k1 - k0), np.float32)
        ints = np.empty(8, np.int32)
        scalars = np.empty(2, np.float32)
        for m0 in range(0, M, block_m):
            m1 = min(M, m0 + block_m)
            for i in range(m1 - m0):
                s = scale_a[m0 + i]
                src = a[m0 + i, k0:k1]
                dst = act[i]
                for k in range(k1 - k0):
                    dst[k] = np.float32(src[k]) * s
            gemm(act[:m1 - m0], True, g[m0:m1, n0:n1], out[k0:k1, n0:n1],
                 0.0 if m0 == 0 else 1.0, ints, scalars)


#: Least output rows (K) or columns (N) of one ``_dw_blocks`` task: below them a BLAS call
#: spends more on its set-up and packing than on its products.
DW_MIN = 64


def dw_blocks(a, g, scale_a):
    """dw [K, N] float32 = ``(a * scale_a[:, None]).T @ g`` (``a`` [M, K] int8 codes with
    ``scale_a`` [M] float32, or float32 with ``scale_a`` None) through SciPy's BLAS, one
    single-threaded call per block of the output.

    As many blocks as Numba's thread pool has threads (``NUMBA_NUM_THREADS``, fixed for the
    process: ``numba.set_num_threads`` does not move the blocks, so it cannot change the bits),
    split along K, or also along N where K is short. Measured as ``DX_COLS``: 43 ms in two
    blocks, 44 in four, 47-49 in eight or sixteen, against 48-53 ms for NumPy's ``x.T @ dy``.
    """
    M, K = a.shape
    N = g.shape[1]
    out = _backend.empty((K, N), np.float32)
    scale_a = np.ones(M, np.float32) if scale_a is None else _backend.read_only(scale_a)
    threads = numba.config.NUMBA_NUM_THREADS
    rows = max(DW_MIN, -(-K // threads))
    split = max(1, threads // -(-K // rows))  # column blocks where K gives too few rows
    cols = max(DW_MIN, -(-N // split))
    if M == 0 or K == 0 or N == 0:  # an empty sum, or nothing to write
        out[...] = 0
        return out
    with _backend.single_threaded_blas():
        _dw_blocks(a, scale_a, g, rows, cols, BLOCK_M, out)
    return out


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
