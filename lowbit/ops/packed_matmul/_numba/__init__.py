"""Numba packed matmul: the backend functions, and which kernel runs for which rows and CPU.

Siblings: ``../__init__.py`` (validation, ctx), ``../_numpy.py``, ``../_cuda.py``; reference
``reference/packed_matmul.py``; benchmark ``bench/matmul.py``. The kernels, one family a file in
this package:

- ``_vnni.py``: AVX-512 VNNI GEMV and register-tile GEMM, together with the LLVM intrinsics they
  are built from (exact int32; used wherever ``USE_VNNI``), and the same GEMM reading the weight
  across its packed rows for the dx of int8 gradients (``gemm_dx``);
- ``_avx2.py``: the same GEMV on 256-bit vectors, ``vpmaddubsw`` on AVX2 or the VEX
  ``vpdpbusd`` on AVX-VNNI (exact int32; used where ``USE_AVX2`` and not ``USE_VNNI``: AVX2 CPUs
  without AVX-512, such as Intel's laptop CPUs from Alder Lake on and AMD's before Zen 4), with
  the IR helpers of ``_avx2_gemm.py``: the GEMM and the dx of int8 gradients (``gemm_dx``) on
  the same vectors;
- ``_mkl.py``: oneMKL's ``cblas_gemm_s8u8s32`` (AMX int8 tiles) for the GEMM and the dx of
  int8 gradients, through ctypes (used where ``USE_MKL``: AMX and the ``mkl`` extra);
- ``_fma.py``: float32 register-tile GEMMs (AVX-512, or AVX2 with FMA) of the exact backward,
  ``dx`` decoding the packed codes into its panels and ``dw`` (used where ``USE_FMA``: the CPU
  has AVX-512 and NumPy's BLAS does not run 512-bit kernels of its own);
- ``_lut.py``: table lookups for ternary and sign weights against float32 (the float-activation
  forward, and the exact backward's ``dx`` from ``LUT_MIN_ROWS`` rows, on every CPU): one float
  add of a table entry per four codes; ``_lut_gemv.py``: the same sums for few rows of the
  forward, one row at a time (in-register lookups with AVX2 or AVX-512, scalar tables else);
- ``_llvm.py``: the IR helpers the intrinsics are emitted with;
- ``_gemv.py``: the portable GEMV over packed bytes (few rows, no VNNI, no AVX2);
- ``_gemm_f64.py``: the portable GEMM, exact integer products in float64 BLAS with three weight
  columns to a float, and its per-thread workspaces (more rows, no VNNI);
- ``_decode.py``: the weight decodings (float32 codes for the float BLAS tiles, packed float64
  fields for ``_gemm_f64.py``) and the field-major activation layout;
- ``_backward.py``: ``dx`` for few rows (transposed GEMV), and where the tiles do not run both
  products on SciPy's BLAS in blocks on Numba's threads (``dx_blocks``, ``dw_blocks``);
- ``_blas.py``: SciPy's BLAS ``?gemm`` called from Numba kernels.

An njit kernel here calls no njit function or intrinsic of another file, with three exceptions:
``_backward.py``'s block kernels call ``_blas.gemm`` and ``_decode.decode_codes_f32_into``
(files of this package, which the guard below covers together), and the float32 tile loop
``_fma.panel_block`` and ``_blas.gemm`` are also called from outside, by the numba kernels of
``lowbit/ops/segmented_attention`` and ``gated_delta_scan``, which guard their own cache against
edits of those files; the constants they import
(format bits and code ranges from ``lowbit/ops/quantize``) are frozen into Numba's on-disk cache,
which keys each kernel on its own file only, so ``numba_cache_guard`` below clears the package's
cached kernels whenever one of its files or that owner changes.
"""

import numba
import numpy as np

from .... import _backend
from ... import quantize as _quantize

_backend.numba_cache_guard(__file__, _quantize.__file__)

from ...quantize import WEIGHT_FORMATS as _BITS  # noqa: E402
from .. import _numpy  # noqa: E402
from . import (_avx2, _avx2_gemm, _backward, _decode, _f32_gemv, _fma, _gemm_f64,  # noqa: E402
               _gemv, _lut, _lut_gemv, _mkl, _vnni)

#: Whether the integer GEMM (more rows than ``MKL_MIN_ROWS``) and the dx of int8 gradients run on
#: oneMKL's ``cblas_gemm_s8u8s32`` (``_mkl.py``): where the CPU has AMX and ``lowbit[mkl]`` is
#: installed.
USE_MKL = _mkl.USE_MKL
#: Rows above which the MKL GEMM runs (at and below them, lowbit's GEMV).
MKL_MIN_ROWS = 16
#: Whether the integer GEMV and GEMM use the AVX-512 VNNI kernels (the CPU has them); the portable
#: loops and the float64 BLAS GEMM otherwise.
USE_VNNI = _vnni.AVAILABLE
#: Rows at or below which the GEMV kernels run instead of the BLAS GEMM.
GEMV_MAX_ROWS = 8
#: The same for the VNNI kernels: the GEMM spreads every weight code into its panels first (a
#: fixed cost of a few ms at K = N = 4096), the GEMV costs ~0.09 ms a row. Measured on a 2-core
#: Intel Xeon at K = N = 4096, GEMV against GEMM: ternary 17 rows 0.7 against 5.2 ms, 32 rows 2.9
#: against 6.0, 48 4.3 against 6.4, 96 10.9 against 8.4; int8 and sign at 32 rows 4.4 / 3.8
#: against 7.3 / 5.8, at 48 about even.
VNNI_GEMV_MAX_ROWS = 32
#: Whether the integer GEMV and GEMM use the 256-bit kernels of ``_avx2.py`` where the AVX-512
#: VNNI ones cannot run (the CPU has AVX2; ``_avx2.AVX_VNNI`` says whether with ``vpdpbusd``).
USE_AVX2 = _avx2.AVAILABLE
#: Rows at or below which the AVX2 GEMV runs instead of its GEMM (the same Xeon compiling for
#: Haswell: ternary 32 rows 5.0 against 7.9 ms, int8 12.4 against 15.9, sign 6.7 against 8.3;
#: at 48 rows int8 and sign about even).
AVX2_GEMV_MAX_ROWS = 32
#: NumPy BLAS kernels (``_backend.numpy_blas_kernel``, lower case) whose float32 GEMM runs on
#: 512-bit vectors: OpenBLAS's AVX-512 core types, and oneMKL.
AVX512_BLAS = frozenset({"skylakex", "cooperlake", "sapphirerapids", "mkl"})
#: Whether the exact backward's float32 products (``matmul_dx`` above ``GEMV_MAX_ROWS`` rows,
#: ``matmul_dw``) run the tiles of ``_fma.py``; else NumPy's BLAS on decoded float32 tiles. A
#: measured rule: only tiles wider than the BLAS's kernels win. 512-bit tiles beat a BLAS on
#: 256-bit kernels (one core of a 2-core EPYC Zen 5, OpenBLAS on its Haswell kernels,
#: 256 x 4096 x 4096: sgemm 69 ms, dx 39 ms) and lose to one on 512-bit kernels (2-core Intel
#: Xeon, OpenBLAS SkylakeX, the whole straight-through backward: tiles 137-155 ms, BLAS 98-124 ms,
#: in alternation); the 256-bit tiles lose to OpenBLAS's Haswell kernels (2-core EPYC Zen 3, no
#: AVX-512, the same backward: tiles 185-195 ms, BLAS 152-166 ms, NumPy f32 137-149 ms). Those
#: BLAS figures are of the serial-decode path before ``_backward.dx_blocks``; on a 2-core EPYC
#: Zen 4 (OpenBLAS SkylakeX, in alternation) the tiles ran it in 90-93 ms, the BLAS blocks in
#: 90-95 ms, NumPy f32 in 96-100 ms.
USE_FMA = _fma.WIDE and (_backend.numpy_blas_kernel() or "").lower() not in AVX512_BLAS
#: Activation elements (M * K) from which ``matmul_dw`` transposes them for the AVX-512 tiles:
#: read down the columns of a large A the tiles' loads conflict in L1 (one core, M = 256,
#: K = N = 4096: dw 42 ms, transposed 36 + 2 ms), while for a small one the transpose costs more
#: than it saves (M = 128, K = 512, N = 128: 82 against 127 us).
DW_TRANSPOSE_MIN = 1 << 20
#: Output columns decoded per float32 BLAS tile in ``matmul_float`` (the tile stays in L2/L3).
TILE_N = 512
#: Rows from which ``matmul_dx`` of ternary and sign weights runs the table-lookup kernels of
#: ``_lut.py``. Their tables cost about as much for one row as for 16 (one row's lanes of 16):
#: 2-core EPYC Zen 4, K = N = 4096 ternary, dx at 1 / 2 / 4 / 16 rows 2.6-2.9 / 2.2-2.4 /
#: 2.2-2.5 / 2.3-2.6 ms against the transposed GEMV's 1.5-1.9 / 2.9 / 6.5 / 22-28 and the BLAS
#: blocks' 2.1 / 2.0-2.5 / 4.8-5.0 / 6.9-7.5.
LUT_MIN_ROWS = 2
#: Rows from which ``matmul_float`` of ternary and sign weights runs ``_lut.gemm``; fewer run
#: ``_lut_gemv.gemv``, which takes one row at a time. 2-core EPYC Zen 4 (AVX-512), ms at
#: 1 / 4 / 8 / 12 / 16 rows, gemv against gemm: ternary K = N = 4096 0.56 / 1.6 / 3.1 / 4.5 / 5.9
#: against 3.4-3.9; K = 2560, N = 6912 0.84 / 2.4 / 4.1 / 6.0 / 8.0 against 4.2-4.9; K = N = 1024
#: 0.09 / 0.29 / 0.56 / 0.84 / 1.1 against 0.35-0.40; sign K = N = 4096 0.26 / 0.70 / 1.26 / 1.87
#: / 2.61 against 2.3-2.8, K = N = 1024 0.04 / 0.15 / 0.31 / 0.46 / 0.61 against 0.46-0.54.
LUT_GEMM_ROWS = {"ternary": 6, "sign": 12}
#: Rows below which ``matmul_float`` of int8 weights (and the BitNet head) runs
#: ``_f32_gemv.gemv`` (where it can run) instead of decoding the weight to float32 tiles for
#: BLAS. 2-core EPYC Zen 4, ms at 16 / 32 / 64 / 96 / 128 rows, gemv against tiles: K = N = 2560
#: 2.5 / 7.7 / 9.4 / 11.9 / 16.8 against 13.0 / 14.1 / 19.0 / 20.2 / 23.1; K = 2560, N = 6912
#: 7.7 / 16.6 / 24.9 / 34.7 / 45.6 against 25.6 / 35.4 / 38.6 / 49.0 / 52.1; K = 6912, N = 2560
#: 7.4 / 14.5 / 20.6 / 32.6 / 47.7 against 20.7 / 21.5 / 26.3 / 32.7 / 39.5. BitNet 2B's bf16
#: head (128256 x 2560) at 8 / 16 / 32 / 64 rows: 82 / 112 / 168 / 270 against 540 / 582 / 613 /
#: 750 (its blocks decode every row to float32). One row at K = N = 2560: 0.12-0.16 ms against
#: 2.9.
F32_GEMV_ROWS = 96


def _lut_product(a, data, format, K, scale_w, columns):
    """``(a @ codes.T) * scale_w`` (forward: reduction over the packed codes of a weight row;
    below ``LUT_GEMM_ROWS`` rows ``_lut_gemv.gemv``) or, with ``columns``, ``a @ codes * scale_w``
    (dx: reduction over the weight rows) through ``_lut.gemm``; None where ``gemm`` meets a
    ternary field that holds no code (3), which the caller's other path reads as a code of 2, as
    the reference does."""
    bits = _BITS[format]
    per_column = scale_w.ndim > 0 and not columns
    scale = np.float32(1 if per_column else scale_w)
    col_scale = scale_w if per_column else np.empty(0, np.float32)
    out = _backend.empty((a.shape[0], K if columns else data.shape[0]), np.float32)
    if not columns and a.shape[0] < LUT_GEMM_ROWS[format]:
        _lut_gemv.gemv(*_backend.read_only(a, data), bits, scale, col_scale, out)
        return out
    off, ok = _lut.offsets_cols(data, bits, K) if columns else _lut.offsets_rows(data, bits)
    if not ok:
        return None
    _lut.gemm(*_backend.read_only(a, off), bits, 8 // bits if columns else 1, scale, col_scale,
              numba.get_num_threads(), out)
    return out


def matmul_int(codes_x, scale_x, data, scale_w, format, K):
    """``_numpy.matmul_int``'s contract, bit for bit: exact int32 products by the VNNI kernels,
    the 256-bit AVX2 / AVX-VNNI ones, or the portable GEMV (few rows) and float64-field BLAS
    GEMM."""
    M = codes_x.shape[0]
    N = data.shape[0]
    y = _backend.empty((M, N), np.float32)
    scale_w = np.ascontiguousarray(scale_w, dtype=np.float32).reshape(-1)
    if M == 0:  # no rows: nothing to compute (the kernels size their work by the rows)
        return y
    if USE_MKL and M > MKL_MIN_ROWS:
        _mkl.gemm(codes_x, scale_x, data, scale_w, _BITS[format], K, y)
    elif USE_VNNI:
        if M <= VNNI_GEMV_MAX_ROWS:
            _avx2.gemv(codes_x, scale_x, data, scale_w, _BITS[format], y)
        else:
            _vnni.gemm(codes_x, scale_x, data, scale_w, _BITS[format], K, y)
    elif USE_AVX2:
        if M <= AVX2_GEMV_MAX_ROWS:
            _avx2.gemv(codes_x, scale_x, data, scale_w, _BITS[format], y)
        else:
            _avx2_gemm.gemm(codes_x, scale_x, data, scale_w, _BITS[format], K, y)
    elif M <= GEMV_MAX_ROWS:
        _gemv.gemv(codes_x, scale_x, data, scale_w, format, y)
    else:
        _gemm_f64.gemm(codes_x, scale_x, data, scale_w, format, K, y)
    return y


def matmul_float(x, data, scale_w, format, K):
    """x: [M, K] float32 -> [M, N] float32 ``(x @ codes_w) * scale_w``, float32 accumulation.

    Ternary and sign weights: the table-lookup kernels (``_lut_gemv.gemv`` below
    ``LUT_GEMM_ROWS`` rows, else ``_lut.gemm``); int8 weights below ``F32_GEMV_ROWS`` rows
    where it runs (``_f32_gemv.AVAILABLE``): ``_f32_gemv.gemv``. Else (more rows of int8
    weights, or a ternary field of 3 from ``LUT_GEMM_ROWS`` rows) decodes TILE_N output columns
    at a time to float32, field-major, and multiplies them with the activations permuted to
    match (BLAS).
    """
    M = x.shape[0]
    N, nbytes = data.shape
    if scale_w.size == 1:  # one scale, as a 0-d or a 1-value array
        scale_w = scale_w.reshape(())
    if format != "int8":
        y = _lut_product(x, data, format, K, scale_w, False)
        if y is not None:
            return y
    elif M < F32_GEMV_ROWS and _f32_gemv.AVAILABLE:
        return _f32_gemv.gemv(x, _backend.read_only(data), scale_w.reshape(-1),
                              _backend.empty((M, N), np.float32))
    xs = _decode.field_major(x, 8 // _BITS[format], nbytes)
    y = _backend.empty((M, N), np.float32)
    for n0 in range(0, N, TILE_N):
        n1 = min(N, n0 + TILE_N)
        tile = _decode.decode_codes_f32(data, format, n0, n1, 0, K)
        y[:, n0:n1] = (xs @ tile.T) * (scale_w if scale_w.ndim == 0 else scale_w[n0:n1])
    return y


def matmul_dx(dy, data, scale_w, format, K):
    """dy: [M, N] float32 -> dx [M, K] float32 ``dy @ (codes_w * scale_w).T``.

    Ternary and sign weights from ``LUT_MIN_ROWS`` rows: the table-lookup kernels of ``_lut.py``.
    Else few rows of ternary and sign codes: the transposed GEMV kernel over packed bytes; more
    rows, and int8 weights: the AVX-512 float32 tiles of ``_fma.py`` decoding the codes on the
    fly (``USE_FMA``), or SciPy's BLAS on tiles decoded in each task (``_backward.dx_blocks``).
    A per-tensor scale multiplies once at the end.
    """
    M, N = dy.shape
    per_tensor = scale_w.ndim == 0
    g = dy if per_tensor else np.ascontiguousarray(dy * scale_w, dtype=np.float32)
    if format != "int8" and M >= LUT_MIN_ROWS:
        dx = _lut_product(g, data, format, K, np.float32(scale_w if per_tensor else 1), True)
        if dx is not None:
            return dx
    dx = _backend.empty((M, K), np.float32)
    # The transposed GEMV only for ternary and sign codes: with int8 weights it lost at every row
    # count (K = N = 4096, 1 / 2 / 8 rows: 4.5 / 6.5-6.9 / 14.1-14.7 ms against the blocks'
    # 2.2-3.9 / 4.1-4.7 / 6.5-6.7 and the AVX-512 tiles' 4.7-4.9 / 5.0-5.1 / 4.6-5.3).
    few = M <= GEMV_MAX_ROWS and format != "int8"
    if not few and USE_FMA:
        scale = np.float32(scale_w if per_tensor else 1)
        _fma.dx_kernel(*_backend.read_only(g, data), _BITS[format], K, scale, _fma.KC, dx)
        return dx
    if not few:
        _backward.dx_blocks(*_backend.read_only(g, data), format, K,
                            scale_w if per_tensor else 1, dx)
        return dx
    _backward.dx_gemv(g, data, format, K, dx)
    if per_tensor:
        dx *= scale_w
    return dx


def matmul_dx_int(dy_codes, dy_scale, data, scale, format, K):
    """``_numpy.matmul_dx_int``'s contract, bit for bit: oneMKL's (``_mkl.gemm_dx``, with AMX), the
    VNNI or the 256-bit GEMM reading the packed weight across its rows (``_vnni.gemm_dx``,
    ``_avx2_gemm.gemm_dx``), or float64 BLAS on the decoded codes."""
    if USE_MKL and dy_codes.shape[0] > MKL_MIN_ROWS:
        dx = _backend.empty((dy_codes.shape[0], K), np.float32)
        return _mkl.gemm_dx(dy_codes, dy_scale, data, _BITS[format], K, np.float32(scale), dx)
    if not (USE_VNNI or USE_AVX2):
        return _numpy.matmul_dx_int(dy_codes, dy_scale, data, scale, format, K)
    dx = _backend.empty((dy_codes.shape[0], K), np.float32)
    if dy_codes.shape[0] == 0:
        return dx
    kernel = _vnni.gemm_dx if USE_VNNI else _avx2_gemm.gemm_dx
    kernel(dy_codes, dy_scale, data, _BITS[format], K, np.float32(scale), dx)
    return dx


def matmul_dw(dy, a, scale_a):
    """dw [K, N] float32 = ``Qa(x).T @ dy``: the AVX-512 float32 tiles of ``_fma.py``
    (``USE_FMA``) or SciPy's BLAS on blocks of the dequantized activations
    (``_backward.dw_blocks``).

    Args:
        a: [M, K] int8 codes (with ``scale_a`` [M] float32) or float32 activations (``scale_a``
            None); dy: [M, N] float32.
    """
    if not USE_FMA:
        return _backward.dw_blocks(*_backend.read_only(a, dy), scale_a)
    dw = _backend.empty((a.shape[1], dy.shape[1]), np.float32)
    transposed = a.size >= DW_TRANSPOSE_MIN
    if scale_a is not None:
        a = _backward.dequantize_rows(a, scale_a, transposed)
    elif transposed:
        a = np.ascontiguousarray(a.T)
    _fma.dw_kernel(_backend.read_only(a), transposed, _backend.read_only(dy), _fma.KC, dw)
    return dw
