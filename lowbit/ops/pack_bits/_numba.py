"""Numba pack/unpack on [rows, n] uint8 views, parallel over output bytes (64-bit indices).

Siblings: ``_numpy.py``, ``_cuda.py``; reference ``reference/pack_bits.py``.
"""

import numba
import numpy as np

from ... import _backend


@numba.njit(parallel=True, cache=True)
def _pack(codes, bits, out):
    rows, n = codes.shape
    nbytes = out.shape[1]
    per = 8 // bits
    for idx in numba.prange(rows * nbytes):
        r = idx // nbytes
        b = idx - r * nbytes
        start = b * per
        stop = min(start + per, n)
        v = 0
        for i in range(start, stop):
            v |= np.int64(codes[r, i]) << ((i - start) * bits)
        out[r, b] = v


@numba.njit(parallel=True, cache=True)
def _unpack(packed, bits, out):
    rows, count = out.shape
    per = 8 // bits
    mask = (1 << bits) - 1
    nbytes = packed.shape[1]
    for idx in numba.prange(rows * nbytes):
        r = idx // nbytes
        b = idx - r * nbytes
        byte = np.int64(packed[r, b])
        start = b * per
        stop = min(start + per, count)
        for i in range(start, stop):
            out[r, i] = (byte >> ((i - start) * bits)) & mask


def pack(codes, bits):
    """codes: [rows, n] uint8 -> [rows, ceil(n * bits / 8)] uint8."""
    rows, n = codes.shape
    out = _backend.empty((rows, -(-n // (8 // bits))), np.uint8)
    if out.size:
        _pack(_backend.read_only(codes), bits, out)
    return out


def unpack(packed, bits, count):
    """packed: [rows, nbytes] uint8 -> [rows, count] uint8."""
    out = _backend.empty((packed.shape[0], count), np.uint8)
    if out.size:
        _unpack(_backend.read_only(packed), bits, out)
    return out
