"""Launchers for ``cuda/selective_scan.cu`` (backends cuda and cudasim).

Siblings: ``_numpy.py``, ``_numba.py`` (same signatures); reference
``reference/selective_scan.py``. One warp per (batch, head); the per-head gradients come back as
[B, H] rows and are summed over the batch here.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "selective_scan.cu"
NAME_EXPRESSIONS = tuple(f"selective_{kind}<{ctype}>" for kind in ("fwd", "bwd")
                         for ctype in ("float", "double"))
#: Lanes per block (one warp).
LANES = 32
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kLanes": LANES}


def _kernel(name, like):
    expression = f"selective_{name}<{_kernels.CTYPE[like.dtype]}>"
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(expression)


def _rows_per_lane(npp):
    return -(-npp // LANES)


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
        kernel = _kernel("fwd", x)
        kernel(_kernels.grid(nb * nh, what="selective_scan"), (LANES,),
               (x, B, C, dt, dt_bias, A_log, D, initial_state, out, final, checkpoints,
                np.int64(nt), np.int32(nh), np.int32(npp), np.int32(nn),
                x.dtype.type(dt_floor), np.int32(chunk_size),
                np.int32(-(-nt // chunk_size)), np.int32(keep_checkpoints)),
               shared_mem=_kernels.dynamic_shared(
                   kernel, _rows_per_lane(npp) * nn * LANES * x.itemsize, x,
                   f"selective_scan at P={npp}, N={nn} ({x.dtype})"))
    return out, final, (checkpoints if keep_checkpoints else None)


def backward(dout, dstate, x, B, C, dt, dt_bias, A_log, D, checkpoints, dt_floor, chunk_size):
    """Same contract as ``_numpy.backward``."""
    xp = _backend.array_module(x)
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    dx = _backend.empty(x.shape, x.dtype, xp)
    dB = _backend.empty(B.shape, x.dtype, xp)
    dC = _backend.empty(C.shape, x.dtype, xp)
    ddt = _backend.empty(dt.shape, x.dtype, xp)
    rows = [_backend.empty((nb, nh), x.dtype, xp) for _ in range(3)]
    dinit = _backend.empty((nb, nh, npp, nn), x.dtype, xp)
    # The states entering each token of the chunk being swept, per (batch, head).
    scratch = _backend.empty((nb, nh, min(chunk_size, max(nt, 1)), npp, nn), x.dtype, xp)
    if nb * nh and npp:
        kernel = _kernel("bwd", x)
        kernel(_kernels.grid(nb * nh, what="selective_scan's backward"), (LANES,),
               (x, B, C, dt, dt_bias, A_log, D, checkpoints, dout, dstate, scratch,
                dx, dB, dC, ddt, *rows, dinit,
                np.int64(nt), np.int32(nh), np.int32(npp), np.int32(nn),
                x.dtype.type(dt_floor), np.int32(chunk_size),
                np.int32(checkpoints.shape[2])),
               shared_mem=_kernels.dynamic_shared(
                   kernel, _rows_per_lane(npp) * (2 * nn + 1) * LANES * x.itemsize, x,
                   f"selective_scan's backward at P={npp}, N={nn} ({x.dtype})"))
    ddt_bias, dA_log, dD = (r.sum(axis=0) for r in rows)
    return dx, dB, dC, ddt, ddt_bias, dA_log, dD, dinit
