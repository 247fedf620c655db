"""Numba embedding gather (parallel over positions) and scatter-add (parallel over table rows).

Siblings: ``__init__.py`` (validation, ctx), ``_numpy.py``, ``_cuda.py``; reference
``reference/embedding.py``. The backward sorts the positions by id with a stable counting sort
(serial: one pass to count, a prefix sum, one pass to place), then each task owns a slice of one
table row and adds that row's positions in ascending order, so repeated ids give bitwise the same
sums as ``np.add.at`` (the ``_numpy`` backend) and the CUDA kernels.
"""

import numba
import numpy as np

from ... import _backend

#: Columns of one backward task: with few rows (a small vocabulary, or one hot id) the tasks over
#: the row's columns still keep every thread busy.
COLUMN_CHUNK = 64


@numba.njit(parallel=True, cache=True)
def _gather(table, ids, out):
    dim = table.shape[1]
    for p in numba.prange(ids.shape[0]):
        row = ids[p]
        for d in range(dim):
            out[p, d] = table[row, d]


@numba.njit(cache=True)
def _counting_sort(ids, vocab):
    """(offsets [vocab + 1], order [P]): row v's positions, ascending, are
    order[offsets[v]:offsets[v + 1]]."""
    offsets = np.zeros(vocab + 1, dtype=np.int64)
    for p in range(ids.shape[0]):
        offsets[ids[p] + 1] += 1
    for v in range(vocab):
        offsets[v + 1] += offsets[v]
    cursor = offsets[:-1].copy()
    order = np.empty(ids.shape[0], dtype=np.int64)
    for p in range(ids.shape[0]):
        v = ids[p]
        order[cursor[v]] = p
        cursor[v] += 1
    return offsets, order


@numba.njit(parallel=True, cache=True)
def _scatter_add(dout, offsets, order, chunk, dtable):
    vocab, dim = dtable.shape
    chunks = (dim + chunk - 1) // chunk
    for task in numba.prange(vocab * chunks):
        v = task // chunks
        d0 = (task - v * chunks) * chunk
        d1 = min(d0 + chunk, dim)
        for d in range(d0, d1):
            dtable[v, d] = 0
        for k in range(offsets[v], offsets[v + 1]):
            p = order[k]
            for d in range(d0, d1):
                dtable[v, d] += dout[p, d]


def forward(table, ids):
    """table: [V, D] float, ids: [P] int64 in [0, V) -> out [P, D] of table's dtype."""
    out = _backend.empty((ids.shape[0], table.shape[1]), table.dtype)
    if out.size:
        _gather(*_backend.read_only(table, ids), out)
    return out


def backward(dout, ids, vocab):
    """dout: [P, D] float, ids: [P] int64 in [0, vocab) -> dtable [vocab, D] of dout's dtype."""
    dtable = _backend.empty((vocab, dout.shape[1]), dout.dtype)
    dout, ids = _backend.read_only(dout, ids)
    offsets, order = _counting_sort(ids, vocab)
    _scatter_add(dout, offsets, order, COLUMN_CHUNK, dtable)
    return dtable
