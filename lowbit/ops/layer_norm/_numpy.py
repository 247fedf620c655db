"""Vectorized layer norm over the last axis (array-generic: numpy or cupy).

Computed in the input's dtype (float32 or float64): the mean first, then the biased variance of
the centred values (two passes, so a large common offset does not cancel the variance away).
Siblings: ``__init__.py`` (API, validation, ctx), ``_numba.py``, ``_cuda.py``
(``cuda/layer_norm.cu``); reference ``reference/layer_norm.py``.
"""

from ... import _backend


def forward(x, eps):
    """Normalize the rows of the last axis.

    Args:
        x: [..., D] float32 or float64, D >= 1.
        eps: positive float added to the biased variance (rounded to x's dtype).

    Returns:
        ``(y, mean, rstd)``: y [..., D], mean and rstd [...], all of x's dtype.
    """
    xp = _backend.array_module(x)
    dtype = x.dtype
    mean = _backend.empty(x.shape[:-1], dtype, xp)
    rstd = _backend.empty(x.shape[:-1], dtype, xp)
    y = _backend.empty(x.shape, dtype, xp)
    mean[...] = x.mean(axis=-1)
    xp.subtract(x, mean[..., None], out=y)
    rstd[...] = 1.0 / xp.sqrt((y * y).mean(axis=-1) + dtype.type(eps))
    y *= rstd[..., None]
    return y, mean, rstd


def backward(dy, y, rstd):
    """Input gradient ``rstd * (dy - mean(dy) - y * mean(dy * y))`` per row.

    Args:
        dy: [..., D] gradient of the output; y: [..., D] the normalized output; rstd: [...];
            one dtype (float32 or float64).

    Returns:
        dx [..., D] of dy's dtype.
    """
    xp = _backend.array_module(dy)
    dx = _backend.empty(dy.shape, dy.dtype, xp)
    dx[...] = dy - dy.mean(axis=-1, keepdims=True) - y * (dy * y).mean(axis=-1, keepdims=True)
    dx *= rstd[..., None]
    return dx
