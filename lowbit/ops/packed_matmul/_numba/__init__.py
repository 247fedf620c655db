"""Numba packed matmul: the backend functions, and which kernel runs for which rows and CPU.

Siblings: ``../__init__.py`` (validation, ctx), ``../_numpy.py``, ``../_cuda.py``; reference
``reference/packed_matmul.py``; benchmark ``bench/matmul.py``. The kernels, one family a file in
this package:

- ``_vnni.py``: AVX-512 VNNI GEMV and register-tile GEMM, together with the LLVM intrinsics they
  are built from (exact int32; used wherever ``USE_VNNI``);
- ``_gemv.py``: the portable GEMV over packed bytes (few rows, no VNNI);
- ``_gemm_f64.py``: the portable GEMM, exact integer products in float64 BLAS with three weight
  columns to a float, and its per-thread workspaces (more rows, no VNNI);
- ``_decode.py``: the weight decodings (float32 codes for the float BLAS tiles, packed float64
  fields for ``_gemm_f64.py``) and the field-major activation layout;
- ``_backward.py``: ``dx`` (transposed GEMV, or decoded float32 tiles for BLAS) and the
  dequantized activations of ``dw``.

An njit kernel calls no njit function or intrinsic of another file; the constants they import
(format bits and code ranges from ``lowbit/ops/quantize``) are frozen into Numba's on-disk cache,
which keys each kernel on its own file only, so ``numba_cache_guard`` below restamps the package
whenever one of its files or that owner changes.
"""

import numpy as np

from .... import _backend
from ... import quantize as _quantize

_backend.numba_cache_guard(__file__, _quantize.__file__)

from ...quantize import WEIGHT_FORMATS as _BITS  # noqa: E402
from . import _backward, _decode, _gemm_f64, _gemv, _vnni  # noqa: E402

#: Whether the integer GEMV and GEMM use the AVX-512 VNNI kernels (the CPU has them); the portable
#: loops and the float64 BLAS GEMM otherwise.
USE_VNNI = _vnni.AVAILABLE
#: Rows at or below which the GEMV kernels run instead of the BLAS GEMM.
GEMV_MAX_ROWS = 8
#: The same for the VNNI kernels: the GEMM spreads every weight code into its panels first
#: (~1.9 ms at K = N = 4096), the GEMV costs ~0.08 ms a row (measured: 16 rows 1.4 ms against
#: 2.5 ms).
VNNI_GEMV_MAX_ROWS = 16
#: Output columns decoded per float32 BLAS tile in ``matmul_float`` (the tile stays in L2/L3).
TILE_N = 512


def matmul_int(codes_x, scale_x, data, scale_w, format, K):
    """``_numpy.matmul_int``'s contract, bit for bit: exact int32 products by the VNNI kernels,
    or the portable GEMV (few rows) and float64-field BLAS GEMM."""
    M = codes_x.shape[0]
    N = data.shape[0]
    y = _backend.empty((M, N), np.float32)
    scale_w = np.ascontiguousarray(scale_w, dtype=np.float32).reshape(-1)
    if USE_VNNI:
        if M <= VNNI_GEMV_MAX_ROWS:
            _vnni.gemv(codes_x, scale_x, data, scale_w, _BITS[format], y)
        else:
            _vnni.gemm(codes_x, scale_x, data, scale_w, _BITS[format], K, y)
    elif M <= GEMV_MAX_ROWS:
        _gemv.gemv(codes_x, scale_x, data, scale_w, format, y)
    else:
        _gemm_f64.gemm(codes_x, scale_x, data, scale_w, format, K, y)
    return y


def matmul_float(x, data, scale_w, format, K):
    """x: [M, K] float32 -> [M, N] float32 ``(x @ codes_w) * scale_w``, float32 accumulation.

    Decodes TILE_N output columns at a time to float32, field-major, and multiplies them with
    the activations permuted to match (BLAS).
    """
    M = x.shape[0]
    N, nbytes = data.shape
    xs = _decode.field_major(x, 8 // _BITS[format], nbytes)
    y = _backend.empty((M, N), np.float32)
    for n0 in range(0, N, TILE_N):
        n1 = min(N, n0 + TILE_N)
        tile = _decode.decode_codes_f32(data, format, n0, n1, 0, K)
        y[:, n0:n1] = (xs @ tile.T) * (scale_w if scale_w.ndim == 0 else scale_w[n0:n1])
    return y


def matmul_dx(dy, data, scale_w, format, K):
    """dy: [M, N] float32 -> dx [M, K] float32 ``dy @ (codes_w * scale_w).T``.

    Few rows: the transposed GEMV kernel over packed bytes. More rows: decoded float32 tiles and
    BLAS. A per-tensor scale (ternary, sign) multiplies once at the end.
    """
    M, N = dy.shape
    dx = _backend.empty((M, K), np.float32)
    g = dy if scale_w.ndim == 0 else np.ascontiguousarray(dy * scale_w, dtype=np.float32)
    if M <= GEMV_MAX_ROWS:
        _backward.dx_gemv(g, data, format, K, dx)
    else:
        _backward.dx_tiled(g, data, format, K, dx)
    if scale_w.ndim == 0:
        dx *= scale_w
    return dx


def matmul_dw(dy, a, scale_a):
    """dw [K, N] float32 = ``Qa(x).T @ dy`` (BLAS on the dequantized activations).

    Args:
        a: [M, K] int8 codes (with ``scale_a`` [M] float32) or float32 activations (``scale_a``
            None); dy: [M, N] float32.
    """
    if scale_a is not None:
        a = _backward.dequantize_rows(a, scale_a)
    dw = _backend.empty((a.shape[1], dy.shape[1]), np.float32)
    np.matmul(a.T, dy, out=dw)
    return dw
