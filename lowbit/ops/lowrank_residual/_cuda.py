"""Launchers for ``cuda/lowrank_residual.cu`` (backends cuda and cudasim).

Siblings: ``__init__.py``, ``_numpy.py``, ``_numba.py``; reference
``reference/lowrank_residual.py``.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "lowrank_residual.cu"
NAME_EXPRESSIONS = ("causal_linear_fwd", "causal_linear_bwd")
#: Threads per block (a multiple of the warp size).
THREADS = 128
WARP_SIZE = 32
#: Keys per shared-memory score tile.
TILE = 32
FLOAT_BYTES = 4
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kTile": TILE, "kWarpSize": WARP_SIZE}


def _kernel(name, like):
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(name)


def _segment_bounds(starts, T, xp):
    """Per token, the start and the end of its segment: two [T] int64 arrays, found on the
    array module of ``starts`` (a device search: no copy to the host and back)."""
    segment = xp.searchsorted(starts, xp.arange(T, dtype=np.int64), side="right") - 1
    return starts[segment].astype(np.int64), starts[segment + 1].astype(np.int64)


def causal_linear_forward(x, v, starts, cos, sin):
    """x [B, T, N], v [B, T, D] float32 -> [B, T, D] float32 (see ``_numpy``)."""
    xp = _backend.array_module(x)
    B, T, N = x.shape
    D = v.shape[2]
    x, v = xp.ascontiguousarray(x), xp.ascontiguousarray(v)
    lo, _ = _segment_bounds(starts, T, xp)
    out = _backend.empty((B, T, D), np.float32, xp)
    kernel = _kernel("causal_linear_fwd", x)
    kernel(_kernels.grid(T, B, what="the BDH layer"), (THREADS,),
           (x, v, xp.ascontiguousarray(cos), xp.ascontiguousarray(sin), lo, out, np.int64(T),
            np.int64(N), np.int64(D)),
           shared_mem=_kernels.dynamic_shared(kernel, (N + D + TILE) * FLOAT_BYTES, x,
                                              f"the BDH layer at N={N}, D={D}"))
    return out


def causal_linear_recompute(x, v, starts, cos, sin):
    """``(causal_linear_forward(...), None)``: the kernels keep nothing for the backward."""
    return causal_linear_forward(x, v, starts, cos, sin), None


def causal_linear_backward(da, x, v, starts, cos, sin, cache=None):
    """Gradients ``(dx, dv)`` float32 of ``causal_linear_forward`` (see ``_numpy``; ``cache``
    unused)."""
    xp = _backend.array_module(x)
    B, T, N = x.shape
    D = v.shape[2]
    da, x, v = (xp.ascontiguousarray(a) for a in (da, x, v))
    lo, hi = _segment_bounds(starts, T, xp)
    dx = _backend.empty((B, T, N), np.float32, xp)
    dv = _backend.empty((B, T, D), np.float32, xp)
    kernel = _kernel("causal_linear_bwd", x)
    kernel(_kernels.grid(T, B, what="the BDH layer's backward"), (THREADS,),
           (da, x, v, xp.ascontiguousarray(cos), xp.ascontiguousarray(sin), lo, hi, dx, dv,
            np.int64(T), np.int64(N), np.int64(D)),
           shared_mem=_kernels.dynamic_shared(
               kernel, (2 * N + 3 * D + 2 * TILE) * FLOAT_BYTES, x,
               f"the BDH layer's backward at N={N}, D={D}"))
    return dx, dv
