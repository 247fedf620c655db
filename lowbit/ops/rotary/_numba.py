"""Numba rotary rotation: tokens in a ``prange`` (large inputs), heads and pairs in order.

Computed in the input's dtype (float32 products stay float32), with the same two products and
one sum per output element as the other backends. The half style's inner loop runs over
contiguous pair members and the tables, so it vectorizes. Small inputs stay serial (see
``PARALLEL_MIN``). Siblings: ``__init__.py``, ``_numpy.py``, ``_cuda.py``; reference
``reference/rotary.py``.
"""

import numba
import numpy as np

from ... import _backend

#: Elements from which the token loop runs in parallel: below it a parallel region costs more
#: than it saves (the same threshold as the layer norm's, for composite layers that call it
#: between BLAS calls).
PARALLEL_MIN = 1 << 20


@numba.njit(cache=True)
def _pair(x, cos, sin, y, t, h, j, ia, ib, inverse):
    """Pair j of head h of token t: elements ia and ib."""
    a = x[t, h, ia]
    b = x[t, h, ib]
    c = cos[t, j]
    s = sin[t, j]
    if inverse:
        y[t, h, ia] = a * c + b * s
        y[t, h, ib] = b * c - a * s
    else:
        y[t, h, ia] = a * c - b * s
        y[t, h, ib] = b * c + a * s


@numba.njit(cache=True)
def _token(x, cos, sin, y, t, interleaved, inverse):
    """Token t of y from x: every head, every pair (literal strides per style, so that the
    half style's loop over contiguous members vectorizes)."""
    half = cos.shape[1]
    for h in range(x.shape[1]):
        if interleaved:
            for j in range(half):
                _pair(x, cos, sin, y, t, h, j, 2 * j, 2 * j + 1, inverse)
        else:
            for j in range(half):
                _pair(x, cos, sin, y, t, h, j, j, j + half, inverse)


@numba.njit(cache=True)
def _serial(x, cos, sin, y, interleaved, inverse):
    for t in range(x.shape[0]):
        _token(x, cos, sin, y, t, interleaved, inverse)


@numba.njit(cache=True, parallel=True)
def _parallel(x, cos, sin, y, interleaved, inverse):
    for t in numba.prange(x.shape[0]):
        _token(x, cos, sin, y, t, interleaved, inverse)


def _rotate(x, cos, sin, interleaved, inverse):
    y = _backend.empty(x.shape, x.dtype)
    kernel = _parallel if x.size >= PARALLEL_MIN else _serial
    kernel(*_backend.read_only(np.ascontiguousarray(x), np.ascontiguousarray(cos),
                               np.ascontiguousarray(sin)), y, bool(interleaved), bool(inverse))
    return y


def forward(x, cos, sin, interleaved):
    """See ``_numpy.forward``: y [T, H, D] of x's dtype."""
    return _rotate(x, cos, sin, interleaved, False)


def backward(dy, cos, sin, interleaved):
    """See ``_numpy.backward``: dx [T, H, D] of dy's dtype."""
    return _rotate(dy, cos, sin, interleaved, True)
