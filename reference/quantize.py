"""Reference low-bit quantization: explicit loops, float64 statistics, obviously right.

Checked against: lowbit/ops/quantize/ (every backend), tests/test_quantize.py. Formats as in
docs/architecture.rst ("Numbers every op shares"): a scale is the dequantization step
(value = code x scale), rounding is half to even, quotients are formed in the input's dtype.
"""

import math

import numpy as np

from .pack_bits import pack_bits_ref, unpack_bits_ref

EPS = 1e-5
#: Stored bits per weight code, per format.
WEIGHT_BITS = {"ternary": 2, "sign": 1, "int8": 8}
ACT_QMAX = {"int8": 127, "int4": 7}


def weight_codes_ref(w, format):
    """Signed weight codes and scale.

    Args:
        w: [K, N] float32 or float64.
        format: "ternary", "sign" or "int8".

    Returns:
        codes: [K, N] int8 in {-1, 0, 1}, {-1, 1} or [-127, 127].
        scale: float32 scalar array (ternary, sign) or [N] float32 (int8).
    """
    w = np.asarray(w)
    dt = w.dtype.type
    K, N = w.shape
    codes = np.zeros((K, N), dtype=np.int8)
    if format in ("ternary", "sign"):
        total = 0.0
        for k in range(K):
            for n in range(N):
                total += abs(float(w[k, n]))
        # The statistic in float64, then the quotient in the input's dtype.
        s = dt(max(total / (K * N), EPS))
        for k in range(K):
            for n in range(N):
                if format == "ternary":
                    codes[k, n] = int(min(max(np.rint(dt(w[k, n]) / s), -1), 1))
                else:
                    codes[k, n] = 1 if w[k, n] >= 0 else -1
        return codes, np.array(s, dtype=np.float32)
    scale = np.zeros(N, dtype=np.float32)
    for n in range(N):
        m = 0.0
        for k in range(K):
            m = max(m, abs(float(w[k, n])))
        s = dt(max(m, EPS)) / dt(127)
        scale[n] = s
        for k in range(K):
            codes[k, n] = int(min(max(np.rint(dt(w[k, n]) / s), -127), 127))
    return codes, scale


def quantize_weight_ref(w, format):
    """Reference packing: ``(data, scale)`` as held by ``lowbit.PackedWeight``.

    ``data`` is [N, ceil(K / codes_per_byte)] uint8 (ternary: code + 1 in 2 bits; sign: bit 1 for
    +1), or [N, K] int8 for "int8"; codes LSB-first along K.
    """
    codes, scale = weight_codes_ref(w, format)
    t = codes.T.astype(np.int64)
    if format == "int8":
        return np.ascontiguousarray(t.astype(np.int8)), scale
    stored = t + 1 if format == "ternary" else (t > 0).astype(np.int64)
    return pack_bits_ref(stored.astype(np.uint8), WEIGHT_BITS[format]), scale


def unpack_weight_ref(data, format, K):
    """Signed codes [K, N] int64 from packed ``data`` (inverse of ``quantize_weight_ref``)."""
    if format == "int8":
        return np.asarray(data).astype(np.int64).T.copy()
    stored = unpack_bits_ref(data, WEIGHT_BITS[format], K).astype(np.int64)
    codes = stored - 1 if format == "ternary" else 2 * stored - 1
    return codes.T.copy()


def quantize_activation_ref(x, format="int8"):
    """Per-row absmax quantization over the last axis.

    Returns:
        codes: int8, the shape of ``x``; scale: float32, ``x.shape[:-1]``.
    """
    x = np.asarray(x)
    dt = x.dtype.type
    qmax = ACT_QMAX[format]
    codes = np.zeros(x.shape, dtype=np.int8)
    scale = np.zeros(x.shape[:-1], dtype=np.float32)
    for index in np.ndindex(*x.shape[:-1]):
        row = x[index]
        m = 0.0
        for v in row:
            if not math.isfinite(float(v)):
                raise ValueError("x must be finite")
            m = max(m, abs(float(v)))
        s = dt(max(m, EPS)) / dt(qmax)
        scale[index] = s
        for i, v in enumerate(row):
            codes[index + (i,)] = int(min(max(np.rint(dt(v) / s), -qmax), qmax))
    return codes, scale


def dequantize_ref(codes, scale, axis_of_scale):
    """float64 ``codes * scale``, the scale broadcast along ``axis_of_scale`` (None: scalar)."""
    codes = np.asarray(codes, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    if axis_of_scale is None:
        return codes * float(scale)
    return codes * np.expand_dims(scale, axis_of_scale)
