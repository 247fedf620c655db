"""Launchers for ``cuda/rms_norm.cu`` (backends cuda and cudasim).

Row kernels: one warp per row, ``ROWS_PER_BLOCK`` rows per block. The weight gradient: a grid of
(row chunks, feature blocks) writes one partial row per chunk, and a second kernel adds the
partials in chunk order (no atomics: bitwise deterministic). float32 and float64
instantiations. Siblings: ``__init__.py``, ``_numpy.py``, ``_numba.py`` (same signatures);
reference ``reference/rms_norm.py``.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "rms_norm.cu"
NAME_EXPRESSIONS = tuple(f"rms_norm_{kind}<{ctype}>"
                         for kind in ("fwd", "bwd", "dweight_partial", "dweight_sum")
                         for ctype in ("float", "double"))
#: Threads per block of the row kernels (a multiple of the warp size).
THREADS = 128
WARP_SIZE = 32
#: Rows per block of the row kernels: one warp each.
ROWS_PER_BLOCK = THREADS // WARP_SIZE
#: Threads per block of the weight-gradient kernels: one feature each.
COLUMN_THREADS = 128
#: Fewest rows of a weight-gradient chunk; more once the rows would make over ``MAX_CHUNKS``
#: chunks, which bounds the partials' memory and the serial sum of the second kernel.
CHUNK_ROWS = 64
MAX_CHUNKS = 1024
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kWarpSize": WARP_SIZE, "kRowThreads": THREADS,
                "kColumnThreads": COLUMN_THREADS}


def _kernel(kind, like):
    expression = f"rms_norm_{kind}<{_kernels.CTYPE[like.dtype]}>"
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(expression)


def _row_blocks(rows):
    return (-(-rows // ROWS_PER_BLOCK),)


def forward(x, weight, eps):
    """x [..., D], weight [D] -> ``(y, rstd)`` of x's dtype (see ``_numpy.forward``)."""
    xp = _backend.array_module(x)
    D = x.shape[-1]
    rows = x.size // D
    y = _backend.empty(x.shape, x.dtype, xp)
    rstd = _backend.empty(x.shape[:-1], x.dtype, xp)
    if rows:
        _kernel("fwd", x)(_row_blocks(rows), (THREADS,),
                          (xp.ascontiguousarray(x), xp.ascontiguousarray(weight), y, rstd,
                           np.int64(rows), np.int64(D), x.dtype.type(eps)))
    return y, rstd


def backward(dy, x, weight, rstd):
    """``(dx [..., D], dweight [D])`` of dy's dtype (see ``_numpy.backward``)."""
    xp = _backend.array_module(dy)
    D = dy.shape[-1]
    rows = dy.size // D
    dx = _backend.empty(dy.shape, dy.dtype, xp)
    if not rows:
        return dx, xp.zeros(D, dy.dtype)
    dy, x = xp.ascontiguousarray(dy), xp.ascontiguousarray(x)
    rstd = xp.ascontiguousarray(rstd)
    _kernel("bwd", dy)(_row_blocks(rows), (THREADS,),
                       (dy, x, xp.ascontiguousarray(weight), rstd, dx, np.int64(rows),
                        np.int64(D)))
    chunk_rows = max(CHUNK_ROWS, -(-rows // MAX_CHUNKS))
    chunks = -(-rows // chunk_rows)
    column_blocks = -(-D // COLUMN_THREADS)
    partial = _backend.empty((chunks, D), dy.dtype, xp)
    dweight = _backend.empty((D,), dy.dtype, xp)
    _kernel("dweight_partial", dy)(
        _kernels.grid(chunks, column_blocks, what="rms_norm_backward's weight gradient"),
        (COLUMN_THREADS,),
        (dy, x, rstd, partial, np.int64(rows), np.int64(D), np.int64(chunk_rows)))
    _kernel("dweight_sum", dy)((column_blocks,), (COLUMN_THREADS,),
                               (partial, dweight, np.int64(chunks), np.int64(D)))
    return dx, dweight
