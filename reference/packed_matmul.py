"""Reference packed matmul and the straight-through linear layer: float64 or exact integer sums,
explicit loops.

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


def linear_bwd_int8_ref(dy, x, w, weight_format, act_format="int8"):
    """Straight-through backward with int8 gradient codes (``grad_format="int8"``): exact integer
    sums of codes, scales applied in float32.

    ``g`` is ``dy`` in float32, [M, N] rows; ``codes_a``, ``scale_a`` the activation codes of
    ``x``; ``codes_w`` [K, N], ``scale_w`` the weight codes.

    - dx: the rows of ``g`` (times ``scale_w`` for "int8" weights, in float32) quantized per row
      to ``(cg, sg)``; ``dx[m, k] = float32(sum_n cg[m, n] codes_w[k, n]) * sg[m] * s``, rounded
      in float32 in that order, ``s`` = ``scale_w`` for ternary / sign and 1 for int8;
    - dw: ``c[n, m] = float32(scale_a[m] * g[m, n])`` quantized per row n (over m) to
      ``(cc, sc)``; ``dw[k, n] = float32(sum_m codes_a[m, k] cc[n, m]) * sc[n]``.

    Args:
        dy: [..., N]; x: [..., K]; w: [K, N]; weight_format, act_format: not None.

    Returns:
        ``(dx, dw)``: float32 of ``x``'s shape and [K, N].
    """
    codes_w, scale_w = weight_codes_ref(w, weight_format)
    K, N = codes_w.shape
    codes_a, scale_a = quantize_activation_ref(np.asarray(x).reshape(-1, K), act_format)
    g = np.asarray(dy).astype(np.float32).reshape(-1, N)
    M = g.shape[0]
    per_tensor = np.ndim(scale_w) == 0
    rows = g if per_tensor else g * scale_w.astype(np.float32)
    cg, sg = quantize_activation_ref(rows, "int8")
    s = np.float32(scale_w) if per_tensor else np.float32(1)
    dx = np.zeros((M, K), dtype=np.float32)
    for m in range(M):
        for k in range(K):
            acc = sum(int(cg[m, n]) * int(codes_w[k, n]) for n in range(N))
            dx[m, k] = np.float32(np.float32(acc) * sg[m]) * s
    columns = np.zeros((N, M), dtype=np.float32)
    for m in range(M):
        for n in range(N):
            columns[n, m] = np.float32(scale_a[m] * g[m, n])
    cc, sc = quantize_activation_ref(columns, "int8")
    dw = np.zeros((K, N), dtype=np.float32)
    for k in range(K):
        for n in range(N):
            acc = sum(int(codes_a[m, k]) * int(cc[n, m]) for m in range(M))
            dw[k, n] = np.float32(acc) * sc[n]
    return dx.reshape(np.shape(x)), dw
