"""Portable GEMM of the numba packed matmul: exact integer products in float64 BLAS.

Siblings in ``lowbit/ops/packed_matmul/_numba/``: ``__init__.py`` (the backend functions; it
runs this GEMM for more rows where ``_vnni.py`` cannot), ``_decode.py`` (``decode_packed_f64``,
the weight tiles), ``_gemv.py``, ``_backward.py``, ``_vnni.py``.

Up to three columns of decoded weight codes are packed into one float64, ``w0 + 2^s w1 +
2^2s w2``; each dot product with activation codes then carries three integer results in separate
bit fields. Over a K chunk whose partial sums stay below ``2^(s-1)`` in magnitude and whose
packed total stays below 2^53, every product and partial sum BLAS forms is an integer below 2^53
and hence exact in any order; the fields are split again with exact power-of-two arithmetic. The
result equals int32 accumulation bit for bit, for a third of the multiply-adds of a float GEMM
(float64 BLAS runs at about half the float32 rate here, so the net gain is about 1.5x before
decode and split). Within a tile, K is laid out field-major (``_decode.py``), with the
activations permuted to match (``_permute_x``). The chunk bound is the largest row L1 norm of the
activation codes times the largest weight code, so typical activations need one chunk over all of
K: one decode, one dgemm, and the split fused with the scaling into the output.

The helpers around the dgemm are serial: run between BLAS calls, Numba's worker threads competed
with OpenBLAS's spinning ones on the 2 cores (decode + dgemm + split of a chunk took 16.5 ms back
to back against 8.5 ms timed apart, measured). The float64 buffers are per-thread workspaces kept
across calls, up to a cap (``_work``).
"""

import threading

import numba
import numpy as np

from ...quantize import WEIGHT_FORMATS as _BITS, WEIGHT_QMAX
from ._decode import decode_packed_f64

#: float64 holds integers exactly up to this magnitude.
EXACT_LIMIT = 2**53
#: K columns per block of the activations' L1 sums the field plan reads (a multiple of every
#: format's codes per byte).
BLOCK_K = 64
#: Smallest K chunk worth a BLAS call; below it the plan packs fewer fields per float instead.
MIN_CHUNK = 512
#: Largest float64 workspace kept per thread between GEMM calls (larger ones are allocated afresh).
WORKSPACE_MAX_BYTES = 64 << 20
_WORK = threading.local()


def _work(name, size):
    """A float64 workspace of ``size`` elements, kept per thread across calls up to the cap.

    Reusing the buffers saves their page faults: ~3 ms a call for the 45 MB tile of M = 256,
    K = N = 4096 (measured).
    """
    if size * 8 > WORKSPACE_MAX_BYTES:
        return np.empty(size, dtype=np.float64)
    buf = getattr(_WORK, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.float64)
        setattr(_WORK, name, buf)
    return buf[:size]


def _chunk_l1(block_sums, chunk, K):
    """Largest row L1 norm of the activation codes over any K chunk (chunks start at 0)."""
    M, nb = block_sums.shape
    per_chunk = nb if chunk >= K else chunk // BLOCK_K
    pad = -nb % per_chunk
    sums = np.pad(block_sums, ((0, 0), (0, pad))) if pad else block_sums
    return int(sums.reshape(M, -1, per_chunk).sum(axis=2, dtype=np.int64).max(initial=0))


def field_plan(block_sums, qw, K):
    """Choose ``(fields, shift, chunk)`` so that BLAS computes integer products exactly.

    ``block_sums`` are the row L1 norms of the activation codes per BLOCK_K columns
    (``_permute_x``) and ``qw`` the largest weight code magnitude. Over a K chunk every partial
    sum of products of a row, in any order, is at most ``B = qw * max_row L1(chunk)`` in
    magnitude. With ``shift`` s such that ``2^(s-1) > B`` each field is a balanced digit, and
    ``B * sum_i 2^(i s) < 2^53`` keeps every packed partial sum an exact float64 integer. Chunks
    are K itself or multiples of BLOCK_K of at least MIN_CHUNK; typical activations (mean code
    well below 127) fit three fields in one chunk over all of K.
    """
    for fields in (3, 2):
        chunk = K
        while True:
            bound = qw * _chunk_l1(block_sums, chunk, K)
            shift = bound.bit_length() + 1
            if bound * sum(2 ** (i * shift) for i in range(fields)) < EXACT_LIMIT:
                return fields, shift, chunk
            if chunk <= MIN_CHUNK:
                break
            chunk = max(MIN_CHUNK, (chunk // 2) // BLOCK_K * BLOCK_K)
    return 1, 0, K


@numba.njit(cache=True)
def _permute_x(codes_x, per, chunk, xs, block_sums):
    """xs[m, k0 + j * G + g] = codes_x[m, k0 + per * g + j] per chunk at k0 (G bytes), zero past K.

    The activations in the field-major K order of the decoded tiles (``decode_packed_f64``); also
    ``block_sums[m, b]``, the sum of |codes_x[m, k]| over block b of BLOCK_K columns.
    """
    M, K = codes_x.shape
    for m in range(M):
        src = codes_x[m]
        dst = xs[m]
        for k0 in range(0, K, chunk):
            n = min(K, k0 + chunk) - k0
            G = (n + per - 1) // per
            full = n // per
            s = src[k0:k0 + per * full]
            if per == 4:  # ternary: one pass, four streams (2x faster than four passes)
                d0 = dst[k0:k0 + full]
                d1 = dst[k0 + G:k0 + G + full]
                d2 = dst[k0 + 2 * G:k0 + 2 * G + full]
                d3 = dst[k0 + 3 * G:k0 + 3 * G + full]
                for g in range(full):
                    d0[g] = np.float64(s[4 * g])
                    d1[g] = np.float64(s[4 * g + 1])
                    d2[g] = np.float64(s[4 * g + 2])
                    d3[g] = np.float64(s[4 * g + 3])
            for j in range(per):
                d = dst[k0 + j * G:k0 + j * G + full]
                for g in range(full if per != 4 else 0):  # slices: 7x faster than indices
                    d[g] = np.float64(s[per * g + j])
                if full < G:
                    k = per * full + j
                    dst[k0 + j * G + full] = np.float64(src[k0 + k]) if k < n else 0.0
        for b in range(block_sums.shape[1]):
            blk = src[b * BLOCK_K:min(K, (b + 1) * BLOCK_K)]
            t = np.int32(0)
            for k in range(blk.shape[0]):
                v = np.int32(blk[k])
                t += v if v >= 0 else -v
            block_sums[m, b] = t


@numba.njit(cache=True)
def _split3_scale(v, shift, scale_x, scale_w, out, Q):
    """``_split_scale`` for three fields in one chunk, columns q < Q (all three outputs exist).

    Contiguous slices and a hoisted per-tensor scale let the loop vectorize (5x faster than
    indexing ``out[m, i * P + q]``, measured).
    """
    M, P = v.shape
    step = 2.0**shift
    inv = 1.0 / step
    for m in range(M):
        sx = scale_x[m]
        vm = v[m]
        o0 = out[m, 0:Q]
        o1 = out[m, P:P + Q]
        o2 = out[m, 2 * P:2 * P + Q]
        if scale_w.shape[0] == 1:
            sw = scale_w[0]
            for q in range(Q):
                rest = vm[q]
                d0 = rest - np.rint(rest * inv) * step
                rest = (rest - d0) * inv
                d1 = rest - np.rint(rest * inv) * step
                d2 = (rest - d1) * inv
                o0[q] = (np.float32(d0) * sx) * sw
                o1[q] = (np.float32(d1) * sx) * sw
                o2[q] = (np.float32(d2) * sx) * sw
        else:
            w0 = scale_w[0:Q]
            w1 = scale_w[P:P + Q]
            w2 = scale_w[2 * P:2 * P + Q]
            for q in range(Q):
                rest = vm[q]
                d0 = rest - np.rint(rest * inv) * step
                rest = (rest - d0) * inv
                d1 = rest - np.rint(rest * inv) * step
                d2 = (rest - d1) * inv
                o0[q] = (np.float32(d0) * sx) * w0[q]
                o1[q] = (np.float32(d1) * sx) * w1[q]
                o2[q] = (np.float32(d2) * sx) * w2[q]


@numba.njit(cache=True)
def _split_scale(v, shift, fields, acc, first, last, scale_x, scale_w, out, q0):
    """Field i of v[m, q] is the integer sum of output n = i * P + q (balanced digits, exact).

    Adds it to ``acc`` (unless ``first``); on the ``last`` chunk writes
    ``out[m, n] = float32(sum) * scale_x[m] * scale_w[n or 0]``, rounded in float32 in that order.
    Columns q >= q0 only.
    """
    M, P = v.shape
    N = out.shape[1]
    step = 2.0**shift
    inv = 1.0 / step
    stride = 1 if scale_w.shape[0] > 1 else 0
    for m in range(M):
        sx = scale_x[m]
        for q in range(q0, P):
            rest = v[m, q]
            for i in range(fields):
                if i < fields - 1:
                    d = rest - np.rint(rest * inv) * step
                    rest = (rest - d) * inv
                else:
                    d = rest
                n = i * P + q
                if n < N:
                    if not first:
                        d += acc[m, n]
                    if last:
                        out[m, n] = (np.float32(d) * sx) * scale_w[n * stride]
                    else:
                        acc[m, n] = d


def gemm(codes_x, scale_x, data, scale_w, format, K, out):
    """out [M, N] float32 = float32(exact ``codes_x @ codes_w``) * scale_x[:, None] * scale_w.

    scale_w: [1] or [N] float32; out overwritten.
    """
    M = codes_x.shape[0]
    N, nbytes = data.shape
    bits = _BITS[format]
    per = 8 // bits
    # Activations in the tiles' field-major K order, zero past K, laid out for one chunk over K
    # (the usual plan) and redone if the plan needs shorter chunks.
    xs = _work("xs", M * per * nbytes).reshape(M, per * nbytes)
    block_sums = np.empty((M, -(-K // BLOCK_K)), dtype=np.int32)
    _permute_x(codes_x, per, K, xs, block_sums)
    fields, shift, chunk = field_plan(block_sums, WEIGHT_QMAX[format], K)
    if chunk < K:
        _permute_x(codes_x, per, chunk, xs, block_sums)
    P = -(-N // fields)
    chunks = -(-K // chunk)
    acc = np.empty((M, N) if chunks > 1 else (0, 0), dtype=np.float64)
    buf = _work("tile", P * per * -(-min(chunk, K) // per))
    v = _work("v", M * P).reshape(M, P)
    for c in range(chunks):
        k0 = c * chunk
        G = -(-(min(K, k0 + chunk) - k0) // per)
        tile = buf[: P * per * G].reshape(P, per * G)
        decode_packed_f64(data, bits, fields, shift, k0 // per, tile)
        np.matmul(xs[:, k0:k0 + per * G], tile.T, out=v)
        q0 = 0
        if chunks == 1 and fields == 3:
            q0 = max(0, N - 2 * P)  # columns whose three outputs all exist
            _split3_scale(v, shift, scale_x, scale_w, out, q0)
        _split_scale(v, shift, fields, acc, c == 0, c == chunks - 1, scale_x, scale_w, out, q0)
    return out
