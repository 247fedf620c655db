"""Vectorized RMS norm over the last axis with a weight (array-generic: numpy or cupy).

Computed in the input's dtype (float32 or float64), in ``BitNetRMSNorm``'s order: the row's
reciprocal root mean square, the normalized row ``x * rstd``, then the product with the weight.
Siblings: ``__init__.py`` (API, validation, ctx), ``_numba.py``, ``_cuda.py``
(``cuda/rms_norm.cu``); reference ``reference/rms_norm.py``.
"""

from ... import _backend


def forward(x, weight, eps):
    """Normalize the rows of the last axis and scale them by ``weight``.

    Args:
        x: [..., D] float32 or float64, D >= 1.
        weight: [D] of x's dtype.
        eps: positive float added to the mean of the squares (rounded to x's dtype).

    Returns:
        ``(y, rstd)``: y [..., D] and rstd [...], of x's dtype.
    """
    xp = _backend.array_module(x)
    dtype = x.dtype
    rstd = _backend.empty(x.shape[:-1], dtype, xp)
    y = _backend.empty(x.shape, dtype, xp)
    rstd[...] = 1.0 / xp.sqrt((x * x).mean(axis=-1) + dtype.type(eps))
    xp.multiply(x, rstd[..., None], out=y)
    y *= weight
    return y, rstd


def backward(dy, x, weight, rstd):
    """Gradients ``dx = rstd * (g - xhat * mean(g * xhat))`` (``g = weight * dy``,
    ``xhat = x * rstd``) and ``dweight``, the sum of ``dy * xhat`` over the rows.

    Args:
        dy: [..., D] gradient of the output; x: [..., D] the forward input; weight: [D];
            rstd: [...]; one dtype (float32 or float64).

    Returns:
        ``(dx, dweight)``: dx [..., D] and dweight [D], of dy's dtype.
    """
    xp = _backend.array_module(dy)
    D = dy.shape[-1]
    dx = _backend.empty(dy.shape, dy.dtype, xp)
    dweight = _backend.empty((D,), dy.dtype, xp)
    xhat = x * rstd[..., None]
    g = dy * weight
    dx[...] = g - xhat * (g * xhat).mean(axis=-1, keepdims=True)
    dx *= rstd[..., None]
    dweight[...] = (dy * xhat).reshape(-1, D).sum(axis=0)
    return dx, dweight
