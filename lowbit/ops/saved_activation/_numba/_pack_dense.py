"""Numba dense packing kernels: per-group quantize and bit-pack rows in one pass.

Package ``lowbit/ops/saved_activation/_numba/``: the entry points in ``__init__.py`` call these;
siblings ``_unpack_dense.py`` (the inverse), ``_sparse.py`` (the sparse format) and
``_common.py`` (the scale floor, status bits and stochastic-rounding noise used here).

A parallel driver hands contiguous ranges of groups to a serial function (compiled on its own,
its inner loops vectorize; inside a parfor body they do not). Each group is read from memory
once: its min/max (through integer order keys of the float bits, which also flag inf/NaN), then,
from cache, its codes, packed into bytes. float32 groups that start on byte boundaries take that
path (``_pack_aligned``); float64 input or groups that share bytes take ``_pack_dense``, whose
tasks hold whole groups starting on a byte boundary.
"""
import numba
import numpy as np

from ._common import EPS, STATUS_NEGATIVE, STATUS_NONFINITE
from ._common import noise as _noise


@numba.njit(inline="always")
def _code(v, lo, scale, levels, nonneg, stochastic, index, key):
    t = (v - lo) / scale
    if stochastic:
        q = np.floor(t + _noise(index, key))
    else:
        q = np.rint(t)
    q = min(max(q, np.float32(0.0)), np.float32(levels))
    c = np.uint32(q)
    if nonneg and c == 0 and v > 0:
        c = np.uint32(1)
    return c


@numba.njit(parallel=True, cache=True)
def _pack_dense(x, bits, nonneg, group_size, groups_per_task, stochastic, key, codes, scales,
                mins, status):
    """Any dtype and group size: tasks of whole groups whose first element is byte-aligned."""
    rows, n = x.shape
    groups = scales.shape[1]
    tasks_per_row = (groups + groups_per_task - 1) // groups_per_task
    per = 8 // bits
    levels = (1 << bits) - 1
    for task in numba.prange(rows * tasks_per_row):
        r = task // tasks_per_row
        g0 = (task - r * tasks_per_row) * groups_per_task
        g1 = min(g0 + groups_per_task, groups)
        for g in range(g0, g1):
            start = g * group_size
            stop = min(start + group_size, n)
            lo = np.float32(np.inf)
            hi = np.float32(-np.inf)
            # v - v is 0 for every finite v and NaN for inf or NaN.
            finite = np.float32(0.0)
            for i in range(start, stop):
                v = np.float32(x[r, i])
                lo = min(lo, v)
                hi = max(hi, v)
                finite += v - v
            flag = 0
            if finite != 0:
                flag |= STATUS_NONFINITE
            if nonneg:
                if lo < 0:
                    flag |= STATUS_NEGATIVE
                lo = np.float32(0.0)
            # +0.0 canonicalizes a -0.0 minimum, so every backend stores the same bits.
            lo = lo + np.float32(0.0)
            status[r, g] = flag
            scales[r, g] = max(hi - lo, EPS) / np.float32(levels)
            if not nonneg:
                mins[r, g] = lo
        first = g0 * group_size
        last = min(g1 * group_size, n)
        g = g0
        boundary = min(first + group_size, n)
        lo = np.float32(0.0) if nonneg else mins[r, g]
        scale = scales[r, g]
        for b in range(first // per, (last + per - 1) // per):
            byte = np.uint32(0)
            for j in range(per):
                i = b * per + j
                if i < last:
                    if i == boundary:
                        g += 1
                        boundary = min(boundary + group_size, n)
                        lo = np.float32(0.0) if nonneg else mins[r, g]
                        scale = scales[r, g]
                    c = _code(np.float32(x[r, i]), lo, scale, levels, nonneg, stochastic,
                              r * n + i, key)
                    byte |= c << np.uint32(j * bits)
            codes[r, b] = byte



#: int32 order keys of float32 bit patterns (``_key``): +inf and above (NaN) ...
KEY_INF = np.int32(0x7F800000)
#: ... and -inf and below (negative NaN) flag a non-finite group.
KEY_NEG_INF = np.int32(-0x7F800001)
#: Keys of -0.0 and +0.0 are -1 and 0: a key below -1 is a negative value.
KEY_NEG_ZERO = np.int32(-1)
KEY_LOW_BITS = np.int32(0x7FFFFFFF)
KEY_SIGN_SHIFT = np.int32(31)


@numba.njit(inline="always")
def _key(b):
    """Order-preserving int32 key of float32 bits b (an involution: ``_key(_key(b)) == b``)."""
    return np.int32(b ^ ((b >> KEY_SIGN_SHIFT) & KEY_LOW_BITS))


@numba.njit(cache=True)
def _pack_aligned_tasks(x, xbits, bits, nonneg, group_size, stochastic, key, codes, scales, mins,
                        status, first, last):
    """Groups ``first..last`` (row-major over [rows, groups]), one after another.

    A serial function called from the parallel driver: compiled on its own, its inner loops
    vectorize (inside a parfor body they do not).
    """
    rows, n = x.shape
    groups = scales.shape[1]
    per = 8 // bits
    levels = np.float32((1 << bits) - 1)
    buf = np.zeros(group_size + 8, np.uint8)
    # Bit casts of keys back to float32 go through this pair of views.
    cast = np.zeros(2, np.int32)
    cast_f = cast.view(np.float32)
    for task in range(first, last):
        r = task // groups
        g = task - r * groups
        start = g * group_size
        m = min(group_size, n - start)
        row = x[r, start:start + m]
        # Group min and max through integer keys: vectorizes without fast-math, and the keys
        # of inf/NaN flag a non-finite group for free.
        lo_key = np.int32(0x7FFFFFFF)
        hi_key = np.int32(-0x80000000)
        bits_row = xbits[r, start:start + m]
        for i in range(m):
            k = _key(bits_row[i])
            lo_key = min(lo_key, k)
            hi_key = max(hi_key, k)
        flag = 0
        if hi_key >= KEY_INF or lo_key <= KEY_NEG_INF:
            flag |= STATUS_NONFINITE
        cast[0] = _key(lo_key)
        cast[1] = _key(hi_key)
        lo = np.float32(0.0)
        if nonneg:
            if lo_key < KEY_NEG_ZERO:
                flag |= STATUS_NEGATIVE
        else:
            lo = cast_f[0] + np.float32(0.0)
            mins[r, g] = lo
        scale = max(cast_f[1] - lo, EPS) / levels
        status[r, g] = flag
        scales[r, g] = scale
        if stochastic:
            base = r * n + start
            for i in range(m):
                q = np.floor((row[i] - lo) / scale + _noise(base + i, key))
                buf[i] = np.uint8(min(max(q, np.float32(0.0)), levels))
        else:
            for i in range(m):
                q = np.rint((row[i] - lo) / scale)
                buf[i] = np.uint8(min(max(q, np.float32(0.0)), levels))
        if nonneg:
            for i in range(m):
                buf[i] += np.uint8((buf[i] == 0) & (row[i] > 0))
        for i in range(m, m + per):
            buf[i] = 0
        out = codes[r, start // per:]
        if per == 1:
            for b in range(m):
                out[b] = buf[b]
        elif per == 2:
            for b in range((m + 1) // 2):
                out[b] = buf[2 * b] | (buf[2 * b + 1] << 4)
        else:
            for b in range((m + 3) // 4):
                out[b] = (buf[4 * b] | (buf[4 * b + 1] << 2) | (buf[4 * b + 2] << 4)
                          | (buf[4 * b + 3] << 6))


@numba.njit(parallel=True, cache=True)
def _pack_aligned(x, xbits, bits, nonneg, group_size, stochastic, key, codes, scales, mins,
                  status, chunks):
    """float32 rows whose groups start on byte boundaries: one vectorized pass per group.

    ``chunks`` (at most the group count) parallel tasks of contiguous groups.
    """
    total = scales.size
    for chunk in numba.prange(chunks):
        _pack_aligned_tasks(x, xbits, bits, nonneg, group_size, stochastic, key, codes, scales,
                            mins, status, chunk * total // chunks, (chunk + 1) * total // chunks)
