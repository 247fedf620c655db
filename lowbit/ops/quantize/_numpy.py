"""Vectorized quantization (array-generic: numpy or cupy).

Siblings: ``__init__.py`` (validation, packing through ``lowbit.pack_bits``), ``_numba.py``,
``_cuda.py``; reference ``reference/quantize.py``.
"""

import numpy as np

from ... import _backend
from ..pack_bits import _numpy as _pack_bits_numpy
from . import EPS, WEIGHT_FORMATS, WEIGHT_QMAX


def weight_scale(w, format):
    """Scale in ``w``'s dtype: 0-d (ternary, sign; mean |w| taken in float64) or [N] (int8).

    Non-finite (no warning) where ``w`` holds NaN or inf or its mean |w| overflows: callers raise
    on it. Shared with the cuda backend (``_cuda.py``).
    """
    xp = _backend.array_module(w)
    dt = w.dtype.type
    with np.errstate(invalid="ignore", over="ignore"):
        if format == "int8":
            return xp.maximum(xp.abs(w).max(axis=0), dt(EPS)) / dt(WEIGHT_QMAX["int8"])
        mean = xp.abs(w).sum(dtype=np.float64) / w.size
        return xp.maximum(mean, EPS).astype(w.dtype)


def weight_codes(w, format):
    """w: [K, N] float -> (stored [N, K], scale).

    Stored codes are uint8 ``code + 1`` (ternary), uint8 bit (sign) or int8 codes (int8); the
    caller packs the first two along K.

    A non-finite ``w`` (or one whose mean |w| overflows) gives a non-finite scale and codes that
    the caller must not use: it raises ``ValueError`` on seeing the scale, so NumPy's warnings
    about the NaN and inf met on the way (divide, cast, overflow) are silenced here.
    """
    xp = _backend.array_module(w)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        scale = weight_scale(w, format)
        if format == "sign":
            stored = (w.T >= 0).astype(np.uint8)
        elif format == "ternary":
            stored = (xp.clip(xp.rint(w.T / scale), -1, 1) + 1).astype(np.uint8)
        else:
            qmax = WEIGHT_QMAX["int8"]
            stored = xp.clip(xp.rint(w.T / scale[:, None]), -qmax, qmax).astype(np.int8)
    out = _backend.empty(stored.shape, stored.dtype, xp)
    out[...] = stored
    return out, scale


def unpack_weight(data, format, K):
    """Packed data [N, bytes] -> signed codes [N, K] int8."""
    return signed_codes(data, format, K, _pack_bits_numpy.unpack)


def signed_codes(data, format, K, unpack):
    """Signed codes [N, K] int8 of packed data, with ``unpack`` a backend's bit unpacker
    (``pack_bits``'s ``unpack``); array-generic, so the cuda backend shares it."""
    xp = _backend.array_module(data)
    out = _backend.empty((data.shape[0], K), np.int8, xp)
    if format == "int8":
        out[...] = data
        return out
    stored = unpack(data, WEIGHT_FORMATS[format], K).view(np.int8)
    out[...] = stored - np.int8(1) if format == "ternary" else np.int8(2) * stored - np.int8(1)
    return out


def row_codes(x, qmax):
    """x: [M, K] float -> (codes [M, K] int8, scale [M] float32).

    A row holding a non-finite value gets a non-finite scale (the absmax propagates NaN and inf)
    and codes that the caller must not use.
    """
    xp = _backend.array_module(x)
    dt = x.dtype.type
    scale = xp.maximum(xp.abs(x).max(axis=-1), dt(EPS)) / dt(qmax)
    codes = _backend.empty(x.shape, np.int8, xp)
    s = _backend.empty(scale.shape, np.float32, xp)
    with np.errstate(invalid="ignore", over="ignore"):  # rows with NaN/inf are rejected later
        codes[...] = xp.nan_to_num(xp.clip(xp.rint(x / scale[:, None]), -qmax, qmax))
        s[...] = scale
    return codes, s
