"""Vectorized embedding gather and scatter-add on [P] int64 ids, for numpy arrays only.

Siblings: ``__init__.py`` (validation, ctx), ``_numba.py``, ``_cuda.py`` (``cuda/embedding.cu``);
reference ``reference/embedding.py``. Not array-generic on purpose: the backward's ``np.add.at``
adds its operands one index after another in index order (what makes it bitwise equal to the
other backends), where cupy's ``add.at`` uses atomics whose order varies; and the gather needs
``take``'s ``mode``, which cupy lacks. Cupy arrays go to ``_cuda.py``.
"""

import numpy as np

from ... import _backend


def forward(table, ids):
    """table: [V, D] float, ids: [P] int64 in [0, V) -> out [P, D] of table's dtype."""
    out = _backend.empty((ids.shape[0], table.shape[1]), table.dtype)
    # The ids are checked; the default mode ("raise") would copy the result through a buffer.
    np.take(table, ids, axis=0, out=out, mode="clip")
    return out


def backward(dout, ids, vocab):
    """dout: [P, D] float, ids: [P] int64 in [0, vocab) -> dtable [vocab, D] of dout's dtype."""
    dtable = _backend.empty((vocab, dout.shape[1]), dout.dtype)
    dtable[...] = 0
    np.add.at(dtable, ids, dout)
    return dtable
