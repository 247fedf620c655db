"""Numba packed matmul: GEMV over packed bytes, BLAS GEMM on exactly packed integer tiles.

Siblings: ``__init__.py``, ``_numpy.py``, ``_cuda.py``; reference ``reference/packed_matmul.py``;
benchmark ``bench/matmul.py`` (which also times the GEMV variants against each other).

GEMV (few rows): each packed weight byte is read once. On CPUs with AVX-512 VNNI (``USE_VNNI``)
the kernel is ``_gemv_vnni``: per 64 packed bytes, each 2-bit (1-bit) field is masked out in place
and multiplied with an int8 "plane" of the activation codes, ``plane[j][g] = codes_x[per * g +
j]``, by one ``vpdpbusd`` (``lowbit/_simd.py``), and the scales are applied in the same pass
(measured 0.07 ms in the kernel, 0.10 ms a call, for 1 x 4096 x 4096 ternary; the portable loop
takes 0.26 ms). Elsewhere the portable
kernels (``_gemv_acc``) do the same with int16 planes in plain loops that LLVM vectorizes. With
stored codes ``c`` (ternary ``code + 1``, sign the bit) both sum ``raw = sum codes_x * c`` and
the signed result follows from the row sum of the codes: ternary ``acc = raw - sum(codes_x)``,
sign ``acc = 2 raw - sum(codes_x)``; int8 weights become the unsigned operand with their sign
bit flipped, ``acc = raw - 128 sum(codes_x)``. A lookup-table variant (``gemv_lut``: per group
of 4 activations, the 256 sums a ternary byte can select) is kept for the benchmark's
comparison.

GEMM (more rows), with VNNI: ``_gemm_vnni`` spreads the codes of each panel of 64 output columns
to one byte each, four consecutive K to a 32-bit word (ternary through a 256-entry table, sign a
16-entry one, int8 with the sign bit flipped), and runs a register tile of 6 rows x 64 columns of
int32 accumulators over all of K: per four K, four weight vectors and one broadcast word per row
feed 24 ``vpdpbusd``. Exact int32 accumulation; measured 11.9 ms for M = 256, K = N = 4096
(3.8x NumPy float32 matmul, 3.2x the float64-field BLAS path below, which remains the GEMM on CPUs
without VNNI).

GEMM (more rows), portable: integer products are computed exactly in float64 BLAS. Up to three
columns of decoded weight codes are packed into one float64, ``w0 + 2^s w1 + 2^2s w2``; each dot
product with activation codes then carries three integer results in separate bit fields. Over a K
chunk whose partial sums stay below ``2^(s-1)`` in magnitude and whose packed total stays below
2^53, every product and partial sum BLAS forms is an integer below 2^53 and hence exact in any
order; the fields are split again with exact power-of-two arithmetic. The result equals int32
accumulation bit for bit, for a third of the multiply-adds of a float GEMM (float64 BLAS runs at
about half the float32 rate here, so the net gain is about 1.5x before decode and split). Within a
tile, K is laid out field-major (all first fields of the bytes, then all second ones, ...), with the
activations permuted to match, so that decoding is contiguous vector work (measured 9x faster than a
byte-by-byte table decode). The chunk bound is the largest row L1 norm of the activation codes times
the largest weight code, so typical activations need one chunk over all of K: one decode, one dgemm,
and the split fused with the scaling into the output. The helpers around the dgemm are serial
(Numba's and OpenBLAS's worker threads contended on the 2 cores) and the float64 buffers are
per-thread workspaces kept across calls, up to a cap (a fresh 45 MB tile cost ~3 ms of page faults a
call at M = 256, K = N = 4096; measured).

Backward: ``dx = dy @ Qw(w).T`` for few rows walks every packed row once (a transposed GEMV,
``_dx_small``); for more rows it decodes tiles of codes to float32 for BLAS. ``dw`` is BLAS on the
dequantized saved activations.
"""

import threading

import numba
import numpy as np

from ... import _backend, _simd
from ..quantize import WEIGHT_FORMATS as _BITS

#: Whether the GEMV and GEMM use the AVX-512 VNNI kernels (the CPU has them); the portable
#: loops and the float64 BLAS GEMM otherwise.
USE_VNNI = _simd.AVAILABLE
#: Rows at or below which the GEMV kernels run instead of the BLAS GEMM.
GEMV_MAX_ROWS = 8
#: The same for the VNNI kernels: the GEMM spreads every weight code into its panels first
#: (~1.9 ms at K = N = 4096), the GEMV costs ~0.08 ms a row (measured: 16 rows 1.4 ms against
#: 2.5 ms).
VNNI_GEMV_MAX_ROWS = 16
#: Output columns decoded per float32 BLAS tile in ``matmul_float`` (the tile stays in L2/L3).
TILE_N = 512
#: float64 holds integers exactly up to this magnitude.
EXACT_LIMIT = 2**53
#: Largest code magnitude of each weight format.
WEIGHT_QMAX = {"ternary": 1, "sign": 1, "int8": 127}


# ---------------------------------------------------------------------------------------------
# weight decoding


# Field-major: each packed row's first fields, then its second ones, ... (measured 9x faster than
# a byte-by-byte table decode into K order); the float paths permute the activations (or the
# output columns of dx) to match. Serial on purpose: it alternates with BLAS calls, and a Numba
# parallel region right after one ran up to 2x slower against OpenBLAS's spinning workers
# (measured: ternary/None GEMM M = 256, K = N = 4096 116 -> 69 ms serial).
@numba.njit(cache=True)
def _decode_fields_f32(data, bits, n0, g0, out):
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


def decode_fields(data, format, n0, n1, k0, k1):
    """Signed float32 codes of W[k0:k1, n0:n1], transposed and field-major:
    ``[n1 - n0, per * G]`` with column ``j * G + g`` holding K ``k0 + per * g + j`` (k0 a
    multiple of ``per``; columns past k1 hold padding codes)."""
    bits = _BITS[format]
    per = 8 // bits
    G = -(-(k1 - k0) // per)
    out = np.empty((n1 - n0, per * G), dtype=np.float32)
    _decode_fields_f32(data, bits, n0, k0 // per, out)
    return out


def field_major(x, per, G):
    """[M, K] -> [M, per * G]: column ``j * G + g`` = ``x[:, per * g + j]``, zero past K (the
    activations of the float paths; reshaped [M, per, G], the portable GEMV's planes)."""
    M, K = x.shape
    padded = np.zeros((M, G * per), dtype=x.dtype)
    padded[:, :K] = x
    return np.ascontiguousarray(padded.reshape(M, G, per).transpose(0, 2, 1)).reshape(M, per * G)


# ---------------------------------------------------------------------------------------------
# GEMV: a few rows, each packed byte read once


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


@numba.njit(parallel=True, cache=True)
def _lut_gemv2(codes_x, data, out):
    """Ternary GEMV through per-group lookup tables of the 256 sums a byte can select."""
    M, K = codes_x.shape
    N, nbytes = data.shape
    table = np.zeros((M, nbytes, 256), dtype=np.int32)
    for m in range(M):
        for g in numba.prange(nbytes):
            for b in range(256):
                s = np.int32(0)
                for j in range(4):
                    k = 4 * g + j
                    if k < K:
                        s += np.int32(codes_x[m, k]) * (((b >> (2 * j)) & 3) - 1)
                table[m, g, b] = s
    for n in numba.prange(N):
        row = data[n]
        for m in range(M):
            t = table[m]
            acc = np.int32(0)
            for g in range(nbytes):
                acc += t[g, row[g]]
            out[m, n] = acc


# VNNI GEMV: one vpdpbusd per 64 bytes and field (lowbit/_simd.py). The planes are int8, the
# scales are applied in the same pass, and the tail bytes past the last whole block are summed
# here. (Four weight rows per pass over the planes, each plane block loaded once for the four,
# measured no faster for ternary and 7% for sign and int8: not kept.)
_DOT2 = _simd.dot_fields(2)
_DOT1 = _simd.dot_fields(1)
_DOT8 = _simd.dot_fields(8)


@numba.njit(parallel=True, cache=True)
def _gemv_vnni(planes, data, bits, block, xsum, scale_x, scale_w, out):
    """out[m, n] = float32(acc) * scale_x[m] * scale_w[n] with the exact int32 ``acc`` of
    ``_gemv_acc``; xsum[m] is what the stored-code offset adds to the raw sum (see there);
    block: ``_simd.BLOCK_BYTES[bits]``."""
    M = planes.shape[0]
    N, nbytes = data.shape
    niter = nbytes // block
    fields = planes.shape[1]
    mask = (1 << bits) - 1
    stride = 1 if scale_w.shape[0] > 1 else 0
    for n in numba.prange(N):
        row = data[n]
        for m in range(M):
            pl = planes[m]
            if bits == 2:
                raw = _DOT2(pl, row, niter)
            elif bits == 1:
                raw = _DOT1(pl, row, niter)
            else:
                raw = _DOT8(pl, row, niter)
            for g in range(niter * block, nbytes):
                if bits == 8:
                    raw += (np.int32(row[g]) + 128) * np.int32(pl[0, g])
                else:
                    b = np.int32(row[g])
                    for j in range(fields):
                        raw += ((b >> (bits * j)) & mask) * np.int32(pl[j, g])
            # int32 wrap-around throughout: exact whenever the true sum fits in int32
            acc = np.int32(np.int64(raw) * (2 if bits == 1 else 1) - xsum[m])
            out[m, n] = (np.float32(acc) * scale_x[m]) * scale_w[n * stride]


@numba.njit(cache=True)
def _vnni_planes(codes_x, per, offset, planes, xsum):
    """planes[m, j, g] = codes_x[m, per * g + j] (zero past K); xsum[m] = offset * sum(codes_x[m]).
    One small serial pass (the NumPy pad, transpose and sum it replaced cost ~0.02 ms a call)."""
    M, K = codes_x.shape
    G = planes.shape[2]
    for m in range(M):
        for j in range(per):
            for g in range(G):
                k = g * per + j
                planes[m, j, g] = codes_x[m, k] if k < K else 0
        total = np.int32(0)
        for k in range(K):
            total += np.int32(codes_x[m, k])
        xsum[m] = total * np.int32(offset)


def _gemv_scaled(codes_x, scale_x, data, scale_w, format, out):
    """out = float32(codes_x @ codes_w) * scale_x[:, None] * scale_w for few rows."""
    if not USE_VNNI:
        _scale_rows(_gemv_acc(codes_x, data, format), scale_x, scale_w, out)
        return
    bits = _BITS[format]
    per = 8 // bits if bits < 8 else 1
    planes = np.empty((codes_x.shape[0], per, data.shape[1]), dtype=np.int8)
    xsum = np.empty(codes_x.shape[0], dtype=np.int32)
    _vnni_planes(codes_x, per, 128 if bits == 8 else 1, planes, xsum)
    _gemv_vnni(planes, data, bits, _simd.BLOCK_BYTES[bits], xsum, scale_x, scale_w, out)


def _gemv_acc(codes_x, data, format):
    """Exact int32 ``codes_x @ codes_w`` [M, N] for few rows (portable loops, no VNNI)."""
    M, K = codes_x.shape
    N = data.shape[0]
    acc = np.empty((M, N), dtype=np.int32)
    if format == "int8":
        _gemv8(codes_x, data, acc)
        return acc
    per = 8 // _BITS[format]
    planes = field_major(codes_x.astype(np.int16), per, data.shape[1]).reshape(M, per, -1)
    (_gemv2 if per == 4 else _gemv1)(planes, data, acc)
    rowsum = codes_x.sum(axis=1, dtype=np.int32)[:, None]
    return acc - rowsum if format == "ternary" else 2 * acc - rowsum


def gemv_lut(codes_x, data, K):
    """Exact int32 ternary ``codes_x @ codes_w`` [M, N] through lookup tables (benchmarked)."""
    acc = np.empty((codes_x.shape[0], data.shape[0]), dtype=np.int32)
    _lut_gemv2(codes_x, data, acc)
    return acc


# ---------------------------------------------------------------------------------------------
# GEMM: exact integer products in float64 BLAS, three weight columns to a float


#: K columns per block of the activations' L1 sums the field plan reads (a multiple of every
#: format's codes per byte).
BLOCK_K = 64
#: Smallest K chunk worth a BLAS call; below it the plan packs fewer fields per float instead.
MIN_CHUNK = 512


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

    The activations in the field-major K order of the decoded tiles (``_decode_fields``); also
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


# The GEMM helpers are serial on purpose: run between BLAS calls, Numba's worker threads competed
# with OpenBLAS's spinning ones (decode + dgemm + split of a chunk took 16.5 ms back to back
# against 8.5 ms timed apart, measured).


@numba.njit(cache=True)
def _fields_into(a, b, c, bits, j, w1, w2, dst):
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
def _decode_fields(data, bits, fields, shift, g0, out):
    """out[q, j * G + g] = sum_i 2^(i shift) * code(k = per (g0 + g) + j, n = i * P + q).

    Codes are laid out field-major within the tile (K permuted to ``j * G + g``, G = bytes per
    tile row), so every store runs over contiguous memory and vectorizes; the activations are
    permuted the same way. Three (or two) weight columns share one float64; columns past N add
    nothing.
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
            _fields_into(a, b, c, bits, j, w1, w2, out[q, j * G:(j + 1) * G])


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


# VNNI GEMM: a 6 x 64 register tile of int32 accumulators over all of K (lowbit/_simd.py).
_TILE1 = _simd.gemm_tile(1)
_TILE2 = _simd.gemm_tile(2)
_TILE3 = _simd.gemm_tile(3)
_TILE4 = _simd.gemm_tile(4)
_TILE5 = _simd.gemm_tile(5)
_TILE6 = _simd.gemm_tile(6)


def _spread_tables():
    """uint32 spreads, four fields to four bytes: a ternary byte's 2-bit fields, a sign nibble's
    bits."""
    b = np.arange(256, dtype=np.uint32)
    two = sum(((b >> (2 * t)) & 3) << (8 * t) for t in range(4)).astype(np.uint32)
    one = sum(((b[:16] >> t) & 1) << (8 * t) for t in range(4)).astype(np.uint32)
    return two, one


_SPREAD2, _SPREAD1 = _spread_tables()
_PANEL, _TILE_ROWS = _simd.PANEL, _simd.TILE_ROWS  # what the tile intrinsics are built for


@numba.njit(parallel=True, cache=True)
def _gemm_vnni(a, data, bits, xsum, scale_x, scale_w, out):
    """out = float32(acc) * scale_x[:, None] * scale_w, acc the exact int32 product of the codes.

    a: [M, 4 count] int8 activation codes, zero past K; xsum: as in ``_gemv_vnni``. Parallel
    over panels of 64 output columns: each task spreads its columns' codes into one byte each
    (uint32 ``panel[q, n]`` = the four codes of K ``4q .. 4q + 3``), then runs the register tile
    over all of K for each group of six rows.
    """
    M = a.shape[0]
    count = a.shape[1] // 4
    N, nbytes = data.shape
    P = _PANEL
    R = _TILE_ROWS
    stride = 1 if scale_w.shape[0] > 1 else 0
    spread2 = _SPREAD2
    spread1 = _SPREAD1
    for p in numba.prange((N + P - 1) // P):
        n0 = p * P
        width = min(P, N - n0)
        panel = np.zeros((count, P), np.uint32)
        c = np.empty((R, P), np.int32)
        for j in range(width):
            row = data[n0 + j]
            if bits == 2:
                for g in range(nbytes):
                    panel[g, j] = spread2[row[g]]
            elif bits == 1:
                for g in range(nbytes):
                    b = row[g]
                    panel[2 * g, j] = spread1[b & 15]
                    if 2 * g + 1 < count:
                        panel[2 * g + 1, j] = spread1[b >> 4]
            else:
                for g in range(count):
                    v = np.uint32(0)
                    for t in range(4):
                        k = 4 * g + t
                        if k < nbytes:
                            v |= np.uint32(np.uint8(row[k]) ^ np.uint8(128)) << np.uint32(8 * t)
                    panel[g, j] = v
        for m0 in range(0, M, R):
            r = min(R, M - m0)
            if r == 6:
                _TILE6(a, m0, panel, count, c)
            elif r == 5:
                _TILE5(a, m0, panel, count, c)
            elif r == 4:
                _TILE4(a, m0, panel, count, c)
            elif r == 3:
                _TILE3(a, m0, panel, count, c)
            elif r == 2:
                _TILE2(a, m0, panel, count, c)
            else:
                _TILE1(a, m0, panel, count, c)
            for i in range(r):
                m = m0 + i
                sx = scale_x[m]
                for j in range(width):
                    acc = np.int32(np.int64(c[i, j]) * (2 if bits == 1 else 1) - xsum[m])
                    out[m, n0 + j] = (np.float32(acc) * sx) * scale_w[(n0 + j) * stride]



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


def _gemm(codes_x, scale_x, data, scale_w, format, K, out):
    """out [M, N] float32 = exact ``codes_x @ codes_w``, then scales: the VNNI tile where the CPU
    has it, packed-field float64 BLAS otherwise."""
    M = codes_x.shape[0]
    N, nbytes = data.shape
    bits = _BITS[format]
    if USE_VNNI:
        a = np.empty((M, 1, 4 * -(-K // 4)), np.int8)  # one "plane": the codes, zero past K
        xsum = np.empty(M, dtype=np.int32)
        _vnni_planes(codes_x, 1, 128 if bits == 8 else 1, a, xsum)
        _gemm_vnni(a.reshape(M, -1), data, bits, xsum, scale_x, scale_w, out)
        return out
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
        _decode_fields(data, bits, fields, shift, k0 // per, tile)
        np.matmul(xs[:, k0:k0 + per * G], tile.T, out=v)
        q0 = 0
        if chunks == 1 and fields == 3:
            q0 = max(0, N - 2 * P)  # columns whose three outputs all exist
            _split3_scale(v, shift, scale_x, scale_w, out, q0)
        _split_scale(v, shift, fields, acc, c == 0, c == chunks - 1, scale_x, scale_w, out, q0)
    return out


@numba.njit(parallel=True, cache=True)
def _scale_rows(acc, scale_x, scale_w, out):
    """out = float32(acc) * scale_x[m] * scale_w[n or 0], rounded in float32 in that order."""
    M, N = acc.shape
    stride = 1 if scale_w.shape[0] > 1 else 0
    for m in numba.prange(M):
        sx = scale_x[m]
        for n in range(N):
            out[m, n] = (np.float32(acc[m, n]) * sx) * scale_w[n * stride]


def matmul_int(codes_x, scale_x, data, scale_w, format, K):
    """Exact integer product of activation and weight codes, then the two scales.

    Args:
        codes_x: [M, K] int8; scale_x: [M] float32.
        data: packed weight [N, bytes]; scale_w: float32, 0-d or [N]; format; K.

    Returns:
        [M, N] float32: ``float32(acc) * scale_x[:, None] * scale_w``, rounded in that order.
    """
    M = codes_x.shape[0]
    N = data.shape[0]
    y = _backend.empty((M, N), np.float32)
    scale_w = np.ascontiguousarray(scale_w, dtype=np.float32).reshape(-1)
    if M <= (VNNI_GEMV_MAX_ROWS if USE_VNNI else GEMV_MAX_ROWS):
        _gemv_scaled(codes_x, scale_x, data, scale_w, format, y)
    else:
        _gemm(codes_x, scale_x, data, scale_w, format, K, y)
    return y


def matmul_float(x, data, scale_w, format, K):
    """x: [M, K] float32 -> [M, N] float32 ``(x @ codes_w) * scale_w``, float32 accumulation.

    Decodes TILE_N output columns at a time to float32, field-major, and multiplies them with
    the activations permuted to match (BLAS).
    """
    M = x.shape[0]
    N, nbytes = data.shape
    xs = field_major(x, 8 // _BITS[format], nbytes)
    y = _backend.empty((M, N), np.float32)
    for n0 in range(0, N, TILE_N):
        n1 = min(N, n0 + TILE_N)
        tile = decode_fields(data, format, n0, n1, 0, K)
        y[:, n0:n1] = (xs @ tile.T) * (scale_w if scale_w.ndim == 0 else scale_w[n0:n1])
    return y


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


def matmul_dx(dy, data, scale_w, format, K):
    """dy: [M, N] float32 -> dx [M, K] float32 ``dy @ (codes_w * scale_w).T``.

    Few rows: the transposed GEMV kernel over packed bytes. More rows: decode the codes of
    TILE_K input features for all N outputs (field-major) and multiply with BLAS. A per-tensor
    scale (ternary, sign) multiplies once at the end.
    """
    M, N = dy.shape
    dx = _backend.empty((M, K), np.float32)
    g = dy if scale_w.ndim == 0 else np.ascontiguousarray(dy * scale_w, dtype=np.float32)
    if M <= GEMV_MAX_ROWS:
        bits = _BITS[format]
        _dx_small(g, data, bits, K, dx)
    else:
        per = 8 // _BITS[format]
        for k0 in range(0, K, TILE_K):
            k1 = min(K, k0 + TILE_K)
            tile = decode_fields(data, format, 0, N, k0, k1)
            G = tile.shape[1] // per
            # columns j * G + g of the product are K k0 + per * g + j: back to K order
            part = (g @ tile).reshape(M, per, G).transpose(0, 2, 1).reshape(M, per * G)
            dx[:, k0:k1] = part[:, :k1 - k0]
    if scale_w.ndim == 0:
        dx *= scale_w
    return dx


@numba.njit(parallel=True, cache=True)
def _dequantize_rows(codes, scale, out):
    M, K = codes.shape
    for m in numba.prange(M):
        s = scale[m]
        for k in range(K):
            out[m, k] = np.float32(codes[m, k]) * s


def matmul_dw(a, scale_a, dy):
    """dw [K, N] float32 = ``Qa(x).T @ dy`` (BLAS on the dequantized activations).

    Args:
        a: [M, K] int8 codes (with ``scale_a`` [M] float32) or float32 activations (``scale_a``
            None); dy: [M, N] float32.
    """
    if scale_a is not None:
        act = np.empty(a.shape, dtype=np.float32)
        _dequantize_rows(a, scale_a, act)
        a = act
    dw = _backend.empty((a.shape[1], dy.shape[1]), np.float32)
    np.matmul(a.T, dy, out=dw)
    return dw

