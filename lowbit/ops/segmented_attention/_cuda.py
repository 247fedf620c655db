"""Launchers for ``cuda/segmented_attention.cu`` (backends cuda and cudasim).

The host builds the prefix tables of row blocks per segment (of the queries; of the keys for the
``dk``/``dv`` kernel) and keeps them on the device with the query and key segment offsets
(``_kernels.device_constant``: one upload per device and segment layout); the grid covers the
row blocks of every segment. Blocks of ``THREADS`` threads hold
``_Tiles.block_rows`` rows (64 in float32, 32 in float64) and stage tiles of
``_Tiles.tile_rows`` rows of the other operand (32, 16) in shared memory; ``_Tiles`` mirrors the
kernel's geometry to size the dynamic shared memory. Backward: one kernel for
``delta = rowsum(dout * out)``, one for ``dq`` per query block and one for ``dk``/``dv`` per key
block (looping over the query heads of its group), so nothing is summed with float atomics.
Siblings: ``_numpy.py``, ``_numba.py``; reference ``reference/segmented_attention.py``.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "segmented_attention.cu"
#: The kernels' register accumulators are sized for D and Dv up to WARP_SIZE * CHUNK.
CHUNKS = (1, 2, 4)
NAME_EXPRESSIONS = tuple(
    f"segmented_attention_{kind}<{ctype}, {chunk}>"
    for kind in ("fwd", "bwd_dq", "bwd_dkdv") for ctype in _kernels.CTYPE.values()
    for chunk in CHUNKS
) + tuple(f"segmented_attention_bwd_delta<{ctype}>" for ctype in _kernels.CTYPE.values())
WARP_SIZE = 32
THREADS = 128
WARPS = THREADS // WARP_SIZE
#: A warp's lanes: ROW_GROUPS across its rows, COL_GROUPS across key (and feature) columns.
ROW_GROUPS = 4
COL_GROUPS = WARP_SIZE // ROW_GROUPS
#: One shared-memory load: VEC_BYTES // itemsize elements, the rows (and keys) a lane holds.
VEC_BYTES = 16
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kWarpSize": WARP_SIZE, "kThreads": THREADS, "kWarps": WARPS,
                "kRowGroups": ROW_GROUPS, "kColGroups": COL_GROUPS, "kVecBytes": VEC_BYTES}
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


class _Tiles:
    """The kernel's tile geometry for one dtype (kVec, kBlockRows, kTileRows and the shared row
    stride of cuda/segmented_attention.cu), in elements."""

    def __init__(self, dtype):
        self.itemsize = np.dtype(dtype).itemsize
        self.vec = VEC_BYTES // self.itemsize
        self.block_rows = WARPS * ROW_GROUPS * self.vec
        self.tile_rows = COL_GROUPS * self.vec
        # Each warp's [ROW_GROUPS * vec, tile_rows + vec] block of probabilities (or ds).
        self.warp_tiles = self.block_rows * (self.tile_rows + self.vec)

    def stride(self, dim):
        chunk = COL_GROUPS * self.vec
        return -(-dim // chunk) * chunk + self.vec

    def bytes(self, *elements):
        return int(sum(elements)) * self.itemsize


def _tables(offsets, like, block_rows):
    """Device copies of the segment offsets and the row-block prefix table (uploaded once per
    device and content), and the block count."""
    blocks = -(-np.diff(offsets) // block_rows)
    prefix = np.zeros(offsets.size, np.int64)
    np.cumsum(blocks, out=prefix[1:])
    return (_kernels.device_constant(offsets, like), _kernels.device_constant(prefix, like),
            int(prefix[-1]))


def _function(kind, like, dtype, chunk=None):
    name = f"segmented_attention_{kind}<{_kernels.CTYPE[np.dtype(dtype)]}"
    name += ">" if chunk is None else f", {chunk}>"
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(name)


def forward(q, k, v, offsets, k_offsets, scale, causal):
    """q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> (out [Tq, H, Dv], lse [H, Tq])."""
    xp = _backend.array_module(q)
    tokens, heads, dim = q.shape
    kv_heads, dim_v = k.shape[1], v.shape[2]
    chunk = _chunk(dim, dim_v)
    out = _backend.empty((tokens, heads, dim_v), q.dtype, xp)
    lse = _backend.empty((heads, tokens), q.dtype, xp)
    tiles = _Tiles(q.dtype)
    offs, prefix, blocks = _tables(offsets, q, tiles.block_rows)
    k_offs = _kernels.device_constant(k_offsets, q)
    kernel = _function("fwd", q, q.dtype, chunk)
    # q rows, two key tiles, two value tiles (double-buffered), the warps' probabilities.
    shared = _kernels.dynamic_shared(
        kernel, tiles.bytes((tiles.block_rows + 2 * tiles.tile_rows) * tiles.stride(dim),
                            2 * tiles.tile_rows * tiles.stride(dim_v), tiles.warp_tiles),
        q, "segmented_attention")
    kernel(
        _kernels.grid(blocks, heads, what="segmented_attention"), (THREADS,),
        (q, k, v, offs, k_offs, prefix, out, lse, np.int64(offsets.size - 1), np.int64(tokens),
         np.int64(heads), np.int64(kv_heads), np.int64(dim), np.int64(dim_v),
         q.dtype.type(scale), np.int32(causal)),
        shared_mem=shared)
    return out, lse


def backward(dout, q, k, v, out, lse, offsets, k_offsets, scale, causal):
    """Recompute probabilities from ``lse`` -> (dq, dk, dv) shaped like q, k, v."""
    xp = _backend.array_module(q)
    tokens, heads, dim = q.shape
    kv_heads, dim_v = k.shape[1], v.shape[2]
    chunk = _chunk(dim, dim_v)
    dtype = q.dtype.type
    tiles = _Tiles(q.dtype)
    offs, prefix, blocks = _tables(offsets, q, tiles.block_rows)
    k_offs, k_prefix, k_blocks = _tables(k_offsets, q, tiles.block_rows)
    # Rows of q and dout (or k and v) per block plus two tiles of the other pair.
    rows = tiles.block_rows + 2 * tiles.tile_rows
    delta = _backend.empty((heads, tokens), q.dtype, xp)
    _function("bwd_delta", q, q.dtype)(
        (max(1, min(MAX_DELTA_BLOCKS, -(-tokens * heads // WARPS))),), (THREADS,),
        (dout, out, delta, np.int64(tokens), np.int64(heads), np.int64(dim_v)))
    dims = (np.int64(offsets.size - 1), np.int64(tokens), np.int64(heads), np.int64(kv_heads),
            np.int64(dim), np.int64(dim_v), dtype(scale), np.int32(causal))
    dq = _backend.empty(q.shape, q.dtype, xp)
    kernel = _function("bwd_dq", q, q.dtype, chunk)
    kernel(_kernels.grid(blocks, heads, what="segmented_attention's backward"), (THREADS,),
           (dout, q, k, v, lse, delta, offs, k_offs, prefix, dq) + dims,
           shared_mem=_kernels.dynamic_shared(
               kernel, tiles.bytes(rows * (tiles.stride(dim) + tiles.stride(dim_v)),
                                   tiles.warp_tiles), q, "segmented_attention's backward"))
    dk = _backend.empty(k.shape, k.dtype, xp)
    dv = _backend.empty(v.shape, v.dtype, xp)
    kernel = _function("bwd_dkdv", q, q.dtype, chunk)
    kernel(_kernels.grid(k_blocks, kv_heads, what="segmented_attention's backward"), (THREADS,),
           (dout, q, k, v, lse, delta, offs, k_offs, k_prefix, dk, dv) + dims,
           shared_mem=_kernels.dynamic_shared(
               kernel, tiles.bytes(rows * (tiles.stride(dim) + tiles.stride(dim_v)),
                                   2 * tiles.warp_tiles, 4 * tiles.tile_rows),
               q, "segmented_attention's backward"))
    return dq, dk, dv
