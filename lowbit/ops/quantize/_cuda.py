"""Launchers for ``cuda/quantize.cu`` (backends cuda and cudasim).

Siblings: ``__init__.py``, ``_numpy.py``, ``_numba.py``; reference ``reference/quantize.py``.
The per-tensor statistics of the weight formats (mean |w|, column absmax) are plain reductions on
the array module (``_numpy.weight_scale``); the codes, and the whole per-row activation
quantization, run in the kernels. Unpacking reuses the ``pack_bits`` kernels.
"""

import numpy as np

from ... import _backend, _kernels
from ..pack_bits import _cuda as _pack_bits_cuda
from . import WEIGHT_FORMATS
from ._numpy import signed_codes, weight_scale

SOURCE = "quantize.cu"
#: Template ids of the formats: kTernary, kSign, kInt8 in cuda/quantize.cu.
_FORMAT_ID = {"ternary": 0, "sign": 1, "int8": 2}
NAME_EXPRESSIONS = tuple(
    [f"weight_codes<{fmt}, {t}>" for fmt in range(3) for t in ("float", "double")]
    + [f"quantize_rows<{t}>" for t in ("float", "double")]
)
THREADS = 256
#: Threads of the per-row kernel (one block per row).
ROW_THREADS = 128
#: Grid-stride loops cover the rest; enough blocks to fill any current GPU.
MAX_BLOCKS = 4096
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {"kRowThreads": ROW_THREADS, "kTernary": _FORMAT_ID["ternary"],
                "kSign": _FORMAT_ID["sign"], "kInt8": _FORMAT_ID["int8"]}


def weight_codes(w, format):
    """w: [K, N] float -> (stored [N, K] uint8 (int8 for "int8"), scale in w's dtype)."""
    xp = _backend.array_module(w)
    K, N = w.shape
    scale = weight_scale(w, format)
    dtype = np.int8 if format == "int8" else np.uint8
    out = _backend.empty((N, K), dtype, xp)
    kernel = _kernels.module(SOURCE, NAME_EXPRESSIONS, w).get_function(
        f"weight_codes<{_FORMAT_ID[format]}, {_kernels.CTYPE[w.dtype]}>")
    grid = (max(1, min(MAX_BLOCKS, -(-out.size // THREADS))),)
    kernel(grid, (THREADS,), (xp.ascontiguousarray(w), xp.ascontiguousarray(scale).reshape(-1),
                              out.view(np.uint8), np.int64(K), np.int64(N)))
    return out, scale


def unpack_weight(data, format, K):
    """Packed data [N, bytes] -> signed codes [N, K] int8 (the pack_bits unpack kernel)."""
    return signed_codes(data, format, K, _pack_bits_cuda.unpack)


def row_codes(x, qmax):
    """x: [M, K] float -> (codes [M, K] int8, scale [M] float32; NaN/inf for non-finite rows)."""
    xp = _backend.array_module(x)
    M, K = x.shape
    codes = _backend.empty((M, K), np.int8, xp)
    scale = _backend.empty((M,), np.float32, xp)
    if M:
        kernel = _kernels.module(SOURCE, NAME_EXPRESSIONS, x).get_function(
            f"quantize_rows<{_kernels.CTYPE[x.dtype]}>")
        kernel((min(M, MAX_BLOCKS),), (ROW_THREADS,),
               (xp.ascontiguousarray(x), codes, scale, np.int64(M), np.int64(K), np.int32(qmax)))
    return codes, scale
