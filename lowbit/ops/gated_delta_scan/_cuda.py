"""Launchers for ``cuda/gated_delta_scan.cu`` (backends cuda and cudasim).

Siblings: ``_numpy.py``, ``_numba.py`` (same signatures); reference
``reference/gated_delta_scan.py``. One warp per (batch, head, slice of 32 columns of V); the
backward's per-slice partial sums of dq, dk, dlog_decay and dbeta are added here in slice order.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "gated_delta_scan.cu"
NAME_EXPRESSIONS = tuple(f"gated_delta_{kind}<{ctype}>" for kind in ("fwd", "bwd")
                         for ctype in ("float", "double"))
#: Lanes per block (one warp) = columns of V per slice.
LANES = 32
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kLanes": LANES}


def _kernel(name, like):
    expression = f"gated_delta_{name}<{_kernels.CTYPE[like.dtype]}>"
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(expression)


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
        kernel = _kernel("fwd", q)
        kernel(_kernels.grid(nb * nh, -(-nv // LANES), what="gated_delta_scan"), (LANES,),
               (q, k, v, log_decay, beta, initial_state, out, final, checkpoints,
                *_dims(q, v, log_decay, chunk_size), np.int32(keep_checkpoints)),
               shared_mem=_kernels.dynamic_shared(kernel, nk * LANES * q.itemsize, q,
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
    slices = max(1, -(-nv // LANES))
    dq = _backend.empty((slices,) + q.shape, q.dtype, xp)
    dk = _backend.empty((slices,) + k.shape, q.dtype, xp)
    dlog = _backend.empty((slices,) + log_decay.shape, q.dtype, xp)
    dbeta = _backend.empty((slices,) + beta.shape, q.dtype, xp)
    dv = _backend.empty(v.shape, q.dtype, xp)
    dinit = _backend.empty((nb, nh, nk, nv), q.dtype, xp)
    # The states entering each token of the chunk being swept, per (batch, head).
    scratch = _backend.empty((nb, nh, min(chunk_size, max(nt, 1)), nk, nv), q.dtype, xp)
    if nb * nh and nv:
        kernel = _kernel("bwd", q)
        kernel(_kernels.grid(nb * nh, slices, what="gated_delta_scan's backward"), (LANES,),
               (q, k, v, log_decay, beta, checkpoints, dout, dstate, scratch,
                dq, dk, dv, dlog, dbeta, dinit, *_dims(q, v, log_decay, chunk_size)),
               shared_mem=_kernels.dynamic_shared(
                   kernel, 2 * nk * LANES * q.itemsize, q,
                   f"gated_delta_scan's backward at K={nk} ({q.dtype})"))
    return (_sum_slices(xp, dq), _sum_slices(xp, dk), dv, _sum_slices(xp, dlog),
            _sum_slices(xp, dbeta), dinit)
