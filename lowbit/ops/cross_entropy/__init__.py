"""Cross-entropy of logits against integer class targets, mean over the counted rows.

``cross_entropy(logits, targets)`` is ``torch.nn.functional.cross_entropy(logits, targets,
reduction="mean", ignore_index=...)`` for class indices along the last axis: rows whose target
is ``ignore_index`` count neither in the sum nor in the divisor, and the loss is NaN when no row
counts. The forward is one fused pass per row (row max, sum of exponentials, logsumexp and the
target's loss); the mean is then a fixed-order reduction of the per-row losses, so the result is
bitwise deterministic. The logsumexp is kept in float64 whatever the logits' dtype: the backward
exponentiates ``logits - lse``, and a float32 lse of logits near 1e4 would be off by 1e-3.

Backends: ``_numpy.py`` (vectorized, array-generic), ``_numba.py`` (prange over rows),
``_cuda.py`` (launchers for ``cuda/cross_entropy.cu``, backends cuda and cudasim). Reference:
``reference/cross_entropy.py``; tests: ``tests/test_cross_entropy.py``; benchmark:
``bench/cross_entropy.py``.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from ... import _backend, _ctx, _dispatch, _validate
from ..._typing import Array, Scalar
from ..saved_activation import SavedConfig, save, saved_policy

_INT64 = np.iinfo(np.int64)


@dataclasses.dataclass(frozen=True)
class CrossEntropyCtx(_ctx.Ctx):
    """What ``cross_entropy_backward`` needs.

    Attributes:
        logits: saved ``[..., V]`` logits (exact, or packed by the ``saved=`` policy).
        lse: saved ``[M]`` float64 logsumexp of each of the ``M = prod(...)`` rows (exact).
        targets: saved ``[M]`` int64 targets (exact).
        count: rows whose target is not ``ignore_index`` (the divisor of the mean).
        ignore_index: the target value of ignored rows.
        dtype: dtype of the forward's logits (and of the gradient).
    """

    logits: _ctx.Saved
    lse: _ctx.Saved
    targets: _ctx.Saved
    count: int
    ignore_index: int
    dtype: np.dtype


def _check_inputs(logits, targets, ignore_index):
    """Validate; return ``(logits, targets [M] int64, ignore_index, count)``, both contiguous."""
    logits = _validate.floating(_validate.as_array(logits, "logits"), "logits")
    targets = _validate.as_array(targets, "targets")
    _backend.array_kind(logits, targets)
    if logits.ndim < 1:
        raise ValueError("logits must have at least one dimension (..., V), got a 0-d array")
    classes = logits.shape[-1]
    if classes < 1:
        raise ValueError(f"logits must have V = logits.shape[-1] >= 1 classes, got shape "
                         f"{logits.shape}")
    if targets.dtype.kind not in "iu":
        raise TypeError(f"targets must be an integer array, got dtype {targets.dtype}")
    _validate.shape(targets, logits.shape[:-1], "targets", "the logits' leading")
    ignore_index = _validate.integer(ignore_index, "ignore_index")
    if not _INT64.min <= ignore_index <= _INT64.max:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    xp = _backend.array_module(logits)
    flat = targets.reshape(-1)
    wide = xp.ascontiguousarray(flat.astype(np.int64, copy=False))
    counted = wide != ignore_index
    bad = counted & ((wide < 0) | (wide >= classes))
    if flat.dtype == np.uint64:  # values past int64's range wrapped to negatives above
        bad |= flat > np.uint64(_INT64.max)
    if flat.size and bool(bad.any()):
        first = int(xp.flatnonzero(bad)[0])
        raise ValueError(f"targets must be in [0, {classes}) or equal ignore_index = "
                         f"{ignore_index}, got {int(flat[first])} at flat index {first}")
    count = int(counted.sum()) if flat.size else 0
    return xp.ascontiguousarray(logits), wide, ignore_index, count


def _loss(impl, logits, targets, ignore_index, count):
    """Run the forward kernels on validated input: ``(loss 0-d, lse [M] float64)``."""
    xp = _backend.array_module(logits)
    rows = logits.reshape(-1, logits.shape[-1])
    losses, lse = impl.forward(rows, targets, ignore_index)
    # A NaN or +inf anywhere in a row (or a row of only -inf) makes its logsumexp non-finite; a
    # finite logsumexp with a non-finite loss means the target's own logit is -inf.
    if lse.size and not bool(xp.isfinite(lse).all() & xp.isfinite(losses).all()):
        bad = xp.flatnonzero(~xp.isfinite(lse))
        if bad.size:
            raise ValueError(f"logits must be finite (-inf allowed off the target), got NaN or "
                             f"inf in row {int(bad[0])}")
        row = int(xp.flatnonzero(~xp.isfinite(losses))[0])
        raise ValueError(f"logits must be finite at the target, got -inf at the target of row "
                         f"{row} (an infinite loss)")
    loss = impl.mean(losses, count)
    return loss.astype(logits.dtype), lse


def cross_entropy_forward(logits: Array, targets: Array, *, ignore_index: int = -100,
                          saved: str | SavedConfig | None = None
                          ) -> tuple[Array, CrossEntropyCtx]:
    """Mean cross-entropy over the last axis, keeping what the backward needs.

    Args:
        logits: [..., V] float32 or float64 (numpy or cupy), V >= 1; finite, except that
            entries other than a row's target may be -inf.
        targets: [...] integer array of the same array kind: class indices in ``[0, V)`` or
            ``ignore_index``.
        ignore_index: target value of rows left out of the sum and of the divisor.
        saved: saved-activation policy for the logits (``None``: exact); the logsumexp and the
            targets are always kept exact (the logits are unpacked to their dtype).

    Returns:
        ``(loss, ctx)``: loss a 0-d array of the logits' dtype on their array module (NaN when
        every row is ignored); ctx a ``CrossEntropyCtx``.

    Raises:
        TypeError: non-arrays, non-float logits, non-integer targets, mixed numpy/cupy, a bad
            ``saved`` or ``ignore_index`` type.
        ValueError: 0-d or empty-class logits, targets not shaped ``logits.shape[:-1]``, a
            target outside ``[0, V)`` that is not ``ignore_index`` (before any kernel); NaN or
            inf logits, or -inf at a target (found from the per-row logsumexp).
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    logits, targets, ignore_index, count = _check_inputs(logits, targets, ignore_index)
    _, impl = _dispatch.resolve("cross_entropy", logits, targets)
    loss, lse = _loss(impl, logits, targets, ignore_index, count)
    ctx = CrossEntropyCtx(logits=save(logits, saved), lse=save(lse, None),
                          targets=save(targets, None), count=count, ignore_index=ignore_index,
                          dtype=logits.dtype)
    return loss, ctx


def cross_entropy(logits: Array, targets: Array, *,
                  ignore_index: int = -100) -> Array:
    """Inference form of ``cross_entropy_forward``: returns the 0-d ``loss`` only."""
    logits, targets, ignore_index, count = _check_inputs(logits, targets, ignore_index)
    _, impl = _dispatch.resolve("cross_entropy", logits, targets)
    return _loss(impl, logits, targets, ignore_index, count)[0]


def _dloss(dloss, like, dtype):
    """``dloss`` as a [1] float64 array on the array module of ``like``; an array ``dloss``
    must have the loss's ``dtype`` (a Python or NumPy scalar carries no array dtype)."""
    xp = _backend.array_module(like)
    if isinstance(dloss, (bool, np.bool_)):
        raise TypeError("dloss must be a real scalar or a 0-d float array, got a bool")
    if isinstance(dloss, numbers.Real):
        return xp.full((1,), float(dloss), dtype=np.float64)
    if not (isinstance(dloss, np.ndarray) or _backend.is_cupy_array(dloss)):
        raise TypeError(f"dloss must be a real scalar or a 0-d float array, got "
                        f"{type(dloss).__name__}")
    _backend.array_kind(dloss, like)
    if dloss.ndim != 0:
        raise ValueError(f"dloss must be a scalar (a 0-d array, like the loss), got shape "
                         f"{dloss.shape}")
    _validate.floating(dloss, "dloss")
    _validate.grad_dtype(dloss, dtype, "dloss")
    return dloss.reshape(1).astype(np.float64)


def cross_entropy_backward(dloss: Scalar | Array, ctx: CrossEntropyCtx) -> Array:
    """Gradient of ``dloss * loss`` with respect to the logits of the forward in ``ctx``.

    Args:
        dloss: the incoming gradient of the loss: a Python or NumPy real scalar, or a 0-d
            float array of the loss's dtype on the logits' array module.
        ctx: the ``CrossEntropyCtx`` returned by ``cross_entropy_forward``.

    Returns:
        dlogits: [..., V] of the logits' dtype (computed in it): ``dloss * (softmax(logits) -
        onehot(target)) / count`` in counted rows, zero in ignored rows. Bitwise deterministic.

    Raises:
        TypeError: ``ctx`` is not a ``CrossEntropyCtx``; ``dloss`` not a real scalar or float
            array, an array of another dtype than the loss, or of the other array kind.
        ValueError: ``dloss`` is an array that is not 0-d.
    """
    if not isinstance(ctx, CrossEntropyCtx):
        raise TypeError(f"ctx must be a CrossEntropyCtx, got {type(ctx).__name__}")
    lse, targets = ctx.lse.unpack(), ctx.targets.unpack()
    dloss = _dloss(dloss, lse, ctx.dtype)
    logits = ctx.logits.unpack()
    xp = _backend.array_module(logits)
    shape = logits.shape
    rows = xp.ascontiguousarray(logits.astype(ctx.dtype, copy=False)).reshape(-1, shape[-1])
    _, impl = _dispatch.resolve("cross_entropy", dloss, rows)
    out = impl.backward(dloss, rows, lse, targets, ctx.ignore_index, ctx.count)
    return out.reshape(shape)

