"""The matrix products of the chunked gated delta rule (``_numba_chunked.py``), in two forms with
one calling convention: SciPy's BLAS ``?gemm`` (every dtype and shape: the portable path) and the
AVX-512 float32 register tiles of ``lowbit/ops/packed_matmul/_numba/_fma.py`` (6 x 64
accumulators, fused multiply-adds in a fixed order: deterministic), which need 64-column right
operands: K = V = ``_numba_chunked.BLOCK`` = 64 (``tiles_fit``), on a CPU with AVX-512.

Why the tiles: OpenBLAS runs its AVX2 kernels on AMD Zen, and each of these small products
also pays a BLAS call; here the tiles run the block products at ~250 GFLOP/s on one core,
against ~140 through BLAS (the three set-up products of a block: 10.4 against 18.5 us).

``product(a, rows, count, ta, panel, c, load, tiles, blas)``: ``c[:rows] (+)= A @ panel[:count]``
with A = ``a[:rows, :count]`` or, with ``ta``, ``a[:count, :rows].T`` (read in place: the tiles
take A through element strides), ``panel`` a row-major right operand, never transposed (the
kernels keep transposed copies where they need them, ``transpose``). ``tiles``: ``True`` runs the
tiles, ``False`` or ``None`` BLAS with ``blas``, its (int32 [8], dtype [2]) argument buffers.
The kernels pass ``None`` for every dtype but float32: Numba drops the branch that an
``is not None`` test of a None argument rules out, so a float64 kernel never types the
float32-only tiles, while a float32 kernel holds both paths and picks one at run time (one
compilation: a second one per path would add ~30 s of compiling).

Siblings: ``_numba_chunked.py`` (the kernels), ``_numba.py``, ``_numpy.py``; tests
``tests/test_gated_delta_scan_chunked.py``.
"""

import llvmlite.binding
import numba
from numba import types
from numba.extending import get_cython_function_address

from ..packed_matmul._numba import _fma

for _name in ("sgemm", "dgemm"):
    llvmlite.binding.add_symbol(f"lowbit_{_name}",
                                get_cython_function_address("scipy.linalg.cython_blas", _name))
# Fortran ?gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): every argument a
# pointer, passed as an address.
_SGEMM = types.ExternalFunction("lowbit_sgemm", types.void(*([types.intp] * 13)))
_DGEMM = types.ExternalFunction("lowbit_dgemm", types.void(*([types.intp] * 13)))
_NO, _YES = ord("N"), ord("T")
_INT = 4  # bytes of a Fortran integer in SciPy's LP64 BLAS


@numba.njit(cache=True)
def uses_tiles(tiles):
    """Whether the products run on the tiles (``tiles`` True; never for None)."""
    return tiles is not None and tiles


def tiles_fit(dtype, nk, nv, block):
    """Whether the register tiles can run every product: float32, every width 64 (the CPU's
    AVX-512, ``_fma.AVAILABLE``, is the caller's check)."""
    return dtype == "float32" and nk == nv == block == _fma.PANEL


@numba.njit(cache=True)
def _gemm(a, ta, b, c, beta, ints, scalars):
    """c = op(a) @ b + beta * c for row-major 2-D arrays (rows may be strided, columns
    contiguous); op transposes when ta."""
    m, n = c.shape
    item = c.itemsize
    # Row-major c is column-major c.T = b.T @ op(a).T: b goes first.
    ints[0] = n
    ints[1] = m
    ints[2] = a.shape[0] if ta else a.shape[1]
    ints[3] = b.strides[0] // item
    ints[4] = a.strides[0] // item
    ints[5] = c.strides[0] // item
    ints[6] = _NO
    ints[7] = _YES if ta else _NO
    scalars[0] = 1
    scalars[1] = beta
    i = ints.ctypes.data
    s = scalars.ctypes.data
    args = (i + 6 * _INT, i + 7 * _INT, i, i + _INT, i + 2 * _INT, s, b.ctypes.data,
            i + 3 * _INT, a.ctypes.data, i + 4 * _INT, s + item, c.ctypes.data, i + 5 * _INT)
    if item == 4:
        _SGEMM(*args)
    else:
        _DGEMM(*args)


@numba.njit(cache=True)
def product(a, rows, count, ta, panel, c, load, tiles, blas):
    """c[:rows] (+)= A @ panel[:count]: A = a[:rows, :count], or a[:count, :rows].T with ta
    (a, panel, c C-contiguous 2-D; panel and c of equal width, 64 for the tiles)."""
    if tiles is not None:
        if tiles:
            width = a.shape[1]
            si, sr = (1, width) if ta else (width, 1)
            _fma.panel_block(a, rows, si, sr, 0, panel, count, c, 0, load)
            return
    view = a[:count, :rows] if ta else a[:rows, :count]
    _gemm(view, ta, panel[:count], c[:rows], 1 if load else 0, blas[0], blas[1])


@numba.njit(cache=True)
def triangular_product(a, n, ta, upper, panel, c, load, tiles, blas):
    """c[:n] (+)= A @ panel[:n] for A = a[:n, :n] (a[:n, :n].T with ta) triangular, lower or
    ``upper``, zero elsewhere: the tiles skip the zeros, six rows at a time (about half the
    multiply-adds at n = 64); BLAS runs the whole square."""
    if tiles is not None:
        if tiles:
            width = a.shape[1]
            si, sr = (1, width) if ta else (width, 1)
            flat = a.reshape(-1)
            for i0 in range(0, n, _fma.TILE_ROWS):
                rows = min(_fma.TILE_ROWS, n - i0)
                r0, count = (i0, n - i0) if upper else (0, i0 + rows)
                # A[i0:, r0:] starts i0 * si + r0 * sr elements into a: a row-offset C slice
                # cannot start a transposed A there, so the tile gets a [1, ...] array from it.
                start = flat[i0 * si + r0 * sr:]
                _fma.panel_block(start.reshape((1, start.size)), rows, si, sr, 0, panel[r0:],
                                 count, c[i0:], 0, load)
            return
    product(a, n, n, ta, panel, c, load, tiles, blas)


@numba.njit(cache=True)
def transpose(a, out):
    """out = a.T (2-D), a row of out at a time: contiguous stores, strided loads (at 64 x 64
    float32 0.6 us, against 1.0 a row of a at a time and 2.6 in 8 x 8 blocks)."""
    m, n = a.shape
    for j in range(n):
        for i in range(m):
            out[j, i] = a[i, j]
