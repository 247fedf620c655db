"""Launchers for ``cuda/selective_scan.cu`` (backends cuda and cudasim).

Siblings: ``_numpy.py``, ``_numba.py`` (same signatures); reference
``reference/selective_scan.py``. A block takes ``cols`` rows p of the state of one (batch, head),
each held by a group of ``group`` threads with ``STATES`` entries of N each (``_layout``); the
backward's per-block partial sums along P (dB, dC, ddt) and the per-head gradients ([blocks
along P, B, H]) are added here in a fixed order.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "selective_scan.cu"
NAME_EXPRESSIONS = tuple(f"selective_{kind}<{ctype}>" for kind in ("fwd", "bwd")
                         for ctype in ("float", "double"))
#: State entries per thread (registers).
STATES = 8
#: Threads per row p at most (one warp): N <= STATES * MAX_GROUP.
MAX_GROUP = 32
#: Threads per block at most.
MAX_THREADS = 256
#: Tokens per shared-memory tile, forward and backward.
FWD_TILE, BWD_TILE = 16, 2
#: Lanes of a warp: blocks are whole warps.
WARP = 32
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kStates": STATES, "kMaxGroup": MAX_GROUP, "kMaxThreads": MAX_THREADS,
                "kFwdTile": FWD_TILE, "kBwdTile": BWD_TILE, "kWarpSize": WARP}


def _kernel(name, like):
    expression = f"selective_{name}<{_kernels.CTYPE[like.dtype]}>"
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(expression)


def _layout(npp, nn):
    """(group, cols): threads per row p (a power of two, STATES entries each, covering N) and
    rows p per block (whole warps, at most MAX_THREADS threads, no more than P needs)."""
    group = 1
    while group * STATES < nn:
        group *= 2
    if group > MAX_GROUP:
        raise ValueError(f"selective_scan on the GPU needs N <= {STATES * MAX_GROUP}, got "
                         f"N={nn}; use the numba backend")
    per_warp = WARP // group
    cols = min(MAX_THREADS // group, -(-max(npp, 1) // per_warp) * per_warp)
    return group, cols


def forward(x, B, C, dt, dt_bias, A_log, D, initial_state, dt_floor, chunk_size,
            keep_checkpoints):
    """Same contract as ``_numpy.forward``."""
    xp = _backend.array_module(x)
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    out = _backend.empty(x.shape, x.dtype, xp)
    final = _backend.empty((nb, nh, npp, nn), x.dtype, xp)
    nchunks = -(-nt // chunk_size) if keep_checkpoints else 0
    checkpoints = _backend.empty((nb, nh, nchunks, npp, nn), x.dtype, xp)
    if nb * nh and npp:
        group, cols = _layout(npp, nn)
        kernel = _kernel("fwd", x)
        shared = FWD_TILE * (2 * group * STATES + 2 + 2 * cols) * x.itemsize
        kernel(_kernels.grid(nb * nh, -(-npp // cols), what="selective_scan"), (group * cols,),
               (x, B, C, dt, dt_bias, A_log, D, initial_state, out, final, checkpoints,
                np.int64(nt), np.int32(nh), np.int32(npp), np.int32(nn),
                x.dtype.type(dt_floor), np.int32(chunk_size),
                np.int32(-(-nt // chunk_size)), np.int32(keep_checkpoints), np.int32(group)),
               shared_mem=_kernels.dynamic_shared(
                   kernel, shared, x, f"selective_scan at P={npp}, N={nn} ({x.dtype})"))
    return out, final, (checkpoints if keep_checkpoints else None)


def _sum_slices(xp, partial, axes=(0,)):
    """Partial sums added over ``axes`` in a fixed order (the array itself when there is one)."""
    if all(partial.shape[a] == 1 for a in axes):
        return partial.reshape(tuple(n for a, n in enumerate(partial.shape) if a not in axes))
    return partial.sum(axis=axes)


def backward(dout, dstate, x, B, C, dt, dt_bias, A_log, D, checkpoints, dt_floor, chunk_size):
    """Same contract as ``_numpy.backward``."""
    xp = _backend.array_module(x)
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    group, cols = _layout(npp, nn)
    slices = max(1, -(-npp // cols))
    threads = group * cols
    dx = _backend.empty(x.shape, x.dtype, xp)
    dB = _backend.empty((slices,) + B.shape, x.dtype, xp)
    dC = _backend.empty((slices,) + C.shape, x.dtype, xp)
    ddt = _backend.empty((slices,) + dt.shape, x.dtype, xp)
    heads = [_backend.empty((slices, nb, nh), x.dtype, xp) for _ in range(3)]
    dinit = _backend.empty((nb, nh, npp, nn), x.dtype, xp)
    # Each thread's entries of the state entering every tile of the chunk being swept.
    tiles = -(-min(chunk_size, max(nt, 1)) // BWD_TILE)
    scratch = _backend.empty((nb * nh * slices, tiles, STATES, threads), x.dtype, xp)
    if nb * nh and npp:
        kernel = _kernel("bwd", x)
        width = 2 * group * STATES + 4
        shared = BWD_TILE * (2 * group * STATES + 2 + 3 * cols + threads // WARP * width)
        kernel(_kernels.grid(nb * nh, slices, what="selective_scan's backward"), (threads,),
               (x, B, C, dt, dt_bias, A_log, D, checkpoints, dout, dstate, scratch,
                dx, dB, dC, ddt, *heads, dinit,
                np.int64(nt), np.int32(nh), np.int32(npp), np.int32(nn),
                x.dtype.type(dt_floor), np.int32(chunk_size),
                np.int32(checkpoints.shape[2]), np.int32(group)),
               shared_mem=_kernels.dynamic_shared(
                   kernel, shared * x.itemsize, x,
                   f"selective_scan's backward at P={npp}, N={nn} ({x.dtype})"))
    else:  # no rows p: the sums over P are empty
        for partial in (dB, dC, ddt, *heads):
            partial[...] = 0
    ddt_bias, dA_log, dD = (_sum_slices(xp, r, (0, 1)) for r in heads)
    return (dx, _sum_slices(xp, dB), _sum_slices(xp, dC), _sum_slices(xp, ddt), ddt_bias, dA_log,
            dD, dinit)
