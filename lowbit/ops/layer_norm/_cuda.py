"""Launchers for ``cuda/layer_norm.cu`` (backends cuda and cudasim).

One warp per row, ``ROWS_PER_BLOCK`` rows per block; float32 and float64 instantiations.
Siblings: ``__init__.py``, ``_numpy.py``, ``_numba.py`` (same signatures); reference
``reference/layer_norm.py``.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "layer_norm.cu"
NAME_EXPRESSIONS = tuple(f"layer_norm_{kind}<{ctype}>" for kind in ("fwd", "bwd")
                         for ctype in ("float", "double"))
#: Threads per block (a multiple of the warp size).
THREADS = 128
WARP_SIZE = 32
#: Rows per block: one warp each.
ROWS_PER_BLOCK = THREADS // WARP_SIZE
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kWarpSize": WARP_SIZE}


def _kernel(kind, like):
    expression = f"layer_norm_{kind}<{_kernels.CTYPE[like.dtype]}>"
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(expression)


def _blocks(rows):
    return (-(-rows // ROWS_PER_BLOCK),)


def forward(x, eps):
    """x [..., D] -> ``(y, mean, rstd)`` of x's dtype (see ``_numpy.forward``)."""
    xp = _backend.array_module(x)
    D = x.shape[-1]
    rows = x.size // D
    y = _backend.empty(x.shape, x.dtype, xp)
    mean = _backend.empty(x.shape[:-1], x.dtype, xp)
    rstd = _backend.empty(x.shape[:-1], x.dtype, xp)
    if rows:
        _kernel("fwd", x)(_blocks(rows), (THREADS,),
                          (xp.ascontiguousarray(x), y, mean, rstd, np.int64(rows), np.int64(D),
                           x.dtype.type(eps)))
    return y, mean, rstd


def backward(dy, y, rstd):
    """The input gradient [..., D] of dy's dtype (see ``_numpy.backward``)."""
    xp = _backend.array_module(dy)
    D = dy.shape[-1]
    rows = dy.size // D
    dx = _backend.empty(dy.shape, dy.dtype, xp)
    if rows:
        _kernel("bwd", dy)(_blocks(rows), (THREADS,),
                           (xp.ascontiguousarray(dy), xp.ascontiguousarray(y),
                            xp.ascontiguousarray(rstd), dx, np.int64(rows), np.int64(D)))
    return dx
