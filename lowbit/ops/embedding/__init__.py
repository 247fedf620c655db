"""Embedding lookup: ``embedding`` (a row gather) and its backward (a deterministic scatter-add).

``out[i] = table[ids[i]]`` for every index ``i`` of an integer array ``ids``; the gradient of the
table sums ``dout[i]`` into row ``ids[i]``, in ascending position order on every backend, so
repeated ids give the same bits run to run and on every CPU backend (numpy, numba, cudasim).
No backend uses float atomics: the CPU kernels and the CUDA kernels sort the positions by id
(a stable counting sort, or a sort of unique keys on the GPU) and give each vocabulary row to one
worker that adds its positions in order.

Backends: ``_numpy.py`` (``np.take`` / ``np.add.at``), ``_numba.py``, ``_cuda.py`` (launchers for
``cuda/embedding.cu``, backends cuda and cudasim). Reference: ``reference/embedding.py``; tests:
``tests/test_embedding.py``; benchmark: ``bench/embedding.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ... import _backend, _ctx, _dispatch, _validate
from ..._typing import Array
from ..saved_activation import save


@dataclasses.dataclass(frozen=True)
class EmbeddingCtx(_ctx.Ctx):
    """What ``embedding_backward`` needs (not the table itself: a parameter the caller holds).

    Attributes:
        ids: saved (exact) integer ids of shape S, as passed to the forward. They must not be
            modified between the forward and the backward.
        table_shape: ``(V, D)`` of the table.
        dtype: the table's dtype (float32 or float64), which ``dout`` must have.
    """

    ids: _ctx.Saved
    table_shape: tuple
    dtype: np.dtype


def _kind(x) -> str:
    return "cupy" if _backend.is_cupy_array(x) else "numpy"


def _first_bad(ids, vocab):
    """(index, value) of the first id outside [0, vocab) in row-major order, else None."""
    if ids.size == 0:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < vocab:
        return None
    xp = _backend.array_module(ids)
    info = np.iinfo(ids.dtype)
    # Compare only against bounds the dtype can hold: int8 ids are never >= 300.
    bad = ids < 0 if info.min < 0 else xp.zeros(ids.shape, dtype=bool)
    if vocab <= info.max:
        bad = bad | (ids >= vocab)
    flat = int(xp.argmax(bad.reshape(-1)))
    index = tuple(int(i) for i in np.unravel_index(flat, ids.shape))
    return index, int(ids.reshape(-1)[flat])


def _check_inputs(table, ids):
    table = _validate.as_array(table, "table")
    ids = _validate.as_array(ids, "ids")
    if _kind(ids) != _kind(table):
        raise TypeError(f"ids must be a {_kind(table)} array like table, got a {_kind(ids)} "
                        "array; lowbit never moves data between host and device")
    if table.ndim != 2:
        raise ValueError(f"table must have rank 2 [V, D], got shape {table.shape}")
    if min(table.shape) < 1:
        raise ValueError(f"table must have positive dimensions, got shape {table.shape}")
    _validate.floating(table, "table")
    if ids.dtype.kind not in "iu":  # bool arrays too: a mask is not a list of rows
        raise TypeError(f"ids must have an integer dtype, got {ids.dtype}")
    vocab = table.shape[0]
    bad = _first_bad(ids, vocab)
    if bad is not None:
        index, value = bad
        where = f"ids[{', '.join(map(str, index))}]" if index else "ids (0-d)"
        raise ValueError(f"ids must lie in [0, {vocab}) (the table's row count), got "
                         f"{where} = {value}")
    return table, ids


def _flat_ids(ids):
    """ids of any shape and integer dtype -> contiguous [P] int64 (values already checked)."""
    xp = _backend.array_module(ids)
    return xp.ascontiguousarray(ids.reshape(-1).astype(np.int64, copy=False))


def _gather(table, ids):
    xp = _backend.array_module(table)
    _, impl = _dispatch.resolve("embedding", table, ids)
    out = impl.forward(xp.ascontiguousarray(table), _flat_ids(ids))
    return out.reshape(ids.shape + (table.shape[1],))


def embedding(table: Array, ids: Array) -> Array:
    """Rows of ``table`` picked by ``ids``: ``out[i] = table[ids[i]]``.

    Args:
        table: [V, D] float32 or float64 (numpy or cupy), V, D >= 1.
        ids: integer array (any integer dtype, not bool) of any shape S, the array kind of
            ``table``, every value in [0, V).

    Returns:
        out: ``[*S, D]`` of the table's dtype, freshly allocated.

    Raises:
        TypeError: non-arrays, mixed numpy/cupy, a table that is not float32/float64, ids that are
            not integers (bool included).
        ValueError: a table that is not [V, D] with V, D >= 1; an id outside [0, V) (the message
            gives the first one in row-major order).
    """
    table, ids = _check_inputs(table, ids)
    return _gather(table, ids)


def embedding_forward(table: Array, ids: Array) -> tuple[Array, EmbeddingCtx]:
    """``embedding`` keeping what the backward needs: the ids (exact), the table's shape/dtype.

    No ``saved=`` policy: the only saved tensor is the integer ids, which must stay exact.

    Args and Raises: as ``embedding``.

    Returns:
        ``(out, ctx)``: out ``[*S, D]`` of the table's dtype; ctx an ``EmbeddingCtx``.
    """
    table, ids = _check_inputs(table, ids)
    out = _gather(table, ids)
    ctx = EmbeddingCtx(ids=save(ids, None), table_shape=tuple(table.shape), dtype=table.dtype)
    return out, ctx


def embedding_backward(dout: Array, ctx: EmbeddingCtx) -> Array:
    """Gradient of ``sum(dout * out)`` with respect to the table of the forward in ``ctx``.

    Args:
        dout: ``[*S, D]``, the dtype and array module of the forward's table.
        ctx: the ``EmbeddingCtx`` returned by ``embedding_forward``.

    Returns:
        dtable: [V, D] of dout's dtype; ``dtable[v]`` is the sum of ``dout[i]`` over the positions
        ``i`` with ``ids[i] == v``, added in ascending row-major position order (bitwise
        deterministic; rows no id picks are zero).

    Raises:
        TypeError: ``ctx`` is not an ``EmbeddingCtx``; ``dout`` not an array, of another array
            kind than the ids or of another dtype than the forward's table.
        ValueError: ``dout`` not shaped ``[*S, D]``.
    """
    if not isinstance(ctx, EmbeddingCtx):
        raise TypeError(f"ctx must be an EmbeddingCtx, got {type(ctx).__name__}")
    dout = _validate.as_array(dout, "dout")
    ids = ctx.ids.unpack()
    if _kind(dout) != _kind(ids):
        raise TypeError(f"dout must be a {_kind(ids)} array like the forward's inputs, got a "
                        f"{_kind(dout)} array")
    if dout.dtype != ctx.dtype:
        raise TypeError(f"dout must have the forward's dtype {ctx.dtype}, got {dout.dtype}")
    vocab, dim = ctx.table_shape
    _validate.shape(dout, ids.shape + (dim,), "dout", "the forward output's")
    xp = _backend.array_module(dout)
    _, impl = _dispatch.resolve("embedding", dout, ids)
    flat = xp.ascontiguousarray(dout).reshape(ids.size, dim)
    return impl.backward(flat, _flat_ids(ids), vocab)
