"""Reference packed matmul and the straight-through linear layer: float64, explicit loops.

Checked against: lowbit/ops/packed_matmul/ (every backend), tests/test_packed_matmul.py. Uses
``reference/quantize.py`` for codes and scales.
"""

import numpy as np

from .quantize import quantize_activation_ref, unpack_weight_ref, weight_codes_ref


def packed_matmul_ref(x, data, scale, format, K, act_format="int8"):
    """``y = Qa(x) @ codes_w * scale_w``.

    Args:
        x: [..., K] float; data, scale, format: a packed weight (see ``quantize_weight_ref``).
        act_format: "int8"/"int4": exact integer ``codes_x @ codes_w``, then
            ``float32(acc) * scale_x * scale_w`` rounded in float32 in that order; None:
            ``(x @ codes_w) * scale_w`` accumulated in float64.

    Returns:
        [..., N] float32.
    """
    x = np.asarray(x)
    cw = unpack_weight_ref(data, format, K)
    N = cw.shape[1]
    sw = np.broadcast_to(np.asarray(scale, dtype=np.float32), (N,))
    rows = x.reshape(-1, K)
    y = np.zeros((rows.shape[0], N), dtype=np.float32)
    if act_format is not None:
        cx, sx = quantize_activation_ref(rows, act_format)
        cx = cx.astype(np.int64)
    for m in range(rows.shape[0]):
        for n in range(N):
            if act_format is not None:
                acc = int(sum(int(cx[m, k]) * int(cw[k, n]) for k in range(K)))
                y[m, n] = np.float32(np.float32(acc) * sx[m]) * sw[n]
            else:
                acc = sum(float(rows[m, k]) * float(cw[k, n]) for k in range(K))
                y[m, n] = np.float32(acc * float(sw[n]))
    return y.reshape(x.shape[:-1] + (N,))


def _qw(w, format):
    if format is None:
        return np.asarray(w, dtype=np.float64)
    codes, scale = weight_codes_ref(w, format)
    return codes.astype(np.float64) * np.asarray(scale, dtype=np.float64)


def _qa(x, format):
    if format is None:
        return np.asarray(x, dtype=np.float64)
    codes, scale = quantize_activation_ref(x, format)
    return codes.astype(np.float64) * scale.astype(np.float64)[..., None]


def linear_ref(x, w, weight_format, act_format="int8"):
    """Forward ``y = Qa(x) @ Qw(w)`` in float64 (Q: quantize then dequantize; None: identity).

    Args:
        x: [..., K]; w: [K, N]. Returns [..., N] float64.
    """
    a = _qa(x, act_format)
    q = _qw(w, weight_format)
    K, N = q.shape
    rows = a.reshape(-1, K)
    y = np.zeros((rows.shape[0], N))
    for m in range(rows.shape[0]):
        for n in range(N):
            y[m, n] = sum(rows[m, k] * q[k, n] for k in range(K))
    return y.reshape(np.shape(x)[:-1] + (N,))


def linear_bwd_ref(dy, x, w, weight_format, act_format="int8"):
    """Straight-through backward: ``dx = dy @ Qw(w).T``, ``dw = Qa(x).T @ dy`` (float64).

    Leading axes of ``x`` and ``dy`` are flattened for ``dw``. Returns ``(dx, dw)``.
    """
    q = _qw(w, weight_format)
    K, N = q.shape
    a = _qa(x, act_format).reshape(-1, K)
    g = np.asarray(dy, dtype=np.float64).reshape(-1, N)
    dx = np.zeros((g.shape[0], K))
    dw = np.zeros((K, N))
    for m in range(g.shape[0]):
        for k in range(K):
            dx[m, k] = sum(g[m, n] * q[k, n] for n in range(N))
    for k in range(K):
        for n in range(N):
            dw[k, n] = sum(a[m, k] * g[m, n] for m in range(g.shape[0]))
    return dx.reshape(np.shape(x)), dw
