"""Launchers for ``cuda/packed_matmul.cu`` (backends cuda and cudasim).

Siblings: ``__init__.py``, ``_numpy.py``, ``_numba/``; reference
``reference/packed_matmul.py``. Few rows run the ``__dp4a`` GEMV kernel (one warp per column,
every row at once, on activation codes reordered by ``gemv_codes``), more rows the 128 x 128
tiled int8 tensor-core GEMM (``cp.async`` double buffering, ``ldmatrix``, ``mma.sync``
m16n8k32; their cudasim twins implement the same fragment layouts).
"""

import numpy as np

from ... import _backend, _kernels

SOURCE = "packed_matmul.cu"
_FORMAT_ID = {"ternary": 0, "sign": 1, "int8": 2}
NAME_EXPRESSIONS = tuple(
    [f"{kernel}<{fmt}>"
     for kernel in ("gemv_codes", "gemv_int", "gemm_int", "matmul_float", "matmul_dx",
                    "matmul_dx_int")
     for fmt in range(3)]
    + ["matmul_dw_codes", "matmul_dw_float"]
)
#: Rows at or below which the GEMV kernel runs instead of the tensor-core GEMM (the GEMV keeps
#: one accumulator per row in registers).
GEMV_MAX_ROWS = 8
#: Longest K of the GEMV: it sums -64 x each ternary / sign product, which fits in int32 while
#: 127 K < 2^25; longer rows take the GEMM.
GEMV_MAX_K = (1 << 25) // 127
GEMV_WARPS = 8
#: Packed bytes one GEMV lane loads at once; its reordered activation rows are padded to this
#: many bytes' worth of codes.
GEMV_CHUNK = 16
GEMM_WARPS = 8
TILE_M = 128
TILE_N = 128
WARP = 32
THREADS = 256
#: Grid-stride loops cover the rest; enough blocks to fill any current GPU.
MAX_BLOCKS = 4096
#: Blocks of the float path's (row, column group) loop: one full wave of 256-thread blocks on an
#: H200 (132 SMs x 8), so any number of rows is covered without a grid limit.
FLOAT_BLOCKS = 1024
_CODES_PER_BYTE = {"ternary": 4, "sign": 8, "int8": 1}
#: The constants of the .cu file this launcher mirrors (tests/test_launch_constants.py).
CU_CONSTANTS = {
    "kGemvWarps": GEMV_WARPS, "kGemvMaxRows": GEMV_MAX_ROWS, "kGemvMaxK": GEMV_MAX_K,
    "kGemvChunk": GEMV_CHUNK, "kGemmWarps": GEMM_WARPS, "kTileM": TILE_M, "kTileN": TILE_N,
    "kWarpSize": WARP, "kTernary": _FORMAT_ID["ternary"], "kSign": _FORMAT_ID["sign"],
    "kInt8": _FORMAT_ID["int8"],
}


def _kernel(name, like):
    return _kernels.module(SOURCE, NAME_EXPRESSIONS, like).get_function(name)


def _scale_args(scale_w):
    xp = _backend.array_module(scale_w)
    flat = xp.ascontiguousarray(scale_w, dtype=np.float32).reshape(-1)
    return flat, np.int64(1 if flat.size > 1 else 0)


def matmul_int(codes_x, scale_x, data, scale_w, format, K):
    """Exact int32 ``codes_x @ codes_w``, then ``float32(acc) * scale_x[:, None] * scale_w``.

    Args:
        codes_x: [M, K] int8; scale_x: [M] float32; data: [N, bytes] packed weight;
        scale_w: float32, 0-d or [N]; format; K.

    Returns:
        [M, N] float32.
    """
    xp = _backend.array_module(codes_x)
    M = codes_x.shape[0]
    N, nbytes = data.shape
    y = _backend.empty((M, N), np.float32, xp)
    if not y.size:
        return y
    sw, stride = _scale_args(scale_w)
    fmt = _FORMAT_ID[format]
    if M <= GEMV_MAX_ROWS and K <= GEMV_MAX_K:
        chunk_codes = GEMV_CHUNK * _CODES_PER_BYTE[format]
        Kp = -(-K // chunk_codes) * chunk_codes
        codes = _backend.empty((M, Kp), np.int8, xp)
        _kernel(f"gemv_codes<{fmt}>", codes_x)(
            (max(1, min(MAX_BLOCKS, -(-codes.size // (GEMV_CHUNK * THREADS)))),), (THREADS,),
            (codes_x, codes, np.int64(M), np.int64(K), np.int64(Kp)))
        _kernel(f"gemv_int<{fmt}>", codes_x)(
            _kernels.grid(-(-N // GEMV_WARPS), what="packed_matmul"), (GEMV_WARPS * WARP,),
            (codes, scale_x, data.view(np.uint8), sw, y, np.int64(M), np.int64(N),
             np.int64(Kp), np.int64(nbytes), stride))
    else:
        # The kernel strides over row tiles by gridDim.y: clamp it to CUDA's limit.
        row_tiles = min(-(-M // TILE_M), _kernels.MAX_GRID[1])
        _kernel(f"gemm_int<{fmt}>", codes_x)(
            _kernels.grid(-(-N // TILE_N), row_tiles, what="packed_matmul"),
            (GEMM_WARPS * WARP,),
            (codes_x, scale_x, data.view(np.uint8), sw, y, np.int64(M), np.int64(N),
             np.int64(K), np.int64(nbytes), stride))
    return y


def matmul_float(x, data, scale_w, format, K):
    """x: [M, K] float32 -> [M, N] float32 ``(x @ codes_w) * scale_w``, float32 accumulation."""
    xp = _backend.array_module(x)
    M = x.shape[0]
    N, nbytes = data.shape
    y = _backend.empty((M, N), np.float32, xp)
    if y.size:
        sw, stride = _scale_args(scale_w)
        tasks = M * -(-N // GEMV_WARPS)
        _kernel(f"matmul_float<{_FORMAT_ID[format]}>", x)(
            (min(tasks, FLOAT_BLOCKS),), (GEMV_WARPS * WARP,),
            (x, data.view(np.uint8), sw, y, np.int64(M), np.int64(N), np.int64(K),
             np.int64(nbytes), stride))
    return y


def matmul_dx(dy, data, scale_w, format, K):
    """dy: [M, N] float32 -> dx [M, K] float32 ``dy @ (codes_w * scale_w).T``."""
    xp = _backend.array_module(dy)
    M, N = dy.shape
    dx = _backend.empty((M, K), np.float32, xp)
    if dx.size:
        sw, _ = _scale_args(scale_w)
        _kernel(f"matmul_dx<{_FORMAT_ID[format]}>", dy)(
            (max(1, min(MAX_BLOCKS, -(-dx.size // THREADS))),), (THREADS,),
            (dy, data.view(np.uint8), sw, dx, np.int64(M), np.int64(N), np.int64(K),
             np.int64(data.shape[1])))
    return dx


def matmul_dx_int(dy_codes, dy_scale, data, scale, format, K):
    """dy_codes [M, N] int8, dy_scale [M] float32 -> dx [M, K] float32
    ``float32(dy_codes @ codes_w.T) * dy_scale[:, None] * scale`` (``scale`` 0-d float32)."""
    xp = _backend.array_module(dy_codes)
    M, N = dy_codes.shape
    dx = _backend.empty((M, K), np.float32, xp)
    if dx.size:
        # A host scale (the caller's 1 for per-column weights) is uploaded once, then cached.
        sw = (xp.ascontiguousarray(scale, dtype=np.float32).reshape(-1)
              if _backend.is_cupy_array(scale) or not _backend.is_cupy_array(dy_codes)
              else _kernels.device_constant(np.asarray(scale, np.float32).reshape(1), dy_codes))
        _kernel(f"matmul_dx_int<{_FORMAT_ID[format]}>", dy_codes)(
            (max(1, min(MAX_BLOCKS, -(-dx.size // THREADS))),), (THREADS,),
            (dy_codes, dy_scale, data.view(np.uint8), sw, dx, np.int64(M), np.int64(N),
             np.int64(K), np.int64(data.shape[1])))
    return dx


def matmul_dw(dy, a, scale_a):
    """dw [K, N] float32 = ``Qa(x).T @ dy``.

    Args:
        a: [M, K] int8 codes (with ``scale_a`` [M] float32) or float32 activations (``scale_a``
            None); dy: [M, N] float32.
    """
    xp = _backend.array_module(dy)
    M, K = a.shape
    N = dy.shape[1]
    dw = _backend.empty((K, N), np.float32, xp)
    if dw.size:
        grid = (max(1, min(MAX_BLOCKS, -(-dw.size // THREADS))),)
        sizes = (np.int64(M), np.int64(N), np.int64(K))
        if scale_a is None:
            _kernel("matmul_dw_float", dy)(grid, (THREADS,), (a, dy, dw) + sizes)
        else:
            _kernel("matmul_dw_codes", dy)(grid, (THREADS,), (a, scale_a, dy, dw) + sizes)
    return dw
