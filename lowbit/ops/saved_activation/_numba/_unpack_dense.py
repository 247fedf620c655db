"""Numba dense unpacking kernels: unpack and dequantize rows of bit-packed group codes.

Package ``lowbit/ops/saved_activation/_numba/``: the entry points in ``__init__.py`` call these;
siblings ``_pack_dense.py`` (the packing these invert), ``_sparse.py``, ``_hash.py``. Groups that
start on byte boundaries unpack in one vectorized pass each (``_unpack_aligned``); groups that
share bytes go element by element (``_unpack_dense``).
"""
import numba
import numpy as np


@numba.njit(cache=True)
def _unpack_aligned_tasks(codes, scales, mins, bits, group_size, nonneg, out, first, last):
    """Groups ``first..last`` of ``_unpack_aligned``, serially (see ``_pack_aligned_tasks``)."""
    rows, n = out.shape
    groups = scales.shape[1]
    per = 8 // bits
    mask = (1 << bits) - 1
    for task in range(first, last):
        r = task // groups
        g = task - r * groups
        start = g * group_size
        m = min(group_size, n - start)
        scale = scales[r, g]
        # 0 + step is step exactly (step >= 0): nonneg shares the values formula.
        lo = np.float32(0.0) if nonneg else mins[r, g]
        src = codes[r, start // per:]
        dst = out[r, start:start + m]
        if per == 1:
            for i in range(m):
                dst[i] = lo + np.float32(src[i]) * scale
        elif per == 2:
            for b in range(m // 2):
                c = src[b]
                dst[2 * b] = lo + np.float32(c & 15) * scale
                dst[2 * b + 1] = lo + np.float32(c >> 4) * scale
        else:
            for b in range(m // 4):
                c = src[b]
                dst[4 * b] = lo + np.float32(c & 3) * scale
                dst[4 * b + 1] = lo + np.float32((c >> 2) & 3) * scale
                dst[4 * b + 2] = lo + np.float32((c >> 4) & 3) * scale
                dst[4 * b + 3] = lo + np.float32(c >> 6) * scale
        for i in range(m - m % per, m):
            c = (np.int64(src[i // per]) >> ((i % per) * bits)) & mask
            dst[i] = lo + np.float32(c) * scale


@numba.njit(parallel=True, cache=True)
def _unpack_aligned(codes, scales, mins, bits, group_size, nonneg, out, chunks):
    """Inverse of ``_pack_aligned``: one vectorized pass per group, in ``chunks`` tasks."""
    total = scales.size
    for chunk in numba.prange(chunks):
        _unpack_aligned_tasks(codes, scales, mins, bits, group_size, nonneg, out,
                              chunk * total // chunks, (chunk + 1) * total // chunks)


@numba.njit(parallel=True, cache=True)
def _unpack_dense(codes, scales, mins, bits, group_size, groups_per_task, nonneg, out):
    """Inverse of ``_pack_dense`` for groups that share packed bytes."""
    rows, n = out.shape
    groups = scales.shape[1]
    tasks_per_row = (groups + groups_per_task - 1) // groups_per_task
    per = 8 // bits
    mask = np.uint32((1 << bits) - 1)
    for task in numba.prange(rows * tasks_per_row):
        r = task // tasks_per_row
        g0 = (task - r * tasks_per_row) * groups_per_task
        g1 = min(g0 + groups_per_task, groups)
        for g in range(g0, g1):
            start = g * group_size
            stop = min(start + group_size, n)
            scale = scales[r, g]
            lo = np.float32(0.0) if nonneg else mins[r, g]
            for i in range(start, stop):
                c = (np.uint32(codes[r, i // per]) >> np.uint32((i % per) * bits)) & mask
                value = np.float32(c) * scale
                out[r, i] = value if nonneg else lo + value
