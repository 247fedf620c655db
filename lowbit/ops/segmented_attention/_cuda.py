"""Launchers for ``cuda/segmented_attention.cu`` (backends cuda and cudasim).

The host builds the prefix table of row blocks per segment and keeps it on the device with the
segment offsets (``_kernels.device_constant``: one upload per device and segment layout); the
grid covers the row blocks of every segment. Backward: one kernel for
``delta = rowsum(dout * out)``, one for ``dq`` per query block and one for ``dk``/``dv`` per key
block (looping over the query heads of its group), so nothing is summed with float atomics.
Siblings: ``_numpy.py``, ``_numba.py``; reference ``reference/segmented_attention.py``.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "segmented_attention.cu"
#: Feature elements each lane holds in registers: D and Dv up to WARP_SIZE * CHUNK.
CHUNKS = (1, 2, 4)
NAME_EXPRESSIONS = tuple(
    f"segmented_attention_{kind}<{ctype}, {chunk}>"
    for kind in ("fwd", "bwd_dq", "bwd_dkdv") for ctype in _kernels.CTYPE.values()
    for chunk in CHUNKS
) + tuple(f"segmented_attention_bwd_delta<{ctype}>" for ctype in _kernels.CTYPE.values())
WARP_SIZE = 32
THREADS = 128
BLOCK_ROWS = 8
TILE = 16
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kWarpSize": WARP_SIZE, "kThreads": THREADS, "kBlockRows": BLOCK_ROWS,
                "kTile": TILE}
#: Grid-stride loops cover the rest of the delta rows.
MAX_DELTA_BLOCKS = 4096
MAX_DIM = WARP_SIZE * CHUNKS[-1]


def _chunk(dim, dim_v):
    need = max(dim, dim_v)
    for chunk in CHUNKS:
        if need <= WARP_SIZE * chunk:
            return chunk
    raise ValueError(f"the cuda and cudasim backends support head dimensions up to {MAX_DIM}, "
                     f"got D={dim}, Dv={dim_v} (q, k, v); use the numba or numpy backend")


def _tables(offsets, like):
    """Device copies of the segment offsets and the row-block prefix table (uploaded once per
    device and content), and the block count."""
    blocks = -(-np.diff(offsets) // BLOCK_ROWS)
    prefix = np.zeros(offsets.size, np.int64)
    np.cumsum(blocks, out=prefix[1:])
    return (_kernels.device_constant(offsets, like), _kernels.device_constant(prefix, like),
            int(prefix[-1]))


def _function(kind, like, dtype, chunk=None):
    name = f"segmented_attention_{kind}<{_kernels.CTYPE[np.dtype(dtype)]}"
    name += ">" if chunk is None else f", {chunk}>"
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(name)


def forward(q, k, v, offsets, scale, causal):
    """q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] -> (out [T, H, Dv], lse [H, T])."""
    xp = _backend.array_module(q)
    tokens, heads, dim = q.shape
    kv_heads, dim_v = k.shape[1], v.shape[2]
    chunk = _chunk(dim, dim_v)
    out = _backend.empty((tokens, heads, dim_v), q.dtype, xp)
    lse = _backend.empty((heads, tokens), q.dtype, xp)
    offs, prefix, blocks = _tables(offsets, q)
    kernel = _function("fwd", q, q.dtype, chunk)
    shared = _kernels.dynamic_shared(kernel, TILE * (dim + dim_v) * q.itemsize, q,
                                     "segmented_attention")
    kernel(
        _kernels.grid(blocks, heads, what="segmented_attention"), (THREADS,),
        (q, k, v, offs, prefix, out, lse, np.int64(offsets.size - 1), np.int64(tokens),
         np.int64(heads), np.int64(kv_heads), np.int64(dim), np.int64(dim_v),
         q.dtype.type(scale), np.int32(causal)),
        shared_mem=shared)
    return out, lse


def backward(dout, q, k, v, out, lse, offsets, scale, causal):
    """Recompute probabilities from ``lse`` -> (dq, dk, dv) shaped like q, k, v."""
    xp = _backend.array_module(q)
    tokens, heads, dim = q.shape
    kv_heads, dim_v = k.shape[1], v.shape[2]
    chunk = _chunk(dim, dim_v)
    dtype = q.dtype.type
    offs, prefix, blocks = _tables(offsets, q)
    delta = _backend.empty((heads, tokens), q.dtype, xp)
    warps_per_block = THREADS // WARP_SIZE
    _function("bwd_delta", q, q.dtype)(
        (max(1, min(MAX_DELTA_BLOCKS, -(-tokens * heads // warps_per_block))),), (THREADS,),
        (dout, out, delta, np.int64(tokens), np.int64(heads), np.int64(dim_v)))
    dims = (np.int64(offsets.size - 1), np.int64(tokens), np.int64(heads), np.int64(kv_heads),
            np.int64(dim), np.int64(dim_v), dtype(scale), np.int32(causal))
    dq = _backend.empty(q.shape, q.dtype, xp)
    kernel = _function("bwd_dq", q, q.dtype, chunk)
    kernel(_kernels.grid(blocks, heads, what="segmented_attention's backward"), (THREADS,),
           (dout, q, k, v, lse, delta, offs, prefix, dq) + dims,
           shared_mem=_kernels.dynamic_shared(kernel, TILE * (dim + dim_v) * q.itemsize, q,
                                              "segmented_attention's backward"))
    dk = _backend.empty(k.shape, k.dtype, xp)
    dv = _backend.empty(v.shape, v.dtype, xp)
    kernel = _function("bwd_dkdv", q, q.dtype, chunk)
    kernel(_kernels.grid(blocks, kv_heads, what="segmented_attention's backward"), (THREADS,),
           (dout, q, k, v, lse, delta, offs, prefix, dk, dv) + dims,
           shared_mem=_kernels.dynamic_shared(kernel, TILE * (dim + dim_v + 2) * q.itemsize, q,
                                              "segmented_attention's backward"))
    return dq, dk, dv
