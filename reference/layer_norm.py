"""Reference layer norm over the last axis: float64, explicit loops over rows and features.

No affine parameters; the variance is the biased one (divided by D) and ``eps`` is added to it:
``y = (x - mean) / sqrt(var + eps)``. Checked against: ``lowbit/ops/layer_norm/`` (every
backend) in ``tests/test_layer_norm.py``, where the backward is also checked against central
finite differences. Kernels: ``cuda/layer_norm.cu``.
"""

import math

import numpy as np

#: The default epsilon added to the biased variance.
EPS = 1e-5


def _row_stats(row, eps):
    """Mean and reciprocal standard deviation of one row (a sequence of floats)."""
    n = len(row)
    mean = math.fsum(row) / n
    var = math.fsum((v - mean) ** 2 for v in row) / n
    return mean, 1.0 / math.sqrt(var + eps)


def layer_norm_ref(x, eps=EPS):
    """Forward: ``y[..., i] = (x[..., i] - mean) * rstd`` per row of the last axis.

    Args:
        x: [..., D] array (any float dtype; computed in float64), D >= 1.
        eps: the positive epsilon added to the biased variance.

    Returns:
        y [..., D] float64.
    """
    x = np.asarray(x, dtype=np.float64)
    rows = x.reshape(-1, x.shape[-1])
    y = np.empty_like(rows)
    for r in range(rows.shape[0]):
        row = [float(v) for v in rows[r]]
        mean, rstd = _row_stats(row, eps)
        for i, v in enumerate(row):
            y[r, i] = (v - mean) * rstd
    return y.reshape(x.shape)


def layer_norm_bwd_ref(dy, x, eps=EPS):
    """Gradient of ``layer_norm_ref`` at ``x`` for the output gradient ``dy``.

    With ``xhat = (x - mean) * rstd``: ``dx = rstd * (dy - mean(dy) - xhat * mean(dy * xhat))``
    (the mean's and the variance's dependence on x give the two subtracted terms).

    Args:
        dy, x: [..., D] arrays of one shape.
        eps: as in the forward.

    Returns:
        dx [..., D] float64.
    """
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    rows = x.reshape(-1, x.shape[-1])
    grads = dy.reshape(rows.shape)
    dx = np.empty_like(rows)
    n = rows.shape[1]
    for r in range(rows.shape[0]):
        row = [float(v) for v in rows[r]]
        g = [float(v) for v in grads[r]]
        mean, rstd = _row_stats(row, eps)
        xhat = [(v - mean) * rstd for v in row]
        mean_g = math.fsum(g) / n
        mean_gx = math.fsum(gi * hi for gi, hi in zip(g, xhat)) / n
        for i in range(n):
            dx[r, i] = rstd * (g[i] - mean_g - xhat[i] * mean_gx)
    return dx.reshape(x.shape)
