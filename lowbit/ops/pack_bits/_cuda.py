"""Launchers for ``cuda/pack_bits.cu`` (backends cuda and cudasim).

Siblings: ``_numpy.py``, ``_numba.py``; reference ``reference/pack_bits.py``.
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "pack_bits.cu"
NAME_EXPRESSIONS = tuple(f"{kind}<{bits}>" for kind in ("pack_bits", "unpack_bits")
                         for bits in (1, 2, 4, 8))
THREADS = 256
#: Grid-stride loops cover the rest; enough blocks to fill any current GPU.
MAX_BLOCKS = 4096
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py): none,
#: the kernels take every size as an argument and the bit width as a template argument.
CU_CONSTANTS = {}


def _grid(total):
    return (max(1, min(MAX_BLOCKS, -(-total // THREADS))),)


def pack(codes, bits):
    """codes: [rows, n] uint8 -> [rows, ceil(n * bits / 8)] uint8."""
    xp = _backend.array_module(codes)
    rows, n = codes.shape
    nbytes = -(-n // (8 // bits))
    out = _backend.empty((rows, nbytes), np.uint8, xp)
    if out.size:
        kernel = _kernels.module(SOURCE, NAME_EXPRESSIONS, codes).get_function(f"pack_bits<{bits}>")
        kernel(_grid(out.size), (THREADS,),
               (codes, out, np.int64(rows), np.int64(n), np.int64(nbytes)))
    return out


def unpack(packed, bits, count):
    """packed: [rows, nbytes] uint8 -> [rows, count] uint8."""
    xp = _backend.array_module(packed)
    rows, nbytes = packed.shape
    out = _backend.empty((rows, count), np.uint8, xp)
    if out.size:
        kernel = _kernels.module(SOURCE, NAME_EXPRESSIONS, packed).get_function(
            f"unpack_bits<{bits}>")
        kernel(_grid(out.size), (THREADS,),
               (packed, out, np.int64(rows), np.int64(count), np.int64(nbytes)))
    return out
