"""Launchers for ``cuda/gated_delta_scan.cu`` (backends cuda and cudasim).

Siblings: ``_numpy.py``, ``_numba.py`` (same signatures); reference
``reference/gated_delta_scan.py``. A block takes ``cols`` columns of V of one (batch, head),
each column held by a group of ``group`` threads with ``ROWS`` state rows each (``_layout``);
the backward's per-block partial sums of dq, dk, dlog_decay and dbeta along V are added here in
block order.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "gated_delta_scan.cu"
NAME_EXPRESSIONS = tuple(f"gated_delta_{kind}<{ctype}>" for kind in ("fwd", "bwd")
                         for ctype in ("float", "double"))
#: State rows per thread (registers).
ROWS = 8
#: Threads per column at most (one warp): K <= ROWS * MAX_GROUP.
MAX_GROUP = 32
#: Threads per block at most.
MAX_THREADS = 256
#: Tokens per shared-memory tile, forward and backward.
FWD_TILE, BWD_TILE = 16, 2
#: Lanes of a warp: blocks are whole warps.
WARP = 32
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kRows": ROWS, "kMaxGroup": MAX_GROUP, "kMaxThreads": MAX_THREADS,
                "kFwdTile": FWD_TILE, "kBwdTile": BWD_TILE, "kWarpSize": WARP}


def _kernel(name, like):
    expression = f"gated_delta_{name}<{_kernels.CTYPE[like.dtype]}>"
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(expression)


def _layout(nk, nv):
    """(group, cols): threads per column (a power of two, ROWS rows each, covering K) and
    columns per block (whole warps, at most MAX_THREADS threads, no more than V needs)."""
    group = 1
    while group * ROWS < nk:
        group *= 2
    if group > MAX_GROUP:
        raise ValueError(f"gated_delta_scan on the GPU needs K <= {ROWS * MAX_GROUP}, got K={nk}; "
                         "use the numba backend")
    per_warp = WARP // group
    cols = min(MAX_THREADS // group, -(-nv // per_warp) * per_warp)
    return group, cols


def _dims(q, v, log_decay, chunk_size):
    nb, nt, nh, nk = q.shape
    nchunks = -(-nt // chunk_size)
    return (np.int64(nt), np.int32(nh), np.int32(nk), np.int32(v.shape[3]),
            np.int32(log_decay.shape[3]), np.int32(chunk_size), np.int32(nchunks))


def forward(q, k, v, log_decay, beta, initial_state, chunk_size, keep_checkpoints):
    """Same contract as ``_numpy.forward``."""
    xp = _backend.array_module(q)
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    out = _backend.empty((nb, nt, nh, nv), q.dtype, xp)
    final = _backend.empty((nb, nh, nk, nv), q.dtype, xp)
    nchunks = -(-nt // chunk_size) if keep_checkpoints else 0
    checkpoints = _backend.empty((nb, nh, nchunks, nk, nv), q.dtype, xp)
    if nb * nh and nv:
        group, cols = _layout(nk, nv)
        kernel = _kernel("fwd", q)
        shared = FWD_TILE * (3 * group * ROWS + 1 + 2 * cols) * q.itemsize
        kernel(_kernels.grid(nb * nh, -(-nv // cols), what="gated_delta_scan"), (group * cols,),
               (q, k, v, log_decay, beta, initial_state, out, final, checkpoints,
                *_dims(q, v, log_decay, chunk_size), np.int32(keep_checkpoints),
                np.int32(group)),
               shared_mem=_kernels.dynamic_shared(kernel, shared, q,
                                                  f"gated_delta_scan at K={nk} ({q.dtype})"))
    return out, final, (checkpoints if keep_checkpoints else None)


def _sum_slices(xp, partial):
    if partial.shape[0] == 1:
        return partial[0]
    out = _backend.empty(partial.shape[1:], partial.dtype, xp)
    xp.sum(partial, axis=0, out=out)
    return out


def backward(dout, dstate, q, k, v, log_decay, beta, checkpoints, chunk_size):
    """Same contract as ``_numpy.backward``."""
    xp = _backend.array_module(q)
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    group, cols = _layout(nk, max(nv, 1))
    slices = max(1, -(-nv // cols))
    dq = _backend.empty((slices,) + q.shape, q.dtype, xp)
    dk = _backend.empty((slices,) + k.shape, q.dtype, xp)
    dlog = _backend.empty((slices,) + log_decay.shape, q.dtype, xp)
    dbeta = _backend.empty((slices,) + beta.shape, q.dtype, xp)
    dv = _backend.empty(v.shape, q.dtype, xp)
    dinit = _backend.empty((nb, nh, nk, nv), q.dtype, xp)
    threads = group * cols
    # Each thread's state rows entering every tile of the chunk being swept.
    tiles = -(-min(chunk_size, max(nt, 1)) // BWD_TILE)
    scratch = _backend.empty((nb * nh * slices, tiles, ROWS, threads), q.dtype, xp)
    if nb * nh and nv:
        kernel = _kernel("bwd", q)
        width = 3 * group * ROWS + 1
        shared = BWD_TILE * (width + 3 * cols + threads // WARP * width) * q.itemsize
        kernel(_kernels.grid(nb * nh, slices, what="gated_delta_scan's backward"), (threads,),
               (q, k, v, log_decay, beta, checkpoints, dout, dstate, scratch,
                dq, dk, dv, dlog, dbeta, dinit, *_dims(q, v, log_decay, chunk_size),
                np.int32(group)),
               shared_mem=_kernels.dynamic_shared(
                   kernel, shared, q, f"gated_delta_scan's backward at K={nk} ({q.dtype})"))
    else:  # no columns: the sums over V are empty
        for partial in (dq, dk, dlog, dbeta):
            partial[...] = 0
    return (_sum_slices(xp, dq), _sum_slices(xp, dk), dv, _sum_slices(xp, dlog),
            _sum_slices(xp, dbeta), dinit)
