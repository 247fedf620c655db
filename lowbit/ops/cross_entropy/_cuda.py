"""Launchers for ``cuda/cross_entropy.cu`` (backends cuda and cudasim).

Siblings: ``__init__.py`` (validation, ctx), ``_numpy.py``, ``_numba.py``; reference
``reference/cross_entropy.py``. The row kernels run one warp per row (``ROWS_PER_BLOCK`` rows a
block, grid-stride over the rest); the mean is one block summing the per-row losses in a fixed
order.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "cross_entropy.cu"
NAME_EXPRESSIONS = tuple(f"cross_entropy_{kind}<{ctype}>" for kind in ("fwd", "bwd")
                         for ctype in _kernels.CTYPE.values()) + ("cross_entropy_mean",)
WARP_SIZE = 32
THREADS = 128
ROWS_PER_BLOCK = THREADS // WARP_SIZE
MEAN_THREADS = 256
#: Grid-stride loops cover the rest of the rows; enough blocks to fill any current GPU.
MAX_BLOCKS = 4096
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kWarpSize": WARP_SIZE, "kThreads": THREADS, "kRowsPerBlock": ROWS_PER_BLOCK,
                "kMeanThreads": MEAN_THREADS}


def _function(name, like):
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(name)


def _grid(rows):
    return (min(MAX_BLOCKS, -(-rows // ROWS_PER_BLOCK)),)


def forward(logits, targets, ignore_index):
    """logits [M, V], targets [M] int64 -> (losses [M] float64, 0 where ignored; lse [M])."""
    xp = _backend.array_module(logits)
    M, V = logits.shape
    losses = _backend.empty((M,), np.float64, xp)
    lse = _backend.empty((M,), np.float64, xp)
    if M:
        kernel = _function(f"cross_entropy_fwd<{_kernels.CTYPE[logits.dtype]}>", logits)
        kernel(_grid(M), (THREADS,), (logits, targets, losses, lse, np.int64(M), np.int64(V),
                                      np.int64(ignore_index)))
    return losses, lse


def mean(losses, count):
    """[M] float64 per-row losses -> 0-d float64 ``sum / count`` (NaN for ``count == 0``)."""
    xp = _backend.array_module(losses)
    if count == 0:
        return xp.full((), np.nan, dtype=np.float64)
    loss = _backend.empty((1,), np.float64, xp)
    _function("cross_entropy_mean", losses)((1,), (MEAN_THREADS,),
                                            (losses, loss, np.int64(losses.shape[0]),
                                             np.int64(count)))
    return loss.reshape(())


def backward(dloss, logits, lse, targets, ignore_index, count):
    """dloss [1] float64, logits [M, V], lse [M], targets [M] -> dlogits [M, V] (logits' dtype)."""
    xp = _backend.array_module(logits)
    M, V = logits.shape
    out = _backend.empty((M, V), logits.dtype, xp)
    if M:
        kernel = _function(f"cross_entropy_bwd<{_kernels.CTYPE[logits.dtype]}>", logits)
        kernel(_grid(M), (THREADS,), (xp.ascontiguousarray(dloss), logits, lse, targets, out,
                                      np.int64(M), np.int64(V), np.int64(ignore_index),
                                      np.int64(count)))
    return out
