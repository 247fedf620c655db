"""Layer norm over the last axis (no affine parameters): ``layer_norm`` and its training pair.

For every row of the last axis (D features), with the biased variance::

    mean = sum(x) / D;  var = sum((x - mean)**2) / D;  rstd = 1 / sqrt(var + eps)
    y    = (x - mean) * rstd
    dx   = rstd * (dy - mean(dy) - y * mean(dy * y))

float32 (the fast path) and float64 (computed in float64) on numpy or cupy arrays. The backward
needs only the normalized output ``y`` and ``rstd``, so that is what the ctx keeps.

Composite layers (the BDH layer, ``lowbit/ops/lowrank_residual/_layer.py``) call the unvalidated
``normalize`` / ``normalize_backward`` on arrays they have already checked, and keep the
statistics in their own ctx. Backends: ``_numpy.py``, ``_numba.py``, ``_cuda.py``
(``cuda/layer_norm.cu``). Reference: ``reference/layer_norm.py``; tests:
``tests/test_layer_norm.py``; benchmark: ``bench/layer_norm.py``.
"""

from __future__ import annotations

import dataclasses

from ... import _backend, _dispatch, _validate
from ..._ctx import Ctx, Saved
from ..._typing import Array
from ..saved_activation import SavedConfig, save, saved_policy

OP = "layer_norm"
#: The default epsilon added to the biased variance.
EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class LayerNormCtx(Ctx):
    """What ``layer_norm_backward`` needs.

    Attributes:
        y: the normalized output [..., D], through the saved-activation policy (with
            ``saved=None`` the very array the forward returned: do not modify it in place before
            the backward).
        rstd: [...] the reciprocal standard deviations, exact, of the forward's dtype.
        eps: as given to the forward.
    """

    y: Saved
    rstd: Saved
    eps: float


def _input(x):
    """Validate ``x`` and return it contiguous."""
    x = _validate.floating(_validate.as_array(x, "x"), "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension [..., D], got a 0-d array")
    if x.shape[-1] == 0:
        raise ValueError(f"x must have at least one feature along its last axis, got shape "
                         f"{x.shape}")
    return _backend.array_module(x).ascontiguousarray(x)


def layer_norm(x: Array, *, eps: float = EPS) -> Array:
    """Normalize every row of the last axis of ``x`` (inference: nothing is saved).

    Args:
        x: [..., D] float32 or float64, numpy or cupy, D >= 1.
        eps: finite float > 0, added to the biased variance.

    Returns:
        y [..., D] of x's dtype and array module.

    Raises:
        TypeError: ``x`` is not an array or not float32/float64; ``eps`` is not a real number.
        ValueError: ``x`` is 0-d or has no features; ``eps`` is not finite or not positive.
    """
    eps = _validate.positive_scalar(eps, "eps")
    x = _input(x)
    _, impl = _dispatch.resolve(OP, x)
    y, _, _ = impl.forward(x, eps)
    return y


def layer_norm_forward(x: Array, *, eps: float = EPS, saved: str | SavedConfig | None = None
                       ) -> tuple[Array, LayerNormCtx]:
    """``layer_norm`` that also returns the ctx of ``layer_norm_backward``.

    Args:
        x, eps: as ``layer_norm``.
        saved: saved-activation policy for the normalized output (``None`` keeps it exact; a
            format string or ``lowbit.SavedConfig``, unpacked to x's dtype in the backward);
            ``rstd`` is always kept exact.

    Returns:
        ``(y, ctx)``: y [..., D] of x's dtype, ctx a ``LayerNormCtx``.
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    eps = _validate.positive_scalar(eps, "eps")
    x = _input(x)
    _, impl = _dispatch.resolve(OP, x)
    y, _, rstd = impl.forward(x, eps)
    return y, LayerNormCtx(y=save(y, saved), rstd=save(rstd, None), eps=eps)


def layer_norm_backward(dy: Array, ctx: LayerNormCtx) -> Array:
    """Gradient of ``layer_norm_forward``'s output with respect to its input.

    Args:
        dy: [..., D] gradient of ``y``, of the forward's dtype and array kind.
        ctx: the ``LayerNormCtx`` of the forward.

    Returns:
        dx [..., D] of the forward's dtype (computed in it).

    Raises:
        TypeError: ``ctx`` is not a ``LayerNormCtx``; ``dy`` is not an array, has another dtype
            or array kind than the forward's.
        ValueError: ``dy``'s shape is not the forward output's.
    """
    if not isinstance(ctx, LayerNormCtx):
        raise TypeError(f"ctx must be a LayerNormCtx, got {type(ctx).__name__}")
    rstd = ctx.rstd.unpack()
    dy = _validate.as_array(dy, "dy")
    if dy.dtype != rstd.dtype:
        raise TypeError(f"dy must have the dtype of the forward's x ({rstd.dtype}), got "
                        f"{dy.dtype}")
    _validate.shape(dy, ctx.y.shape, "dy", "the forward output's")
    if _backend.is_cupy_array(dy) != _backend.is_cupy_array(rstd):
        kind = "cupy" if _backend.is_cupy_array(rstd) else "numpy"
        raise TypeError(f"dy must be a {kind} array like the forward's x, got "
                        f"{type(dy).__module__}.{type(dy).__name__}")
    xp = _backend.array_module(rstd)
    # A packed policy unpacks float32; the gradient is computed in the forward's dtype.
    y = xp.ascontiguousarray(ctx.y.unpack(), dtype=rstd.dtype)
    dy = xp.ascontiguousarray(dy)
    _, impl = _dispatch.resolve(OP, dy, y)
    return impl.backward(dy, y, rstd)


def normalize(x: Array, eps: float = EPS) -> tuple[Array, Array, Array]:
    """Unvalidated forward for composite layers: ``(y, mean, rstd)``.

    Args:
        x: [..., D] float32 or float64, D >= 1 (the caller has checked it).
        eps: positive float.

    Returns:
        y [..., D], mean and rstd [...], all of x's dtype.
    """
    _, impl = _dispatch.resolve(OP, x)
    return impl.forward(x, eps)


def normalize_backward(dy: Array, y: Array, rstd: Array) -> Array:
    """Unvalidated backward for composite layers: the input gradient [..., D].

    Args:
        dy: [..., D] gradient of the output; y: [..., D] the normalized output (saved or
            recomputed); rstd: [...]; one dtype and array kind.
    """
    _, impl = _dispatch.resolve(OP, dy, y, rstd)
    return impl.backward(dy, y, rstd)
