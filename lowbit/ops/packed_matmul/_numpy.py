"""Vectorized packed matmul (array-generic: numpy or cupy): decode the codes, then matmul.

Siblings: ``__init__.py`` (validation, ctx), ``_numba/``, ``_cuda.py``
(``cuda/packed_matmul.cu``); reference ``reference/packed_matmul.py``. Weight decoding comes from
``lowbit/ops/quantize/_numpy.py``.
"""

import numpy as np

from ... import _backend
from ..quantize._numpy import unpack_weight


def matmul_int(codes_x, scale_x, data, scale_w, format, K):
    """Exact integer product of activation and weight codes, then the two scales.

    Args:
        codes_x: [M, K] int8; scale_x: [M] float32.
        data: packed weight [N, bytes]; scale_w: float32, 0-d or [N]; format; K.

    Returns:
        [M, N] float32: ``float32(acc) * scale_x[:, None] * scale_w``, rounded in that order.
    """
    xp = _backend.array_module(codes_x)
    # Integer codes in float64: every product and partial sum is an integer below 127 * 127 * K,
    # far below 2^53, so the BLAS product equals int32 accumulation exactly (integer matmul has
    # no BLAS path in NumPy).
    cw = unpack_weight(data, format, K).astype(np.float64)
    acc = codes_x.astype(np.float64) @ cw.T
    y = _backend.empty(acc.shape, np.float32, xp)
    y[...] = acc.astype(np.float32) * scale_x[:, None] * scale_w
    return y


def matmul_float(x, data, scale_w, format, K):
    """x: [M, K] float32 -> [M, N] float32 ``(x @ codes_w) * scale_w``, float32 accumulation."""
    xp = _backend.array_module(x)
    cw = unpack_weight(data, format, K).astype(np.float32)
    y = _backend.empty((x.shape[0], cw.shape[0]), np.float32, xp)
    y[...] = (x @ cw.T) * scale_w
    return y


def matmul_dx(dy, data, scale_w, format, K):
    """dy: [M, N] float32 -> dx [M, K] float32 ``dy @ (codes_w * scale_w).T``.

    A per-tensor scale (ternary, sign) multiplies once at the end, so the sum itself adds and
    subtracts ``dy`` entries only.
    """
    xp = _backend.array_module(dy)
    cw = unpack_weight(data, format, K).astype(np.float32)
    dx = _backend.empty((dy.shape[0], K), np.float32, xp)
    if scale_w.ndim == 0:
        dx[...] = (dy @ cw) * scale_w
    else:
        dx[...] = (dy * scale_w) @ cw
    return dx


def matmul_dx_int(dy_codes, dy_scale, data, scale, format, K):
    """Exact integer ``dy_codes @ codes_w.T``, then the two scales: the dx of int8 gradients.

    Args:
        dy_codes: [M, N] int8 gradient codes; dy_scale: [M] float32 their row scales.
        data: packed weight [N, bytes]; scale: 0-d float32 multiplying every element; format; K.

    Returns:
        [M, K] float32: ``float32(acc) * dy_scale[:, None] * scale``, rounded in that order.
    """
    xp = _backend.array_module(dy_codes)
    # integers in float64, exact as in matmul_int
    cw = unpack_weight(data, format, K).astype(np.float64)
    acc = dy_codes.astype(np.float64) @ cw
    dx = _backend.empty(acc.shape, np.float32, xp)
    dx[...] = acc.astype(np.float32) * dy_scale[:, None] * scale
    return dx


def matmul_dw(dy, a, scale_a):
    """dw [K, N] float32 = ``Qa(x).T @ dy``.

    Args:
        a: [M, K] int8 activation codes (with ``scale_a`` [M] float32) or float32 activations
            (``scale_a`` None).
        dy: [M, N] float32.
    """
    xp = _backend.array_module(dy)
    act = a.astype(np.float32) if scale_a is None else a.astype(np.float32) * scale_a[:, None]
    dw = _backend.empty((a.shape[1], dy.shape[1]), np.float32, xp)
    dw[...] = act.T @ dy
    return dw
