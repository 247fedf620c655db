"""Numba RMS norm over the last axis with a weight: float64 accumulators, rows in chunks.

The sums of a row are carried in float64 whatever the input dtype, and the outputs rounded to
the input's dtype once. The weight gradient sums over rows: each chunk of ``CHUNK`` rows adds its
rows in order into its own float64 partial row, then the partials are added in chunk order, so
the bits do not depend on the thread count and the serial and parallel paths agree. Large inputs
run the chunks in a ``prange``; small ones stay serial (see ``PARALLEL_MIN``). Siblings:
``__init__.py``, ``_numpy.py``, ``_cuda.py``; reference ``reference/rms_norm.py``.
"""

import numba
import numpy as np

from ... import _backend

#: Elements from which the row loops run in parallel; below it a parallel region costs more
#: than it gains (the same bound as the layer norm's, ``lowbit/ops/layer_norm/_numba.py``).
PARALLEL_MIN = 1 << 20
#: Rows of one weight-gradient partial (and of one parallel task).
CHUNK = 64
#: Independent chains of a row's sums: one float64 chain waits on the add's latency (the row
#: sums of the layer norm interleave rows for the same reason). The loops below are unrolled by
#: hand to exactly this count.
LANES = 8


@numba.njit(cache=True)
def _sum_of_squares(x, r):
    """``sum(x[r] ** 2)`` in float64: ``LANES`` chains over the features (feature i in chain
    i % LANES), added in a fixed tree, then the tail in order."""
    D = x.shape[1]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    body = D - D % LANES
    for i in range(0, body, LANES):
        v0, v1 = np.float64(x[r, i]), np.float64(x[r, i + 1])
        v2, v3 = np.float64(x[r, i + 2]), np.float64(x[r, i + 3])
        v4, v5 = np.float64(x[r, i + 4]), np.float64(x[r, i + 5])
        v6, v7 = np.float64(x[r, i + 6]), np.float64(x[r, i + 7])
        s0 += v0 * v0
        s1 += v1 * v1
        s2 += v2 * v2
        s3 += v3 * v3
        s4 += v4 * v4
        s5 += v5 * v5
        s6 += v6 * v6
        s7 += v7 * v7
    s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for i in range(body, D):
        v = np.float64(x[r, i])
        s += v * v
    return s


@numba.njit(cache=True)
def _dot_row(dy, x, weight, r, inv):
    """``sum(weight * dy[r] * x[r] * inv)`` in float64, in ``_sum_of_squares``'s order."""
    D = dy.shape[1]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    body = D - D % LANES
    for i in range(0, body, LANES):
        s0 += (np.float64(weight[i]) * dy[r, i]) * (x[r, i] * inv)
        s1 += (np.float64(weight[i + 1]) * dy[r, i + 1]) * (x[r, i + 1] * inv)
        s2 += (np.float64(weight[i + 2]) * dy[r, i + 2]) * (x[r, i + 2] * inv)
        s3 += (np.float64(weight[i + 3]) * dy[r, i + 3]) * (x[r, i + 3] * inv)
        s4 += (np.float64(weight[i + 4]) * dy[r, i + 4]) * (x[r, i + 4] * inv)
        s5 += (np.float64(weight[i + 5]) * dy[r, i + 5]) * (x[r, i + 5] * inv)
        s6 += (np.float64(weight[i + 6]) * dy[r, i + 6]) * (x[r, i + 6] * inv)
        s7 += (np.float64(weight[i + 7]) * dy[r, i + 7]) * (x[r, i + 7] * inv)
    s = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for i in range(body, D):
        s += (np.float64(weight[i]) * dy[r, i]) * (x[r, i] * inv)
    return s


@numba.njit(cache=True)
def _forward_row(x, weight, y, rstd, r, eps):
    D = x.shape[1]
    inv = 1.0 / np.sqrt(_sum_of_squares(x, r) / D + eps)
    for i in range(D):
        y[r, i] = weight[i] * (x[r, i] * inv)
    rstd[r] = inv


@numba.njit(cache=True)
def _forward_serial(x, weight, y, rstd, eps):
    for r in range(x.shape[0]):
        _forward_row(x, weight, y, rstd, r, eps)


@numba.njit(cache=True, parallel=True)
def _forward_parallel(x, weight, y, rstd, eps):
    for c in numba.prange(-(-x.shape[0] // CHUNK)):
        for r in range(c * CHUNK, min(x.shape[0], (c + 1) * CHUNK)):
            _forward_row(x, weight, y, rstd, r, eps)


@numba.njit(cache=True)
def _backward_chunk(dy, x, weight, rstd, dx, partial, c):
    """Rows of chunk ``c``: their input gradients, and their ``dy * xhat`` summed into
    ``partial[c]`` in row order."""
    D = dy.shape[1]
    for i in range(D):
        partial[c, i] = 0.0
    for r in range(c * CHUNK, min(dy.shape[0], (c + 1) * CHUNK)):
        inv = np.float64(rstd[r])
        s = _dot_row(dy, x, weight, r, inv) / D
        for i in range(D):
            xhat = x[r, i] * inv
            dx[r, i] = inv * (np.float64(weight[i]) * dy[r, i] - xhat * s)
            partial[c, i] += dy[r, i] * xhat


@numba.njit(cache=True)
def _backward_serial(dy, x, weight, rstd, dx, partial):
    for c in range(partial.shape[0]):
        _backward_chunk(dy, x, weight, rstd, dx, partial, c)


@numba.njit(cache=True, parallel=True)
def _backward_parallel(dy, x, weight, rstd, dx, partial):
    for c in numba.prange(partial.shape[0]):
        _backward_chunk(dy, x, weight, rstd, dx, partial, c)


@numba.njit(cache=True)
def _sum_partials(partial, dweight):
    """``dweight[i]`` = the chunks' partials of feature i, added in chunk order."""
    for i in range(dweight.shape[0]):
        s = 0.0
        for c in range(partial.shape[0]):
            s += partial[c, i]
        dweight[i] = s


def forward(x, weight, eps):
    """See ``_numpy.forward``: x [..., D], weight [D] -> ``(y, rstd)`` of x's dtype."""
    D = x.shape[-1]
    y = _backend.empty(x.shape, x.dtype)
    rstd = _backend.empty(x.shape[:-1], x.dtype)
    kernel = _forward_parallel if x.size >= PARALLEL_MIN else _forward_serial
    kernel(*_backend.read_only(np.ascontiguousarray(x).reshape(-1, D),
                               np.ascontiguousarray(weight)),
           y.reshape(-1, D), rstd.reshape(-1), float(eps))
    return y, rstd


def backward(dy, x, weight, rstd):
    """See ``_numpy.backward``: ``(dx [..., D], dweight [D])`` of dy's dtype."""
    D = dy.shape[-1]
    rows = dy.size // D
    dx = _backend.empty(dy.shape, dy.dtype)
    dweight = _backend.empty((D,), dy.dtype)
    partial = np.empty((-(-rows // CHUNK), D), np.float64)
    kernel = _backward_parallel if dy.size >= PARALLEL_MIN else _backward_serial
    kernel(*_backend.read_only(np.ascontiguousarray(dy).reshape(-1, D),
                               np.ascontiguousarray(x).reshape(-1, D),
                               np.ascontiguousarray(weight),
                               np.ascontiguousarray(rstd).reshape(-1)),
           dx.reshape(-1, D), partial)
    _sum_partials(partial, dweight)
    return dx, dweight
