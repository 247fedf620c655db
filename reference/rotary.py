"""Reference rotary position embedding: float64, explicit loops, angles to double precision.

For token ``t`` at position ``p = positions[t]`` and pair ``j < D / 2`` the angle is
``p * theta ** (-2 j / D)``. It is computed here in 40-digit decimal arithmetic (``decimal``:
``exp(-(2 j / D) ln theta)`` times the integer position), so the float64 angle is the correctly
rounded one even at large positions, where forming it in float64 loses a few ulps of a large
number. The pair ``(a, b)`` is ``(j, j + D / 2)`` for ``style="half"`` and ``(2j, 2j + 1)`` for
``style="interleaved"``; ``y_a = x_a cos - x_b sin``, ``y_b = x_b cos + x_a sin``. The backward
turns by the opposite angle (the transpose of a rotation).

Checked against: ``lowbit/ops/rotary/`` (every backend) in ``tests/test_rotary.py``, where the
reference itself is checked against central finite differences and against the complex-number
form of the rotation. Kernels: ``cuda/rotary.cu``.
"""

import decimal
import math

import numpy as np

#: Decimal digits of the angle computation (float64 carries 17).
DIGITS = 40


def rotary_angles_ref(positions, D, theta):
    """The angles [T, D // 2] float64, each the float64 nearest the exact angle.

    Args:
        positions: [T] non-negative integers.
        D: the head dimension (even).
        theta: the positive base.
    """
    positions = [int(p) for p in np.asarray(positions).reshape(-1)]
    out = np.empty((len(positions), D // 2))
    with decimal.localcontext() as ctx:
        ctx.prec = DIGITS
        log_theta = decimal.Decimal(float(theta)).ln()
        for j in range(D // 2):
            freq = (-(decimal.Decimal(2 * j) / decimal.Decimal(D)) * log_theta).exp()
            for t, p in enumerate(positions):
                out[t, j] = float(decimal.Decimal(p) * freq)
    return out


def _pairs(D, style):
    if style == "half":
        return [(j, j + D // 2) for j in range(D // 2)]
    if style == "interleaved":
        return [(2 * j, 2 * j + 1) for j in range(D // 2)]
    raise ValueError(f"unknown style {style!r}")


def _turn(x, positions, theta, style, sign):
    x = np.asarray(x, dtype=np.float64)
    T, D = x.shape[0], x.shape[-1]
    rows = x.reshape(T, -1, D)
    angles = rotary_angles_ref(positions, D, theta)
    out = np.empty_like(rows)
    for t in range(T):
        for j, (a, b) in enumerate(_pairs(D, style)):
            c, s = math.cos(angles[t, j]), sign * math.sin(angles[t, j])
            for h in range(rows.shape[1]):
                xa, xb = float(rows[t, h, a]), float(rows[t, h, b])
                out[t, h, a] = xa * c - xb * s
                out[t, h, b] = xb * c + xa * s
    return out.reshape(x.shape)


def rotary_ref(x, positions, theta=10000.0, style="half"):
    """Forward: every pair of x's last axis turned by its token's angle.

    Args:
        x: [T, H, D] or [T, D] array (any float dtype; computed in float64), D even.
        positions: [T] non-negative integers.
        theta: the positive base of the angles.
        style: ``"half"`` or ``"interleaved"``.

    Returns:
        y of x's shape, float64.
    """
    return _turn(x, positions, theta, style, 1.0)


def rotary_bwd_ref(dy, positions, theta=10000.0, style="half"):
    """Gradient of ``rotary_ref`` with respect to x: ``dy`` turned by minus the angles.

    Args:
        dy: gradient of the output, of x's shape.
        positions, theta, style: as in the forward.

    Returns:
        dx of dy's shape, float64.
    """
    return _turn(dy, positions, theta, style, -1.0)
