"""Reference RMS norm over the last axis with a weight: float64, explicit loops over rows.

Llama-style (BitNet b1.58's ``BitNetRMSNorm``): no mean is subtracted, ``eps`` is added to the
mean of the squares, and the normalized row is scaled by a per-feature weight:
``y = weight * x / sqrt(mean(x**2) + eps)``. Checked against: ``lowbit/ops/rms_norm/`` (every
backend) in ``tests/test_rms_norm.py``, where this backward is also checked against central
finite differences. Kernels: ``cuda/rms_norm.cu``.
"""

import math

import numpy as np

#: The default epsilon added to the mean of the squares.
EPS = 1e-6


def _inverse_rms(row, eps):
    """``1 / sqrt(mean(row**2) + eps)`` of one row (a sequence of floats)."""
    return 1.0 / math.sqrt(math.fsum(v * v for v in row) / len(row) + eps)


def _rows(a, D):
    return np.asarray(a, dtype=np.float64).reshape(-1, D)


def rms_norm_ref(x, weight, eps=EPS):
    """Forward: ``y[..., i] = weight[i] * x[..., i] * r`` with ``r`` the row's inverse RMS.

    Args:
        x: [..., D] array (any float dtype; computed in float64), D >= 1.
        weight: [D] array.
        eps: the positive epsilon added to the mean of the squares.

    Returns:
        y [..., D] float64.
    """
    x = np.asarray(x, dtype=np.float64)
    D = x.shape[-1]
    w = [float(v) for v in np.asarray(weight, dtype=np.float64).reshape(D)]
    rows = _rows(x, D)
    y = np.empty_like(rows)
    for r in range(rows.shape[0]):
        row = [float(v) for v in rows[r]]
        inv = _inverse_rms(row, eps)
        for i in range(D):
            y[r, i] = w[i] * (row[i] * inv)
    return y.reshape(x.shape)


def rms_norm_bwd_ref(dy, x, weight, eps=EPS):
    """Gradients of ``rms_norm_ref`` at ``(x, weight)`` for the output gradient ``dy``.

    With ``s = sum(x**2) / D + eps`` and ``r = s**-0.5``, ``dr / dx_j = -r**3 x_j / D``, so
    ``dx_j = r w_j dy_j - (r**3 / D) x_j sum_i(dy_i w_i x_i)``; ``dweight_i`` is
    ``sum(dy_i x_i r)`` over every row.

    Args:
        dy, x: [..., D] arrays of one shape.
        weight: [D] array.
        eps: as in the forward.

    Returns:
        ``(dx, dweight)``: dx [..., D] and dweight [D], float64.
    """
    x = np.asarray(x, dtype=np.float64)
    D = x.shape[-1]
    w = [float(v) for v in np.asarray(weight, dtype=np.float64).reshape(D)]
    rows, grads = _rows(x, D), _rows(dy, D)
    dx = np.empty_like(rows)
    terms: list[list[float]] = [[] for _ in range(D)]
    for r in range(rows.shape[0]):
        row = [float(v) for v in rows[r]]
        g = [float(v) for v in grads[r]]
        inv = _inverse_rms(row, eps)
        dot = math.fsum(g[i] * w[i] * row[i] for i in range(D))
        for j in range(D):
            dx[r, j] = inv * w[j] * g[j] - inv**3 / D * row[j] * dot
            terms[j].append(g[j] * row[j] * inv)
    dweight = np.array([math.fsum(t) for t in terms], dtype=np.float64)
    return dx.reshape(x.shape), dweight
