"""The matrix products of the chunked gated delta rule (``_numba_chunked.py``), in two forms with
one calling convention: SciPy's BLAS ``?gemm`` (every dtype and shape: the portable path,
through ``lowbit/ops/packed_matmul/_numba/_blas.py``) and the float32 register tiles of
``lowbit/ops/packed_matmul/_numba/_fma.py`` (6 x 64 accumulators, fused multiply-adds in a fixed
order: deterministic), which need 64-column right operands: K = V = ``_numba_chunked.BLOCK`` = 64
(``tiles_fit``), on a CPU with AVX-512 or AVX2 + FMA.

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

Beside them: ``tile4``, the 4 x 4 register tiles that solve for A four rows at a time where BLAS
runs the products (a BLAS call per group of rows paid more than it did); ``prefetch`` and
``prefetch_rows``, which ask for the next block's input rows while a block runs (at B = 4,
T = 2048, H = 8 the forward's blocks took ~27 us without, 22.6 with, one thread: rows H apart
lie in different pages, which the hardware prefetchers do not follow).

Siblings: ``_numba_chunked.py`` (the kernels), ``_numba.py``, ``_numpy.py``; tests
``tests/test_gated_delta_scan_chunked.py``.
"""

import numba
from numba import types
from numba.extending import intrinsic

from ..packed_matmul._numba import _fma, _llvm
from ..packed_matmul._numba._blas import gemm


@numba.njit(cache=True)
def uses_tiles(tiles):
    """Whether the products run on the tiles (``tiles`` True; never for None)."""
    return tiles is not None and tiles


def tiles_fit(dtype, nk, nv, block):
    """Whether the register tiles can run every product: float32, every width 64 (the CPU's
    ``_fma.AVAILABLE`` is the caller's check)."""
    return dtype == "float32" and nk == nv == block == _fma.PANEL


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
    gemm(view, ta, panel[:count], c[:rows], 1 if load else 0, blas[0], blas[1])


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


# reassoc lets each sum over p run in SIMD lanes: the 16 sums stay in registers.
@numba.njit(cache=True, fastmath={"contract", "reassoc"})
def tile4(x, y, n, out, i0, j0, zero):
    """out[i0 + r, j0 + c] = x[i0 + r, :n] . y[j0 + c, :n] for r, c < 4; zero: 0 of out's dtype."""
    x0, x1, x2, x3 = x[i0], x[i0 + 1], x[i0 + 2], x[i0 + 3]
    y0, y1, y2, y3 = y[j0], y[j0 + 1], y[j0 + 2], y[j0 + 3]
    c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = zero
    c20 = c21 = c22 = c23 = c30 = c31 = c32 = c33 = zero
    for p in range(n):
        a0, a1, a2, a3 = x0[p], x1[p], x2[p], x3[p]
        b0, b1, b2, b3 = y0[p], y1[p], y2[p], y3[p]
        c00 += a0 * b0
        c01 += a0 * b1
        c02 += a0 * b2
        c03 += a0 * b3
        c10 += a1 * b0
        c11 += a1 * b1
        c12 += a1 * b2
        c13 += a1 * b3
        c20 += a2 * b0
        c21 += a2 * b1
        c22 += a2 * b2
        c23 += a2 * b3
        c30 += a3 * b0
        c31 += a3 * b1
        c32 += a3 * b2
        c33 += a3 * b3
    out[i0, j0:j0 + 4] = (c00, c01, c02, c03)
    out[i0 + 1, j0:j0 + 4] = (c10, c11, c12, c13)
    out[i0 + 2, j0:j0 + 4] = (c20, c21, c22, c23)
    out[i0 + 3, j0:j0 + 4] = (c30, c31, c32, c33)


@numba.njit(cache=True)
def transpose(a, out):
    """out = a.T (2-D), a row of out at a time: contiguous stores, strided loads (at 64 x 64
    float32 0.6 us, against 1.0 a row of a at a time and 2.6 in 8 x 8 blocks)."""
    m, n = a.shape
    for j in range(n):
        for i in range(m):
            out[j, i] = a[i, j]


def _prefetcher(write):
    """Intrinsic ``prefetch(arr, index)``: hint the CPU to fetch the cache line holding
    ``arr.flat[index]`` into L2 (``prefetcht1``; ``write``: for writing, ``prefetchw``); changes
    no value."""

    @intrinsic
    def prefetch(typingctx, arr, index):
        if not isinstance(arr, types.Array):
            return None
        sig = types.void(arr, types.intp)

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            _llvm.prefetch(builder, builder.gep(data, [args[1]]), write, locality=2)
            return context.get_dummy_value()

        return sig, codegen

    return prefetch


_PREFETCH_READ, _PREFETCH_WRITE = _prefetcher(False), _prefetcher(True)


@numba.njit(cache=True)
def prefetch(a, start, count, write):
    """Prefetch a.flat[start:start + count] (a C-contiguous) for reading or ``write``."""
    line = 64 // a.itemsize
    for i in range(start, start + count, line):
        if write:
            _PREFETCH_WRITE(a, i)
        else:
            _PREFETCH_READ(a, i)
    if write:
        _PREFETCH_WRITE(a, start + count - 1)
    else:
        _PREFETCH_READ(a, start + count - 1)


@numba.njit(cache=True)
def prefetch_rows(a, b, t0, t1, h, write):
    """Prefetch the rows a[b, t0:t1, h, :] of a C-contiguous 4-D array (``prefetch``): rows H
    apart lie in different pages, which the hardware prefetchers do not follow."""
    nt, nh, width = a.shape[1], a.shape[2], a.shape[3]
    for t in range(t0, min(t1, nt)):
        prefetch(a, ((b * nt + t) * nh + h) * width, width, write)
