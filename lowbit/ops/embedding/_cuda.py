"""Launchers for ``cuda/embedding.cu`` (backends cuda and cudasim).

Siblings: ``__init__.py`` (validation, ctx), ``_numpy.py``, ``_numba.py``; reference
``reference/embedding.py``. The backward sorts the positions by id on the array module (cupy on
the GPU, numpy under cudasim) as unique keys ``id * P + position``: with no two keys equal any
sort gives one order, the stable one, so the result does not rest on the sort being stable.
The kernels then decode the keys into per-row slices and sum each row in position order.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "embedding.cu"
NAME_EXPRESSIONS = tuple(
    [f"embedding_fwd<{t}>" for t in ("float", "double")]
    + ["embedding_offsets"]
    + [f"embedding_bwd<{t}>" for t in ("float", "double")]
)
#: Threads of the one-thread-per-item kernels (gather, offsets).
THREADS = 256
#: Threads of a backward block: one table row per block, threads over its columns.
BWD_THREADS = 128
#: Grid-stride loops cover the rest; enough blocks to fill any current GPU.
MAX_BLOCKS = 4096
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kBwdThreads": BWD_THREADS}


def _grid(total):
    return (max(1, min(MAX_BLOCKS, -(-total // THREADS))),)


def _function(name, like):
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(name)


def forward(table, ids):
    """table: [V, D] float, ids: [P] int64 in [0, V) -> out [P, D] of table's dtype."""
    xp = _backend.array_module(table)
    P, D = ids.shape[0], table.shape[1]
    out = _backend.empty((P, D), table.dtype, xp)
    if out.size:
        kernel = _function(f"embedding_fwd<{_kernels.CTYPE[table.dtype]}>", table)
        kernel(_grid(out.size), (THREADS,), (table, ids, out, np.int64(P), np.int64(D)))
    return out


def backward(dout, ids, vocab):
    """dout: [P, D] float, ids: [P] int64 in [0, vocab) -> dtable [vocab, D] of dout's dtype."""
    xp = _backend.array_module(dout)
    P, D = dout.shape
    # Keys stay below vocab * P: far from 2**63 for any table and id count that fit in memory.
    keys = xp.sort(ids * np.int64(P) + xp.arange(P, dtype=np.int64))
    order = xp.empty(P, dtype=np.int64)
    offsets = xp.empty(vocab + 1, dtype=np.int64)
    _function("embedding_offsets", dout)(
        _grid(P + vocab + 1), (THREADS,), (keys, order, offsets, np.int64(P), np.int64(vocab)))
    dtable = _backend.empty((vocab, D), dout.dtype, xp)
    kernel = _function(f"embedding_bwd<{_kernels.CTYPE[dout.dtype]}>", dout)
    kernel((min(vocab, MAX_BLOCKS),), (BWD_THREADS,),
           (dout, order, offsets, dtable, np.int64(vocab), np.int64(D)))
    return dtable
