"""Vectorized rotary rotation (array-generic: numpy or cupy), in the input's dtype.

Each half of every pair is one array expression over all tokens and heads, the cos/sin tables
broadcast over the heads. Siblings: ``__init__.py`` (API, validation, ctx, the angle tables),
``_numba.py``, ``_cuda.py`` (``cuda/rotary.cu``); reference ``reference/rotary.py``.
"""

from ... import _backend


def _halves(a, interleaved):
    """The two members of every pair of ``a`` [T, H, D]: views [T, H, D / 2] each."""
    if interleaved:
        return a[..., 0::2], a[..., 1::2]
    half = a.shape[-1] // 2
    return a[..., :half], a[..., half:]


def _rotate(x, cos, sin, interleaved, inverse):
    xp = _backend.array_module(x)
    y = _backend.empty(x.shape, x.dtype, xp)
    a, b = _halves(x, interleaved)
    ya, yb = _halves(y, interleaved)
    c, s = cos[:, None, :], sin[:, None, :]
    if inverse:
        ya[...] = a * c + b * s
        yb[...] = b * c - a * s
    else:
        ya[...] = a * c - b * s
        yb[...] = b * c + a * s
    return y


def forward(x, cos, sin, interleaved):
    """Rotate every pair of x's last axis by its token's angles.

    Args:
        x: [T, H, D] float32 or float64, D even.
        cos, sin: [T, D / 2] of x's dtype, the tables of ``rotary_tables``.
        interleaved: pairs ``(2j, 2j + 1)`` if True, else ``(j, j + D / 2)``.

    Returns:
        y [T, H, D] of x's dtype: ``y_a = a cos - b sin``, ``y_b = b cos + a sin``.
    """
    return _rotate(x, cos, sin, interleaved, False)


def backward(dy, cos, sin, interleaved):
    """The input gradient: every pair of ``dy`` [T, H, D] turned by minus its angle
    (``dx_a = a cos + b sin``, ``dx_b = b cos - a sin``); arguments as ``forward``'s."""
    return _rotate(dy, cos, sin, interleaved, True)
