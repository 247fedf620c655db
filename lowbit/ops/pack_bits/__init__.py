"""Bit packing of small unsigned codes: ``pack_bits`` / ``unpack_bits``.

Kernels: ``cuda/pack_bits.cu``; reference: ``reference/pack_bits.py``; tests:
``tests/test_pack_bits.py``; benchmark: ``bench/pack_bits.py``.
"""

from __future__ import annotations

import math

import numpy as np

from ... import _backend, _dispatch, _kernels, _validate
from ..._typing import Array

#: Bit widths that divide a byte.
BITS = (1, 2, 4, 8)


def _bits(bits) -> int:
    bits = _validate.integer(bits, "bits")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return bits


def packed_length(count: int, bits: int) -> int:
    """Bytes holding ``count`` codes of ``bits`` bits."""
    per = 8 // bits
    return -(-count // per)


def pack_bits(codes: Array, bits: int, *, axis: int = -1) -> Array:
    """Pack codes below ``2**bits`` LSB-first into bytes along ``axis``.

    Args:
        codes: integer array (numpy or cupy) of values in ``[0, 2**bits)``; stored as uint8.
        bits: 1, 2, 4 or 8.
        axis: the axis to pack along; its length becomes ``ceil(n * bits / 8)``, the last byte
            zero-padded.

    Returns:
        uint8 array on the same array module.

    Raises:
        TypeError: ``codes`` is not an integer array.
        ValueError: ``bits`` not in {1, 2, 4, 8}, a code >= ``2**bits`` or negative, bad axis.
    """
    codes = _validate.as_array(codes, "codes")
    bits = _bits(bits)
    if codes.dtype.kind not in "iu":
        raise TypeError(f"codes must have an integer dtype, got {codes.dtype}")
    ax = _validate.axis(axis, codes.ndim) if codes.ndim else None
    if ax is None:
        raise ValueError("codes must have at least one dimension, got a 0-d array")
    xp = _backend.array_module(codes)
    # uint8 codes always fit 8 bits; otherwise both bounds come back in one read.
    if codes.size and not (codes.dtype == np.uint8 and bits == 8):
        lo, hi = (int(v) for v in _kernels.host_copy(xp.stack([codes.min(), codes.max()])))
        if lo < 0 or hi >= 1 << bits:
            raise ValueError(
                f"codes must lie in [0, {1 << bits}) for bits={bits}, got values in [{lo}, {hi}]"
            )
    return pack_codes(codes, bits, ax)


def pack_codes(codes: Array, bits: int, axis: int = -1) -> Array:
    """``pack_bits`` without its checks, for codes in range by construction (a kernel's output):
    ``codes`` an integer array, ``bits`` in ``BITS``, ``axis`` a valid axis."""
    xp = _backend.array_module(codes)
    ax = axis % codes.ndim
    _, impl = _dispatch.resolve("pack_bits", codes)
    moved = xp.moveaxis(codes, ax, -1)
    n = moved.shape[-1]
    rows = xp.ascontiguousarray(moved.astype(np.uint8, copy=False)).reshape(
        math.prod(moved.shape[:-1]), n)
    packed = impl.pack(rows, bits)
    packed = packed.reshape(moved.shape[:-1] + (packed_length(n, bits),))
    return xp.moveaxis(packed, -1, ax)


def unpack_bits(packed: Array, bits: int, count: int, *, axis: int = -1) -> Array:
    """Inverse of ``pack_bits``: the first ``count`` codes along ``axis``, as uint8.

    Raises:
        TypeError: ``packed`` is not uint8.
        ValueError: bad ``bits``, or ``count`` inconsistent with the packed length along ``axis``.
    """
    packed = _validate.as_array(packed, "packed")
    bits = _bits(bits)
    count = _validate.integer(count, "count", minimum=0)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension, got a 0-d array")
    ax = _validate.axis(axis, packed.ndim)
    if packed.shape[ax] != packed_length(count, bits):
        raise ValueError(
            f"count {count} at bits={bits} needs {packed_length(count, bits)} bytes along axis "
            f"{ax}, but packed has {packed.shape[ax]}"
        )
    xp = _backend.array_module(packed)
    _, impl = _dispatch.resolve("pack_bits", packed)
    moved = xp.moveaxis(packed, ax, -1)
    rows = xp.ascontiguousarray(moved).reshape(math.prod(moved.shape[:-1]), moved.shape[-1])
    codes = impl.unpack(rows, bits, count)
    return xp.moveaxis(codes.reshape(moved.shape[:-1] + (count,)), -1, ax)
