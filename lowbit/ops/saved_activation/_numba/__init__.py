"""Numba saved-activation packing: quantize-and-pack and unpack-and-dequantize in one pass each.

Siblings: ``_numpy.py``, ``_cuda.py``; reference ``reference/saved_activation.py``. This package
holds the entry points the dispatcher calls (``pack_dense``, ``unpack_dense``, ``pack_sparse``,
``unpack_sparse``, the same signatures as ``_numpy.py``) and the tuning knobs they read at call
time; the kernels live in ``_pack_dense.py``, ``_unpack_dense.py`` and ``_sparse.py``, which share
``_common.py`` (scale floor, status bits, stochastic-rounding noise).

Dense formats: a parallel driver hands contiguous ranges of groups to a serial function; each
group is read from memory once (see ``_pack_dense.py``). Sparse: per chunk, count, mask and
compact the nonzeros in one parallel pass, then prefix-sum and quantize the compacted values in
groups (see ``_sparse.py``). Below ``SERIAL_ELEMENTS`` the serial functions run directly.

Numba caches each kernel keyed on its own file only and freezes the globals and inlined helpers
it reads from other files (``_common.py``, constants of ``lowbit.ops.saved_activation`` and
``lowbit.ops.quantize``): ``numba_cache_guard`` below clears the package's cached kernels
whenever any of them changes, so they recompile.
"""
import numpy as np

from .... import _backend
from ... import quantize as _quantize
from ... import saved_activation as _owner

_backend.numba_cache_guard(__file__, _owner.__file__, _quantize.__file__)

from ._pack_dense import _pack_aligned, _pack_aligned_tasks, _pack_dense  # noqa: E402
from ._sparse import (SPARSE_CHUNK, SPARSE_SLOT, _sparse_collect, _sparse_count,  # noqa: E402
                      _sparse_count_f32, _sparse_gather, _sparse_gather_chunk, _sparse_popcount,
                      _sparse_quantize, _sparse_scatter, _sparse_scatter_chunk)
from ._unpack_dense import _unpack_aligned, _unpack_aligned_tasks, _unpack_dense  # noqa: E402

#: Elements a dense task covers at least, so small groups do not make tiny tasks.
TASK_ELEMENTS = 2048
#: Below this many elements the serial functions run directly: waking the thread pool costs more
#: than the work (tens of microseconds on an idle machine, milliseconds on a loaded one).
SERIAL_ELEMENTS = 1 << 18
#: Most parallel tasks of the aligned dense kernels; each task (a contiguous range of groups)
#: allocates its code buffer once.
MAX_CHUNKS = 256


def _groups_per_task(group_size, bits):
    """Whole groups per task: a multiple of the groups that end on a byte boundary."""
    per = 8 // bits
    aligned = per // np.gcd(group_size, per)
    return aligned * max(1, TASK_ELEMENTS // (aligned * group_size))


def _aligned(dtype, group_size, bits):
    """float32 groups that start on byte boundaries take the one-pass vectorized kernels."""
    return np.dtype(dtype) == np.float32 and group_size % (8 // bits) == 0


def pack_dense(x, bits, nonneg, group_size, stochastic, key):
    """Per-group quantize and bit-pack rows; see ``_numpy.pack_dense`` for shapes."""
    rows, n = x.shape
    groups = -(-n // group_size)
    codes = _backend.empty((rows, -(-n // (8 // bits))), np.uint8)
    scales = _backend.empty((rows, groups), np.float32)
    mins = _backend.empty((rows, 0 if nonneg else groups), np.float32)
    status = _backend.empty((rows, groups), np.uint8)
    if _aligned(x.dtype, group_size, bits):
        args = (x, x.view(np.int32), bits, nonneg, group_size, stochastic, np.uint64(key), codes,
                scales, mins, status)
        if x.size < SERIAL_ELEMENTS:
            _pack_aligned_tasks(*args, 0, scales.size)
        else:
            _pack_aligned(*args, min(scales.size, MAX_CHUNKS))
    else:
        _pack_dense(x, bits, nonneg, group_size, _groups_per_task(group_size, bits), stochastic,
                    np.uint64(key), codes, scales, mins, status)
    return codes, scales, None if nonneg else mins, status


def unpack_dense(codes, scales, mins, bits, n, group_size):
    """Inverse of ``pack_dense``: [rows, n] float32 (``mins`` None means nonneg)."""
    rows = codes.shape[0]
    out = _backend.empty((rows, n), np.float32)
    nonneg = mins is None
    mins = np.empty((rows, 0), np.float32) if nonneg else mins
    if _aligned(np.float32, group_size, bits):
        if out.size < SERIAL_ELEMENTS:
            _unpack_aligned_tasks(codes, scales, mins, bits, group_size, nonneg, out, 0,
                                  scales.size)
        else:
            _unpack_aligned(codes, scales, mins, bits, group_size, nonneg, out,
                            min(scales.size, MAX_CHUNKS))
    else:
        _unpack_dense(codes, scales, mins, bits, group_size, _groups_per_task(group_size, bits),
                      nonneg, out)
    return out


def pack_sparse(flat, group_size, stochastic, key):
    """Mask plus 8-bit codes of the nonzeros; see ``_numpy.pack_sparse`` for shapes."""
    flat = _backend.read_only(flat)
    size = flat.size
    chunks = -(-size // SPARSE_CHUNK)
    mask = _backend.empty((-(-size // 8),), np.uint8)
    counts = np.empty(chunks, np.int64)
    status = _backend.empty((chunks,), np.uint8)
    serial = size < SERIAL_ELEMENTS
    key = np.uint64(key)
    f32 = flat.dtype == np.float32
    if f32:
        slots = np.empty((chunks, SPARSE_SLOT), np.float32)
        slot_noise = np.empty((chunks, SPARSE_SLOT if stochastic else 0), np.float32)
        args = (flat.view(np.int32), flat, mask, counts, status, slots, slot_noise, stochastic,
                key)
        if serial:
            # The driver's Python body: prange is range there, each chunk runs compiled.
            _sparse_count_f32.py_func(*args)
        else:
            _sparse_count_f32(*args)
    else:
        _sparse_count(flat, mask, counts, status)
    offsets = np.zeros(chunks, np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    nnz = int(counts.sum())
    # Compacted nonzeros (and their noise): scratch of nnz elements, not of the full tensor.
    values = np.empty(nnz, np.float32)
    noise = np.empty(nnz if stochastic else 0, np.float32)
    if f32:
        _sparse_collect(flat, mask, counts, offsets, slots, slot_noise, stochastic, key, values,
                        noise)
    elif serial:
        for chunk, start in enumerate(range(0, size, SPARSE_CHUNK)):
            _sparse_gather_chunk(flat, mask, start, min(start + SPARSE_CHUNK, size),
                                 offsets[chunk], stochastic, key, values, noise)
    else:
        _sparse_gather(flat, mask, offsets, stochastic, key, values, noise)
    codes = _backend.empty((nnz,), np.uint8)
    scales = _backend.empty((-(-nnz // group_size),), np.float32)
    _sparse_quantize(values, noise, group_size, stochastic, codes, scales)
    return mask, codes, scales, status


def unpack_sparse(mask, codes, scales, size, group_size):
    """Inverse of ``pack_sparse``: [size] float32."""
    chunks = -(-size // SPARSE_CHUNK)
    counts = np.empty(chunks, np.int64)
    _sparse_popcount(mask, size, counts)
    offsets = np.zeros(chunks, np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    out = _backend.empty((size,), np.float32)
    if size < SERIAL_ELEMENTS:
        for chunk, start in enumerate(range(0, size, SPARSE_CHUNK)):
            _sparse_scatter_chunk(mask, codes, scales, start, min(start + SPARSE_CHUNK, size),
                                  offsets[chunk], group_size, out)
    else:
        _sparse_scatter(mask, codes, scales, offsets, group_size, out)
    return out
