"""Vectorized cross-entropy rows (array-generic: numpy or cupy).

Siblings: ``__init__.py`` (validation, ctx), ``_numba.py``, ``_cuda.py``
(``cuda/cross_entropy.cu``); reference ``reference/cross_entropy.py``.
"""

import numpy as np

from ... import _backend


def forward(logits, targets, ignore_index):
    """Per-row loss and logsumexp.

    Args:
        logits: [M, V] float32 or float64. targets: [M] int64, in ``[0, V)`` or ``ignore_index``.
        ignore_index: the target of ignored rows.

    Returns:
        ``(losses, lse)``: [M] float64 each; ``losses`` is 0 in ignored rows. A row with NaN or
        +inf (or only -inf) gets a non-finite lse.
    """
    xp = _backend.array_module(logits)
    M = logits.shape[0]
    losses = _backend.empty((M,), np.float64, xp)
    lse = _backend.empty((M,), np.float64, xp)
    if M == 0:
        return losses, lse
    top = logits.max(axis=1, keepdims=True)
    # inf - inf in a bad row is NaN, which the caller reports; no warning for it here.
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = logits - top
        xp.exp(shifted, out=shifted)
        log_sum = xp.log(shifted.sum(axis=1).astype(np.float64))
        top = top[:, 0].astype(np.float64)
        lse[...] = top + log_sum
        counted = targets != ignore_index
        picked = xp.take_along_axis(logits, xp.where(counted, targets, 0)[:, None], axis=1)[:, 0]
        # log(sum) + (max - x_t): the difference is formed before the large max is added back.
        losses[...] = xp.where(counted, log_sum + (top - picked.astype(np.float64)), 0.0)
    return losses, lse


def mean(losses, count):
    """[M] float64 per-row losses -> 0-d float64 ``sum / count`` (NaN for ``count == 0``)."""
    xp = _backend.array_module(losses)
    if count == 0:
        return xp.full((), np.nan, dtype=np.float64)
    return xp.asarray(losses.sum() / count, dtype=np.float64)


def backward(dloss, logits, lse, targets, ignore_index, count):
    """Gradient of the mean loss.

    Args:
        dloss: [1] float64 incoming gradient. logits: [M, V] float32 or float64. lse: [M]
            float64. targets: [M] int64. ignore_index, count: as in the forward.

    Returns:
        dlogits: [M, V] of the logits' dtype.
    """
    xp = _backend.array_module(logits)
    M, V = logits.shape
    out = _backend.empty((M, V), logits.dtype, xp)
    if M == 0:
        return out
    scale = (dloss / max(count, 1)).astype(logits.dtype)
    # exp((x - max) - (lse - max)), not exp(x - lse) in the dtype: for logits near 1e4 a float32
    # lse is 1e-3 off, while x - max and the small shift lse - max round no worse than x - lse.
    top = logits.max(axis=1, keepdims=True)
    shift = (lse[:, None] - top.astype(np.float64)).astype(logits.dtype)
    xp.subtract(logits, top, out=out)
    out -= shift
    xp.exp(out, out=out)
    counted = targets != ignore_index
    rows = xp.flatnonzero(counted)
    out[rows, targets[rows]] -= 1
    out *= scale
    out[~counted] = 0
    return out
