"""Vectorized pack/unpack on [rows, n] uint8 views (array-generic: numpy or cupy).

Siblings: ``_numba.py``, ``_cuda.py`` (``cuda/pack_bits.cu``); reference ``reference/pack_bits.py``.
"""

import numpy as np

from ... import _backend


def pack(codes, bits):
    """codes: [rows, n] uint8 -> [rows, ceil(n * bits / 8)] uint8."""
    xp = _backend.array_module(codes)
    per = 8 // bits
    rows, n = codes.shape
    nbytes = -(-n // per)
    padded = xp.zeros((rows, nbytes * per), dtype=np.uint8)
    padded[:, :n] = codes
    shifts = (xp.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    lanes = padded.reshape(rows, nbytes, per) << shifts
    out = _backend.empty((rows, nbytes), np.uint8, xp)
    out[...] = xp.bitwise_or.reduce(lanes, axis=-1) if per > 1 else lanes[..., 0]
    return out


def unpack(packed, bits, count):
    """packed: [rows, nbytes] uint8 -> [rows, count] uint8."""
    xp = _backend.array_module(packed)
    per = 8 // bits
    rows = packed.shape[0]
    shifts = (xp.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    lanes = (packed[:, :, None] >> shifts) & np.uint8((1 << bits) - 1)
    out = _backend.empty((rows, count), np.uint8, xp)
    out[...] = lanes.reshape(rows, packed.shape[1] * per)[:, :count]
    return out
