"""Reference embedding lookup and its gradient: explicit loops over positions, float64.

Checked against: lowbit/ops/embedding/ (every backend), tests/test_embedding.py,
bench/embedding.py.
"""

import numpy as np


def embedding_ref(table, ids):
    """``out[i] = table[ids[i]]`` for every index ``i`` of ``ids``.

    Args:
        table: [V, D] array.
        ids: integer array of any shape S, values in [0, V).

    Returns:
        [*S, D] float64.
    """
    table = np.asarray(table, dtype=np.float64)
    ids = np.asarray(ids)
    out = np.zeros(ids.shape + (table.shape[1],), dtype=np.float64)
    for index in np.ndindex(*ids.shape):
        row = int(ids[index])
        assert 0 <= row < table.shape[0], (index, row)
        for d in range(table.shape[1]):
            out[index + (d,)] = table[row, d]
    return out


def embedding_bwd_ref(dout, ids, vocab):
    """Gradient of ``sum(dout * embedding_ref(table, ids))`` with respect to ``table``.

    Row ``v`` of the result is the sum of ``dout[i]`` over the positions ``i`` with
    ``ids[i] == v``, added in ascending (row-major) position order.

    Args:
        dout: [*S, D] array.
        ids: integer array of shape S, values in [0, vocab).
        vocab: V, the table's row count.

    Returns:
        [V, D] float64.
    """
    ids = np.asarray(ids)
    dout = np.asarray(dout, dtype=np.float64)
    dim = dout.shape[-1]
    assert dout.shape == ids.shape + (dim,), (dout.shape, ids.shape)
    dtable = np.zeros((vocab, dim), dtype=np.float64)
    for index in np.ndindex(*ids.shape):
        row = int(ids[index])
        assert 0 <= row < vocab, (index, row)
        for d in range(dim):
            dtable[row, d] += dout[index + (d,)]
    return dtable
