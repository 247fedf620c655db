"""Tests of ``cuda/packed_matmul.cu``'s integer kernels at their edges (the op's tests across every
backend are ``tests/test_packed_matmul.py``): the 128 x 128 GEMM of ``packed_matmul_gemm.cuh``
over several block rows and columns, its cp.async stages and plain-load paths, its row tiles past
the grid limit; the GEMV at its row and K limits; the launcher's routing between the two. Each
case against ``reference/packed_matmul.py``, bit for bit (integer products are exact).
"""

import numpy as np
import pytest
from helpers import assert_equal, to_numpy

import lowbit
from lowbit.reference.packed_matmul import packed_matmul_ref
from lowbit.reference.quantize import quantize_weight_ref

from test_packed_matmul import FORMATS, _data, _packed

# The kernels at their edges (cudasim and cuda; small: cudasim runs a thread per CUDA thread):
# (M, K, N, aligned) of 128 x 128 GEMM tiles over two block rows and columns with odd K (plain
# loads); one GEMM block over three 64-k stages through cp.async (K a multiple of 64: 16-byte
# rows for activations and every weight format); the GEMV at its row limit with 16-byte weight
# rows (128-bit loads) and a partial block of columns; the GEMV with more 16-byte chunks a row
# than lanes (ternary, int8) and odd K. Aligned cases run again with the weight misaligned.
KERNEL_CASES = [(130, 40, 133, False), (9, 192, 5, True), (8, 256, 17, True),
                (2, 2500, 9, False)]


def _kernel_backend(backend):
    if backend.name not in ("cudasim", "cuda"):
        pytest.skip("a test of the CUDA kernels")


def _misaligned(backend, a):
    """A C-contiguous copy of ``a`` one byte past an allocation's start (not 16-byte aligned)."""
    buf = backend.xp.zeros(a.size + 1, a.dtype)
    out = buf[1:].reshape(a.shape)
    out[...] = backend.to(a)
    return out


@pytest.mark.parametrize("format", FORMATS)
def test_kernel_tiles_stages_and_edges(backend, rng, format):
    """Every KERNEL_CASES shape against the reference, the aligned ones again with the packed
    weight one byte off its alignment (the kernels' plain-load paths)."""
    _kernel_backend(backend)
    for M, K, N, aligned in KERNEL_CASES:
        x, w = _data(rng, M, K, N)
        data, scale = quantize_weight_ref(w, format)
        ref = packed_matmul_ref(x, data, scale, format, K)
        for packed in [backend.to(data)] + [_misaligned(backend, data)] * aligned:
            pw = lowbit.PackedWeight(format, w.shape, packed, backend.to(scale))
            assert_equal(f"y {M}x{K}x{N}", ref, lowbit.packed_matmul(backend.to(x), pw, "int8"))


def test_gemm_row_tiles_past_the_grid(backend, rng, monkeypatch):
    """With gridDim.y clamped to 1, one block row strides over all three 128-row tiles."""
    from lowbit import _kernels

    _kernel_backend(backend)
    monkeypatch.setattr(_kernels, "MAX_GRID", (_kernels.MAX_GRID[0], 1, _kernels.MAX_GRID[2]))
    x, w = _data(rng, 257, 40, 20)
    pw = _packed(backend, w, "sign")
    ref = packed_matmul_ref(x, to_numpy(pw.data), to_numpy(pw.scale), "sign", 40)
    assert_equal("y", ref, lowbit.packed_matmul(backend.to(x), pw, "int8"))


def test_gemv_exact_at_its_longest_k(backend):
    """The GEMV sums -64 x each ternary / sign product: at K = GEMV_MAX_K with every code at its
    largest magnitude the sum is 64 x 127 K, just inside int32, and still exact (ternary; sign
    shares the shift). The weight is packed by hand (codes +1 and -1: stored fields 2 and 0)."""
    from lowbit.ops.packed_matmul._cuda import GEMV_MAX_K

    _kernel_backend(backend)
    K = GEMV_MAX_K
    assert 64 * 127 * K < 2**31 <= 64 * 127 * (K + 1)  # the bound is tight
    x = np.ones((1, K), np.float32)
    data = np.zeros((2, -(-K // 4)), np.uint8)
    data[0] = 0b10101010
    scale = np.ones((), np.float32)
    pw = lowbit.PackedWeight("ternary", (K, 2), backend.to(data), backend.to(scale))
    y = lowbit.packed_matmul(backend.to(x), pw, "int8")
    assert_equal("y", packed_matmul_ref(x, data, scale, "ternary", K), y)


def test_gemv_and_gemm_routing(monkeypatch):
    """Up to GEMV_MAX_ROWS rows and GEMV_MAX_K columns take the GEMV (after gemv_codes reorders
    the activations), everything else the 128 x 128 GEMM; grids and blocks as documented."""
    from lowbit import _kernels
    from lowbit.ops.packed_matmul import _cuda as pm_cuda

    launches = []

    class Recorder:
        def get_function(self, name):
            return lambda grid, block, args, shared_mem=0: launches.append((name, grid, block))

    monkeypatch.setattr(_kernels, "module", lambda *a, **k: Recorder())
    N = 300
    for M, K in [(pm_cuda.GEMV_MAX_ROWS, pm_cuda.GEMV_MAX_K), (1, pm_cuda.GEMV_MAX_K + 1),
                 (pm_cuda.GEMV_MAX_ROWS + 1, 64)]:
        codes = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), (M, K), (0, 0))
        data = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (N, -(-K // 4)), (0, 0))
        pm_cuda.matmul_int(codes, np.zeros(M, np.float32), data, np.ones((), np.float32),
                           "ternary", K)
    names = [name for name, _, _ in launches]
    assert names == ["gemv_codes<0>", "gemv_int<0>", "gemm_int<0>", "gemm_int<0>"]
    assert launches[1][1:] == ((-(-N // 8), 1, 1), (256,))
    assert launches[2][1:] == ((-(-N // 128), 1, 1), (256,))


