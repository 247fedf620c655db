"""Reference bit packing: explicit loops over codes, LSB-first.

Checked against: lowbit/ops/pack_bits/ (every backend), tests/test_pack_bits.py.
"""

import numpy as np


def pack_bits_ref(codes, bits, axis=-1):
    """Pack codes < 2**bits (uint8) along ``axis``, ``8 // bits`` codes per byte, LSB-first."""
    codes = np.moveaxis(np.asarray(codes, dtype=np.uint8), axis, -1)
    per = 8 // bits
    n = codes.shape[-1]
    out = np.zeros(codes.shape[:-1] + (-(-n // per),), dtype=np.uint8)
    for index in np.ndindex(*codes.shape[:-1]):
        for i in range(n):
            out[index + (i // per,)] |= int(codes[index + (i,)]) << ((i % per) * bits)
    return np.moveaxis(out, -1, axis)


def unpack_bits_ref(packed, bits, count, axis=-1):
    """Inverse of ``pack_bits_ref``: the first ``count`` codes along ``axis``."""
    packed = np.moveaxis(np.asarray(packed, dtype=np.uint8), axis, -1)
    per = 8 // bits
    out = np.zeros(packed.shape[:-1] + (count,), dtype=np.uint8)
    for index in np.ndindex(*packed.shape[:-1]):
        for i in range(count):
            out[index + (i,)] = (int(packed[index + (i // per,)]) >> ((i % per) * bits)) & (
                (1 << bits) - 1
            )
    return np.moveaxis(out, -1, axis)
