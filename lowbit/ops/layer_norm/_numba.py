"""Numba layer norm over the last axis: one pass over a row per statistic, float64 accumulators.

The sums are carried in float64 whatever the input dtype (float32 rows of a few hundred features
then lose nothing to accumulation, and a float64 input is computed in float64 throughout); the
outputs are rounded to the input's dtype once. Rows are independent, so large inputs run in a
``prange`` over rows; small ones stay serial (see ``PARALLEL_MIN``). Siblings: ``__init__.py``,
``_numpy.py``, ``_cuda.py``; reference ``reference/layer_norm.py``.
"""

import numba
import numpy as np

from ... import _backend

#: Elements from which the row loop runs in parallel. Below it the loops stay serial: a composite
#: layer (BDH) calls the norm on a few hundred thousand values between BLAS calls, and a parallel
#: region there waited on OpenBLAS's spinning workers (3-6 ms a call in the BDH step against well
#: under 1 ms serial, measured).
PARALLEL_MIN = 1 << 20


@numba.njit(cache=True)
def _forward_row(x, y, mean, rstd, r, eps):
    D = x.shape[1]
    m = 0.0
    for i in range(D):
        m += x[r, i]
    m /= D
    var = 0.0
    for i in range(D):
        d = x[r, i] - m
        var += d * d
    inv = 1.0 / np.sqrt(var / D + eps)
    for i in range(D):
        y[r, i] = (x[r, i] - m) * inv
    mean[r] = m
    rstd[r] = inv


@numba.njit(cache=True)
def _backward_row(dy, y, rstd, dx, r):
    D = dy.shape[1]
    s1 = 0.0
    s2 = 0.0
    for i in range(D):
        s1 += dy[r, i]
        s2 += dy[r, i] * y[r, i]
    s1 /= D
    s2 /= D
    for i in range(D):
        dx[r, i] = rstd[r] * (dy[r, i] - s1 - y[r, i] * s2)


@numba.njit(cache=True)
def _forward_serial(x, y, mean, rstd, eps):
    for r in range(x.shape[0]):
        _forward_row(x, y, mean, rstd, r, eps)


@numba.njit(cache=True, parallel=True)
def _forward_parallel(x, y, mean, rstd, eps):
    for r in numba.prange(x.shape[0]):
        _forward_row(x, y, mean, rstd, r, eps)


@numba.njit(cache=True)
def _backward_serial(dy, y, rstd, dx):
    for r in range(dy.shape[0]):
        _backward_row(dy, y, rstd, dx, r)


@numba.njit(cache=True, parallel=True)
def _backward_parallel(dy, y, rstd, dx):
    for r in numba.prange(dy.shape[0]):
        _backward_row(dy, y, rstd, dx, r)


def forward(x, eps):
    """See ``_numpy.forward``: x [..., D] -> ``(y, mean, rstd)`` of x's dtype."""
    D = x.shape[-1]
    y = _backend.empty(x.shape, x.dtype)
    mean = _backend.empty(x.shape[:-1], x.dtype)
    rstd = _backend.empty(x.shape[:-1], x.dtype)
    kernel = _forward_parallel if x.size >= PARALLEL_MIN else _forward_serial
    kernel(np.ascontiguousarray(x).reshape(-1, D), y.reshape(-1, D), mean.reshape(-1),
           rstd.reshape(-1), float(eps))
    return y, mean, rstd


def backward(dy, y, rstd):
    """See ``_numpy.backward``: the input gradient [..., D] of dy's dtype."""
    D = dy.shape[-1]
    dx = _backend.empty(dy.shape, dy.dtype)
    kernel = _backward_parallel if dy.size >= PARALLEL_MIN else _backward_serial
    kernel(np.ascontiguousarray(dy).reshape(-1, D), np.ascontiguousarray(y).reshape(-1, D),
           np.ascontiguousarray(rstd).reshape(-1), dx.reshape(-1, D))
    return dx
