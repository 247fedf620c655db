"""Vectorized AdamW step and gradient sum of squares (array-generic: numpy or cupy).

Siblings: ``__init__.py`` (the optimizer), ``_numba.py``, ``_cuda.py`` (``cuda/adamw.cu``);
reference ``reference/adamw.py``. ``coefficients`` is shared by every backend, so they all start
from the same rounded scalars.

``step`` updates its ``param``, ``exp_avg`` and ``exp_avg_sq`` arguments in place: the one
documented exception to the backend contract's "inputs are never modified".
"""

from __future__ import annotations

import collections
import math

import numpy as np

from ... import _backend

#: Elements per slice of ``step``: its temporaries stay in cache.
STEP_CHUNK = 1 << 15
#: Elements per partial sum of ``sum_squares``: bounds the float64 temporary and fixes the order.
SUM_CHUNK = 1 << 16

Coefficients = collections.namedtuple(
    "Coefficients", "decay one_minus_beta1 beta2 one_minus_beta2 eps step_size sqrt_bias2 "
    "grad_scale")


def coefficients(dtype, lr, beta1, beta2, eps, weight_decay, bias1, bias2, grad_scale):
    """The scalars of one step, formed in float64 and rounded once to the arithmetic ``dtype``.

    ``bias1``/``bias2`` are ``1 - beta1**t`` and ``1 - beta2**t``; ``grad_scale`` the clipping
    coefficient (1.0 when not clipping).
    """
    t = np.dtype(dtype).type
    return Coefficients(
        decay=t(1.0 - lr * weight_decay), one_minus_beta1=t(1.0 - beta1), beta2=t(beta2),
        one_minus_beta2=t(1.0 - beta2), eps=t(eps), step_size=t(lr / bias1),
        sqrt_bias2=t(math.sqrt(bias2)), grad_scale=t(grad_scale))


def step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bias1, bias2,
         grad_scale):
    """One AdamW step of one parameter, IN PLACE on ``param``, ``exp_avg`` and ``exp_avg_sq``.

    Args:
        param: [n] float32 or float64, C-contiguous; updated in place.
        grad: [n] of ``param``'s dtype; read only.
        exp_avg, exp_avg_sq: [n] float32 moments; updated in place.
        lr, beta1, beta2, eps, weight_decay: hyperparameters (Python floats).
        bias1, bias2: ``1 - beta1**t``, ``1 - beta2**t`` of this step ``t``.
        grad_scale: the clipping coefficient applied to ``grad`` (1.0 when not clipping).

    The arithmetic is in ``param``'s dtype; the update uses the moments as stored (float32).
    """
    c = coefficients(param.dtype, lr, beta1, beta2, eps, weight_decay, bias1, bias2, grad_scale)
    # In slices, so that the temporaries of each stay in cache (the arithmetic, and so the
    # result, is the same for any slicing: every element is independent).
    for lo in range(0, param.shape[0], STEP_CHUNK):
        hi = lo + STEP_CHUNK
        _update(param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], c)


def _update(p, grad, exp_avg, exp_avg_sq, c):
    xp = _backend.array_module(p)
    g = grad * c.grad_scale if c.grad_scale != 1 else grad
    if p.dtype == np.float32:
        m, v = exp_avg, exp_avg_sq
    else:
        m, v = exp_avg.astype(p.dtype), exp_avg_sq.astype(p.dtype)
    tmp = g - m
    tmp *= c.one_minus_beta1
    m += tmp
    v *= c.beta2
    xp.multiply(g, c.one_minus_beta2, out=tmp)
    tmp *= g
    v += tmp
    if p.dtype != np.float32:
        # Stored as float32; the update uses the stored values, as the other backends do.
        exp_avg[...] = m
        exp_avg_sq[...] = v
        m, v = exp_avg.astype(p.dtype), exp_avg_sq.astype(p.dtype)
    denom = xp.sqrt(v)
    denom /= c.sqrt_bias2
    denom += c.eps
    xp.divide(m, denom, out=denom)
    denom *= c.step_size
    p *= c.decay
    p -= denom


def sum_squares(grad):
    """grad: [n] float32/float64 -> [1] float64, the sum of squares in float64 (fixed order)."""
    xp = _backend.array_module(grad)
    n = grad.shape[0]
    # A float64 square can overflow; the caller tells that apart from a non-finite gradient.
    with np.errstate(over="ignore", invalid="ignore"):
        partials = [xp.sum(xp.square(grad[lo:lo + SUM_CHUNK], dtype=np.float64))
                    for lo in range(0, n, SUM_CHUNK)]
    out = _backend.empty((1,), np.float64, xp)
    out[0] = xp.sum(xp.stack(partials)) if partials else 0.0
    return out
