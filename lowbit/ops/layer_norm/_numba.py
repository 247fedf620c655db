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


#: Rows whose sums run side by side. Each row's sum is still one chain in feature order (the bits
#: of a row alone), but four independent chains hide the float64 add's latency: 1.75x the
#: row-at-a-time loop on [512, 256] float32 rows (AMD EPYC, measured; eight were no faster).
ROWS = 4


@numba.njit(cache=True)
def _finish_row(x, y, mean, rstd, r, m, var, eps):
    """Row r's outputs from its mean ``m`` and its sum of squared deviations ``var``."""
    D = x.shape[1]
    inv = 1.0 / np.sqrt(var / D + eps)
    for i in range(D):
        y[r, i] = (x[r, i] - m) * inv
    mean[r] = m
    rstd[r] = inv


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
    _finish_row(x, y, mean, rstd, r, m, var, eps)


@numba.njit(cache=True)
def _forward_rows(x, y, mean, rstd, r, eps):
    """Rows r .. r + ROWS - 1 with ``_forward_row``'s arithmetic, their sums interleaved."""
    D = x.shape[1]
    m0 = m1 = m2 = m3 = 0.0
    for i in range(D):
        m0 += x[r, i]
        m1 += x[r + 1, i]
        m2 += x[r + 2, i]
        m3 += x[r + 3, i]
    m0 /= D
    m1 /= D
    m2 /= D
    m3 /= D
    v0 = v1 = v2 = v3 = 0.0
    for i in range(D):
        d0 = x[r, i] - m0
        d1 = x[r + 1, i] - m1
        d2 = x[r + 2, i] - m2
        d3 = x[r + 3, i] - m3
        v0 += d0 * d0
        v1 += d1 * d1
        v2 += d2 * d2
        v3 += d3 * d3
    _finish_row(x, y, mean, rstd, r, m0, v0, eps)
    _finish_row(x, y, mean, rstd, r + 1, m1, v1, eps)
    _finish_row(x, y, mean, rstd, r + 2, m2, v2, eps)
    _finish_row(x, y, mean, rstd, r + 3, m3, v3, eps)


@numba.njit(cache=True)
def _forward_group(x, y, mean, rstd, g, eps):
    """Group ``g`` of ROWS rows (the last one may be short: its rows one at a time)."""
    r = g * ROWS
    if r + ROWS <= x.shape[0]:
        _forward_rows(x, y, mean, rstd, r, eps)
    else:
        for rr in range(r, x.shape[0]):
            _forward_row(x, y, mean, rstd, rr, eps)


@numba.njit(cache=True)
def _finish_grad(dy, y, rstd, dx, r, s1, s2):
    """Row r's input gradient from its sums of ``dy`` and ``dy * y``."""
    D = dy.shape[1]
    s1 /= D
    s2 /= D
    for i in range(D):
        dx[r, i] = rstd[r] * (dy[r, i] - s1 - y[r, i] * s2)


@numba.njit(cache=True)
def _backward_group(dy, y, rstd, dx, g):
    """Group ``g`` of ROWS rows: each row's two sums in feature order, the rows' interleaved."""
    D = dy.shape[1]
    r = g * ROWS
    if r + ROWS <= dy.shape[0]:
        a0 = a1 = a2 = a3 = 0.0
        b0 = b1 = b2 = b3 = 0.0
        for i in range(D):
            a0 += dy[r, i]
            b0 += dy[r, i] * y[r, i]
            a1 += dy[r + 1, i]
            b1 += dy[r + 1, i] * y[r + 1, i]
            a2 += dy[r + 2, i]
            b2 += dy[r + 2, i] * y[r + 2, i]
            a3 += dy[r + 3, i]
            b3 += dy[r + 3, i] * y[r + 3, i]
        _finish_grad(dy, y, rstd, dx, r, a0, b0)
        _finish_grad(dy, y, rstd, dx, r + 1, a1, b1)
        _finish_grad(dy, y, rstd, dx, r + 2, a2, b2)
        _finish_grad(dy, y, rstd, dx, r + 3, a3, b3)
        return
    for rr in range(r, dy.shape[0]):
        s1 = 0.0
        s2 = 0.0
        for i in range(D):
            s1 += dy[rr, i]
            s2 += dy[rr, i] * y[rr, i]
        _finish_grad(dy, y, rstd, dx, rr, s1, s2)


@numba.njit(cache=True)
def _forward_serial(x, y, mean, rstd, eps):
    for g in range(-(-x.shape[0] // ROWS)):
        _forward_group(x, y, mean, rstd, g, eps)


@numba.njit(cache=True, parallel=True)
def _forward_parallel(x, y, mean, rstd, eps):
    for g in numba.prange(-(-x.shape[0] // ROWS)):
        _forward_group(x, y, mean, rstd, g, eps)


@numba.njit(cache=True)
def _backward_serial(dy, y, rstd, dx):
    for g in range(-(-dy.shape[0] // ROWS)):
        _backward_group(dy, y, rstd, dx, g)


@numba.njit(cache=True, parallel=True)
def _backward_parallel(dy, y, rstd, dx):
    for g in numba.prange(-(-dy.shape[0] // ROWS)):
        _backward_group(dy, y, rstd, dx, g)


def forward(x, eps):
    """See ``_numpy.forward``: x [..., D] -> ``(y, mean, rstd)`` of x's dtype."""
    D = x.shape[-1]
    y = _backend.empty(x.shape, x.dtype)
    mean = _backend.empty(x.shape[:-1], x.dtype)
    rstd = _backend.empty(x.shape[:-1], x.dtype)
    kernel = _forward_parallel if x.size >= PARALLEL_MIN else _forward_serial
    kernel(_backend.read_only(np.ascontiguousarray(x).reshape(-1, D)), y.reshape(-1, D),
           mean.reshape(-1), rstd.reshape(-1), float(eps))
    return y, mean, rstd


def backward(dy, y, rstd):
    """See ``_numpy.backward``: the input gradient [..., D] of dy's dtype."""
    D = dy.shape[-1]
    dx = _backend.empty(dy.shape, dy.dtype)
    kernel = _backward_parallel if dy.size >= PARALLEL_MIN else _backward_serial
    kernel(*_backend.read_only(np.ascontiguousarray(dy).reshape(-1, D),
                               np.ascontiguousarray(y).reshape(-1, D),
                               np.ascontiguousarray(rstd).reshape(-1)), dx.reshape(-1, D))
    return dx
