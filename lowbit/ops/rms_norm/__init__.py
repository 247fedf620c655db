"""RMS norm over the last axis with a weight (BitNet b1.58, Llama): ``rms_norm`` and its pair.

For every row of the last axis (D features), as Hugging Face's ``BitNetRMSNorm`` computes it::

    rstd = 1 / sqrt(sum(x**2) / D + eps);  xhat = x * rstd;  y = weight * xhat
    dx   = rstd * (g - xhat * mean(g * xhat))   with g = weight * dy
    dweight = sum of dy * xhat over every leading index

float32 (computed in float32, the fast path) and float64 (computed in float64) on numpy or cupy
arrays; ``x`` and ``weight`` share one dtype. The backward recomputes ``xhat`` from the input and
``rstd``, so the ctx keeps ``x`` (through the saved-activation policy), ``rstd`` and the weight
(a parameter: not counted). Backends: ``_numpy.py``, ``_numba.py``, ``_cuda.py``
(``cuda/rms_norm.cu``). Reference: ``reference/rms_norm.py``; tests: ``tests/test_rms_norm.py``;
benchmark: ``bench/rms_norm.py``.
"""

from __future__ import annotations

import dataclasses

from ... import _backend, _dispatch, _validate
from ..._ctx import Ctx, Saved
from ..._typing import Array
from ..saved_activation import SavedConfig, save, saved_policy

OP = "rms_norm"
#: The default epsilon added to the mean of the squares (``BitNetRMSNorm``'s).
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class RMSNormCtx(Ctx):
    """What ``rms_norm_backward`` needs.

    Attributes:
        x: the forward input [..., D], contiguous, through the saved-activation policy (with
            ``saved=None`` the caller's array itself when it was contiguous: do not modify it in
            place before the backward).
        rstd: [...] the reciprocal root mean squares, exact, of the forward's dtype.
        weight: [D] the forward's weight, contiguous (a parameter: not counted in ``nbytes``).
        eps: as given to the forward.
    """

    x: Saved
    rstd: Saved
    weight: Array
    eps: float


def _inputs(x, weight):
    """Validate ``x`` and ``weight`` and return both contiguous."""
    x = _validate.floating(_validate.as_array(x, "x"), "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension [..., D], got a 0-d array")
    if x.shape[-1] == 0:
        raise ValueError(f"x must have at least one feature along its last axis, got shape "
                         f"{x.shape}")
    weight = _validate.as_array(weight, "weight")
    if _backend.is_cupy_array(weight) != _backend.is_cupy_array(x):
        kind = "cupy" if _backend.is_cupy_array(x) else "numpy"
        raise TypeError(f"weight must be a {kind} array like x, got "
                        f"{type(weight).__module__}.{type(weight).__name__}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    _validate.shape(weight, (x.shape[-1],), "weight", "x's feature")
    xp = _backend.array_module(x)
    return xp.ascontiguousarray(x), xp.ascontiguousarray(weight)


def rms_norm(x: Array, weight: Array, *, eps: float = EPS) -> Array:
    """Root-mean-square normalize every row of the last axis of ``x``, then scale by ``weight``
    (inference: nothing is saved).

    Args:
        x: [..., D] float32 or float64, numpy or cupy, D >= 1.
        weight: [D] of x's dtype and array kind.
        eps: finite float > 0, added to the mean of the squares.

    Returns:
        y [..., D] of x's dtype and array module: ``weight * (x / sqrt(mean(x**2) + eps))``.

    Raises:
        TypeError: ``x`` or ``weight`` is not an array, ``x`` is not float32/float64, ``weight``
            has another dtype or array kind than ``x``; ``eps`` is not a real number.
        ValueError: ``x`` is 0-d or has no features; ``weight`` is not of shape [D]; ``eps`` is
            not finite or not positive.
    """
    eps = _validate.positive_scalar(eps, "eps")
    x, weight = _inputs(x, weight)
    _, impl = _dispatch.resolve(OP, x, weight)
    y, _ = impl.forward(x, weight, eps)
    return y


def rms_norm_forward(x: Array, weight: Array, *, eps: float = EPS,
                     saved: str | SavedConfig | None = None) -> tuple[Array, RMSNormCtx]:
    """``rms_norm`` that also returns the ctx of ``rms_norm_backward``.

    Args:
        x, weight, eps: as ``rms_norm``.
        saved: saved-activation policy for the input ``x`` (``None`` keeps it exact; a format
            string or ``lowbit.SavedConfig``, unpacked to x's dtype in the backward); ``rstd`` is
            always kept exact.

    Returns:
        ``(y, ctx)``: y [..., D] of x's dtype, ctx an ``RMSNormCtx``.

    Raises:
        TypeError, ValueError: as ``rms_norm``, and for a bad ``saved`` policy (checked first).
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    eps = _validate.positive_scalar(eps, "eps")
    x, weight = _inputs(x, weight)
    _, impl = _dispatch.resolve(OP, x, weight)
    y, rstd = impl.forward(x, weight, eps)
    return y, RMSNormCtx(x=save(x, saved), rstd=save(rstd, None), weight=weight, eps=eps)


def rms_norm_backward(dy: Array, ctx: RMSNormCtx) -> tuple[Array, Array]:
    """Gradients of ``rms_norm_forward``'s output with respect to its input and weight.

    Args:
        dy: [..., D] gradient of ``y``, of the forward's dtype and array kind.
        ctx: the ``RMSNormCtx`` of the forward.

    Returns:
        ``(dx, dweight)``: dx [..., D] and dweight [D] (summed over every leading index), of
        the forward's dtype (computed in it).

    Raises:
        TypeError: ``ctx`` is not an ``RMSNormCtx``; ``dy`` is not an array, has another dtype
            or array kind than the forward's.
        ValueError: ``dy``'s shape is not the forward output's.
    """
    if not isinstance(ctx, RMSNormCtx):
        raise TypeError(f"ctx must be an RMSNormCtx, got {type(ctx).__name__}")
    rstd = ctx.rstd.unpack()
    dy = _validate.grad_dtype(_validate.as_array(dy, "dy"), rstd.dtype, "dy")
    _validate.shape(dy, ctx.x.shape, "dy", "the forward output's")
    if _backend.is_cupy_array(dy) != _backend.is_cupy_array(rstd):
        kind = "cupy" if _backend.is_cupy_array(rstd) else "numpy"
        raise TypeError(f"dy must be a {kind} array like the forward's x, got "
                        f"{type(dy).__module__}.{type(dy).__name__}")
    xp = _backend.array_module(rstd)
    # A packed policy unpacks float32; the gradient is computed in the forward's dtype.
    x = xp.ascontiguousarray(ctx.x.unpack(), dtype=rstd.dtype)
    dy = xp.ascontiguousarray(dy)
    _, impl = _dispatch.resolve(OP, dy, x, ctx.weight, rstd)
    return impl.backward(dy, x, ctx.weight, rstd)
