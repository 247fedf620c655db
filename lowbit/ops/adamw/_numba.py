"""Numba AdamW step (one fused pass, parallel over fixed-size chunks) and gradient sum of squares.

Siblings: ``__init__.py`` (the optimizer), ``_numpy.py`` (``coefficients``, shared by every
backend), ``_cuda.py``; reference ``reference/adamw.py``.

``step`` updates its ``param``, ``exp_avg`` and ``exp_avg_sq`` arguments in place: the one
documented exception to the backend contract's "inputs are never modified". Both kernels split
the elements into chunks of a fixed size, so which elements are summed together (and in what
order) does not depend on the thread count: results are bitwise reproducible.
"""

from __future__ import annotations

import numba
import numpy as np

from ... import _backend
from ._numpy import coefficients

#: Elements per parallel work item of the step (large enough to amortize scheduling).
STEP_CHUNK = 1 << 14
#: Elements per partial sum of ``sum_squares``; part of the fixed summation order.
SUM_CHUNK = 1 << 14


# The per-chunk loops take slices and index them from 0: indexed from a start that LLVM cannot
# prove non-negative (Numba wraps negative indices), the step loop stayed scalar (measured here:
# 5.3 ms -> 1.3 ms for 4 M float32 parameters once it vectorized).
@numba.njit(inline="always")
def _step_chunk(param, grad, exp_avg, exp_avg_sq, decay, one_minus_beta1, beta2, one_minus_beta2,
                eps, step_size, sqrt_bias2, grad_scale):
    t = param.dtype.type
    for i in range(param.shape[0]):
        g = grad[i] * grad_scale
        m = t(exp_avg[i])
        m = m + one_minus_beta1 * (g - m)
        v = t(exp_avg_sq[i])
        v = v * beta2 + one_minus_beta2 * g * g
        # The update uses the moments as stored (float32), as the other backends do.
        m_stored = np.float32(m)
        v_stored = np.float32(v)
        exp_avg[i] = m_stored
        exp_avg_sq[i] = v_stored
        denom = np.sqrt(t(v_stored)) / sqrt_bias2 + eps
        param[i] = param[i] * decay - step_size * (t(m_stored) / denom)


@numba.njit(parallel=True, cache=True)
def _step(param, grad, exp_avg, exp_avg_sq, decay, one_minus_beta1, beta2, one_minus_beta2, eps,
          step_size, sqrt_bias2, grad_scale):
    # Every scalar has the parameter's type, so float32 parameters get float32 arithmetic.
    n = param.shape[0]
    for c in numba.prange((n + STEP_CHUNK - 1) // STEP_CHUNK):
        lo = c * STEP_CHUNK
        hi = min(lo + STEP_CHUNK, n)
        _step_chunk(param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], decay,
                    one_minus_beta1, beta2, one_minus_beta2, eps, step_size, sqrt_bias2,
                    grad_scale)


@numba.njit(cache=True)
def _step_serial(param, grad, exp_avg, exp_avg_sq, decay, one_minus_beta1, beta2,
                 one_minus_beta2, eps, step_size, sqrt_bias2, grad_scale):
    # One chunk's worth: no parallel region to wake (and wait for) on a busy machine.
    _step_chunk(param, grad, exp_avg, exp_avg_sq, decay, one_minus_beta1, beta2,
                one_minus_beta2, eps, step_size, sqrt_bias2, grad_scale)


@numba.njit(inline="always")
def _chunk_sum(x):
    """Float64 sum of squares of one chunk in a fixed order: element i to accumulator i % 8, the
    last n % 8 to the first (eight independent chains keep the adds from waiting on each other)."""
    n = x.shape[0]
    body = n // 8 * 8
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    for i in range(0, body, 8):
        v0, v1 = np.float64(x[i]), np.float64(x[i + 1])
        v2, v3 = np.float64(x[i + 2]), np.float64(x[i + 3])
        v4, v5 = np.float64(x[i + 4]), np.float64(x[i + 5])
        v6, v7 = np.float64(x[i + 6]), np.float64(x[i + 7])
        a0 += v0 * v0
        a1 += v1 * v1
        a2 += v2 * v2
        a3 += v3 * v3
        a4 += v4 * v4
        a5 += v5 * v5
        a6 += v6 * v6
        a7 += v7 * v7
    for i in range(body, n):
        v = np.float64(x[i])
        a0 += v * v
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@numba.njit(parallel=True, cache=True)
def _chunk_sums(x, partials):
    n = x.shape[0]
    for c in numba.prange(partials.shape[0]):
        lo = c * SUM_CHUNK
        partials[c] = _chunk_sum(x[lo:min(lo + SUM_CHUNK, n)])


@numba.njit(cache=True)
def _chunk_sum_serial(x):
    return _chunk_sum(x)


@numba.njit(cache=True)
def _ordered_sum(partials):
    total = 0.0
    for c in range(partials.shape[0]):
        total += partials[c]
    return total


def step(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, bias1, bias2,
         grad_scale):
    """``_numpy.step``'s contract (IN PLACE on ``param``, ``exp_avg`` and ``exp_avg_sq``), in
    one fused pass."""
    if param.shape[0]:
        c = coefficients(param.dtype, lr, beta1, beta2, eps, weight_decay, bias1, bias2,
                         grad_scale)
        run = _step if param.shape[0] > STEP_CHUNK else _step_serial
        run(param, grad, exp_avg, exp_avg_sq, *c)


def sum_squares(grad):
    """grad: [n] float32/float64 -> [1] float64, the sum of squares in float64 (fixed order)."""
    out = _backend.empty((1,), np.float64)
    if grad.shape[0] <= SUM_CHUNK:
        out[0] = _chunk_sum_serial(grad)
        return out
    partials = _backend.empty((-(-grad.shape[0] // SUM_CHUNK),), np.float64)
    _chunk_sums(grad, partials)
    # The partials are few (one per SUM_CHUNK elements): summed serially, after the parallel
    # region, in chunk order.
    out[0] = _ordered_sum(partials)
    return out
