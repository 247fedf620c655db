"""Launchers for ``cuda/saved_activation.cu`` (backends cuda and cudasim).

Siblings: ``_numpy.py``, ``_numba/``; reference ``reference/saved_activation.py``. The sparse
format takes a prefix sum of per-chunk nonzero counts between kernels (``xp.cumsum``) and reads
the nonzero count back to size its outputs (its one read besides the status).
"""

import math

import numpy as np

from ... import _backend, _kernels
from . import FORMAT_BITS

SOURCE = "saved_activation.cu"
#: Bits per code of the grouped formats, each a template instantiation: (2, 4, 8).
_BITS = tuple(sorted(FORMAT_BITS.values()))
NAME_EXPRESSIONS = (
    tuple(f"pack_dense<{t}, {bits}>" for t in _kernels.CTYPE.values() for bits in _BITS)
    + tuple(f"unpack_dense<{bits}>" for bits in _BITS)
    + tuple(f"sparse_count<{t}>" for t in _kernels.CTYPE.values())
    + tuple(f"sparse_gather<{t}>" for t in _kernels.CTYPE.values())
    + ("sparse_quantize", "sparse_popcount", "sparse_scatter")
)
#: Largest block; also the mask bytes of one sparse chunk, so pack and unpack chunk alike.
THREADS = 256
#: Smallest block: one warp (the block reductions work on whole warps).
MIN_THREADS = 32
#: Grid-stride loops cover the rest; enough blocks to fill any current GPU.
MAX_BLOCKS = 8192
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kWarpSize": MIN_THREADS}


def _kernel(name, like):
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(name)


def _grid(work):
    return (max(1, min(MAX_BLOCKS, work)),)


def _groups_per_task(group_size, bits):
    """Whole groups per block task, so that each task starts on a byte boundary (at most 8)."""
    per = 8 // bits
    return per // math.gcd(group_size, per)


def _block(elements):
    """A power-of-two block of MIN_THREADS..THREADS threads for this many elements of work."""
    return (min(THREADS, max(MIN_THREADS, 1 << max(0, elements - 1).bit_length())),)


def pack_dense(x, bits, nonneg, group_size, stochastic, key):
    """Per-group quantize and bit-pack rows; see ``_numpy.pack_dense`` for shapes."""
    xp = _backend.array_module(x)
    rows, n = x.shape
    groups = -(-n // group_size)
    row_bytes = -(-n // (8 // bits))
    codes = _backend.empty((rows, row_bytes), np.uint8, xp)
    scales = _backend.empty((rows, groups), np.float32, xp)
    mins = _backend.empty((rows, 1 if nonneg else groups), np.float32, xp)
    status = _backend.empty((rows, groups), np.uint8, xp)
    per_task = _groups_per_task(group_size, bits)
    tasks = rows * -(-groups // per_task)
    kernel = _kernel(f"pack_dense<{_kernels.CTYPE[x.dtype]}, {bits}>", x)
    kernel(_grid(tasks), _block(min(group_size, n)),
           (x, codes, scales, mins, status, np.int64(rows), np.int64(n), np.int64(row_bytes),
            np.int64(groups), np.int64(group_size), np.int64(per_task), np.int32(nonneg),
            np.int32(stochastic), np.uint64(key)))
    return codes, scales, None if nonneg else mins, status


def unpack_dense(codes, scales, mins, bits, n, group_size):
    """Inverse of ``pack_dense``: [rows, n] float32 (``mins`` None means nonneg)."""
    xp = _backend.array_module(codes)
    rows, row_bytes = codes.shape
    out = _backend.empty((rows, n), np.float32, xp)
    nonneg = mins is None
    kernel = _kernel(f"unpack_dense<{bits}>", codes)
    block = _block(codes.size)
    kernel(_grid(-(-codes.size // block[0])), block,
           (codes, scales, scales if nonneg else mins, out, np.int64(rows), np.int64(n),
            np.int64(row_bytes), np.int64(scales.shape[1]), np.int64(group_size),
            np.int32(nonneg)))
    return out


def _chunk_offsets(counts, xp):
    """Exclusive prefix sum of per-chunk counts (int64), and the inclusive one (on the device)."""
    inclusive = xp.cumsum(counts)
    offsets = _backend.empty(counts.shape, np.int64, xp)
    offsets[0] = 0
    offsets[1:] = inclusive[:-1]
    return offsets, inclusive


def pack_sparse(flat, group_size, stochastic, key):
    """Mask plus 8-bit codes of the nonzeros; see ``_numpy.pack_sparse`` for shapes."""
    xp = _backend.array_module(flat)
    size = flat.size
    mask_bytes = -(-size // 8)
    chunks = -(-mask_bytes // THREADS)
    mask = _backend.empty((mask_bytes,), np.uint8, xp)
    counts = _backend.empty((chunks,), np.int64, xp)
    status = _backend.empty((chunks,), np.uint8, xp)
    dtype = _kernels.CTYPE[flat.dtype]
    _kernel(f"sparse_count<{dtype}>", flat)(
        _grid(chunks), (THREADS,), (flat, mask, counts, status, np.int64(size)))
    offsets, inclusive = _chunk_offsets(counts, xp)
    # The one size the host must know: the nonzero count sizes the outputs.
    nnz = int(_kernels.host_copy(inclusive[-1:])[0])
    # Compacted nonzeros (and their noise): scratch of nnz elements, not of the full tensor.
    values = _backend.empty((max(nnz, 1),), np.float32, xp)
    noise = _backend.empty((max(nnz, 1) if stochastic else 1,), np.float32, xp)
    _kernel(f"sparse_gather<{dtype}>", flat)(
        _grid(chunks), (THREADS,),
        (flat, mask, offsets, values, noise, np.int64(size), np.int32(stochastic),
         np.uint64(key)))
    codes = _backend.empty((nnz,), np.uint8, xp)
    groups = -(-nnz // group_size)
    scales = _backend.empty((groups,), np.float32, xp)
    if groups:
        _kernel("sparse_quantize", flat)(
            _grid(groups), _block(min(group_size, nnz)),
            (values, noise, codes, scales, np.int64(nnz), np.int64(group_size),
             np.int32(stochastic)))
    return mask, codes, scales, status


def unpack_sparse(mask, codes, scales, size, group_size):
    """Inverse of ``pack_sparse``: [size] float32."""
    xp = _backend.array_module(mask)
    chunks = -(-mask.size // THREADS)
    counts = _backend.empty((chunks,), np.int64, xp)
    _kernel("sparse_popcount", mask)(_grid(chunks), (THREADS,),
                                     (mask, counts, np.int64(mask.size)))
    offsets, _ = _chunk_offsets(counts, xp)
    out = _backend.empty((size,), np.float32, xp)
    # Empty codes/scales still need a valid pointer: no nonzero is ever read through them.
    _kernel("sparse_scatter", mask)(
        _grid(chunks), (THREADS,),
        (mask, codes if codes.size else mask, scales if scales.size else out, offsets, out,
         np.int64(size), np.int64(group_size)))
    return out
