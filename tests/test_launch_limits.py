"""Launches inside the hardware's limits: grid dimensions and dynamic shared memory.

cudasim checks every launch against CUDA's limits (gridDim.y and gridDim.z at most 65535, dynamic
shared memory at most 48 KiB unless the kernel's ``max_dynamic_shared_size_bytes`` is raised, up
to the opt-in limit), so a shape past a limit that runs here runs on a GPU too. The launchers
go through ``lowbit._kernels.grid`` and ``lowbit._kernels.dynamic_shared``; references:
``reference/packed_matmul.py``, ``reference/lowrank_residual.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import lowbit
from lowbit import _cudasim, _kernels
from lowbit.ops.lowrank_residual import _cuda as lowrank_cuda
from lowbit.ops.pack_bits import _cuda as pack_cuda
from lowbit.ops.packed_matmul import _cuda as pm_cuda
from lowbit.ops.lowrank_residual._layer import rope_tables
from lowbit.reference.lowrank_residual import causal_linear_bwd_ref

from helpers import assert_close

pytestmark = pytest.mark.skipif(not _cudasim.available(),
                                reason=f"cudasim unavailable: {_cudasim.unavailable_reason()}")


def test_cudasim_refuses_a_grid_past_cudas_limits():
    # The emulator holds launchers to the hardware: a y dimension of 65536 does not launch.
    codes = np.zeros((1, 8), np.uint8)
    kernel = _kernels.module(pack_cuda.SOURCE, pack_cuda.NAME_EXPRESSIONS, codes).get_function(
        "pack_bits<1>")
    out = np.zeros((1, 1), np.uint8)
    with pytest.raises(ValueError, match="grid dimension y is 65536"):
        kernel((1, 65536), (32,), (codes, out, np.int64(1), np.int64(8), np.int64(1)))


@pytest.mark.parametrize("dims", [(1, 65536), (1, 1, 65536), (2**31, 1), (0, 1)])
def test_grid_names_the_launch_past_a_limit(dims):
    with pytest.raises(ValueError, match="the layer needs gridDim"):
        _kernels.grid(*dims, what="the layer")
    assert _kernels.grid(2**31 - 1, 65535, 65535, what="the layer") == (2**31 - 1, 65535, 65535)


def test_bdh_layer_with_a_batch_past_the_grid_limit_is_refused_before_launch():
    B, T, N, D = 65536, 1, 2, 1
    x, v = np.zeros((B, T, N), np.float32), np.zeros((B, T, D), np.float32)
    table = np.ones((T, N // 2), np.float32)
    with lowbit.use_backend("cudasim"):
        with pytest.raises(ValueError, match="the BDH layer needs gridDim.y = 65536"):
            lowrank_cuda.causal_linear_forward(x, v, np.array([0, T]), table, table)


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch recorded as ``(name, grid)`` instead of run."""
    calls = []

    class Recorder:
        def get_function(self, name):
            return lambda grid, block, args, shared_mem=0: calls.append((name, grid))

    monkeypatch.setattr(_kernels, "module", lambda *a, **k: Recorder())
    return calls


def test_packed_matmul_float_path_grid_does_not_grow_with_rows(launches):
    # The float path used to launch gridDim.y = M; now at most FLOAT_BLOCKS blocks stride over
    # the (row, column group) tasks on a 1-D grid, so M = 65536 + 7 rows launch that grid
    # (recorded, not run: 65543 emulated warp sums take 40 s here).
    M, K, N = 65536 + 7, 1, 1
    x = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (M, K), (0, 0))
    pm_cuda.matmul_float(x, np.zeros((N, 1), np.uint8), np.ones((), np.float32), "ternary", K)
    assert launches == [("matmul_float<0>", (pm_cuda.FLOAT_BLOCKS,))]


def test_packed_matmul_float_path_strides_over_every_row(rng, monkeypatch):
    # With the grid cut to 3 blocks (of GEMV_WARPS warps), 70 rows x 5 columns take many
    # grid-stride steps, the last one partial: every row is the reference's.
    monkeypatch.setattr(pm_cuda, "FLOAT_BLOCKS", 3)
    M, K, N = 70, 9, 5
    w = rng.standard_normal((K, N)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    with lowbit.use_backend("cudasim"):
        pw = lowbit.quantize_weight(w, "ternary")
        y = lowbit.packed_matmul(x, pw, act_format=None)
    ref = x.astype(np.float64) @ (pw.dequantize().astype(np.float64))
    assert_close("y", ref, y, rtol=1e-6)


def test_gemm_row_tiles_are_clamped_to_the_grid_limit(launches):
    # M = 65535 * 32 + 1 rows would need 65536 row tiles; the launch asks for 65535 and the
    # kernel strides over the rest (too large to run here: the grid is checked at launch).
    M, K, N = 65535 * pm_cuda.TILE_M + 1, 4, 40
    codes = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), (M, K), (0, 0))
    pm_cuda.matmul_int(codes, np.zeros(1, np.float32), np.zeros((N, 1), np.uint8),
                       np.ones((), np.float32), "ternary", K)
    assert launches == [("gemm_int<0>", (-(-N // pm_cuda.TILE_N), 65535, 1))]


def _bdh_backward_case(rng, T, N, D):
    x = rng.standard_normal((1, T, N)).astype(np.float32)
    v = rng.standard_normal((1, T, D)).astype(np.float32)
    da = rng.standard_normal((1, T, D)).astype(np.float32)
    cos, sin = rope_tables(T, N, np)
    return x, v, da, cos, sin


def test_bdh_backward_at_n8192_d256_opts_into_more_shared_memory(rng):
    # (2N + 3D + 2 * 32) floats = 68,864 bytes: past the 48 KiB default, inside the opt-in.
    T, N, D = 3, 8192, 256
    x, v, da, cos, sin = _bdh_backward_case(rng, T, N, D)
    with lowbit.use_backend("cudasim"):
        dx, dv = lowrank_cuda.causal_linear_backward(da, x, v, np.array([0, T]), cos, sin)
    kernel = _kernels.module(lowrank_cuda.SOURCE, lowrank_cuda.NAME_EXPRESSIONS, x).get_function(
        "causal_linear_bwd")
    assert kernel.max_dynamic_shared_size_bytes >= (2 * N + 3 * D + 64) * 4 > 48 * 1024
    ref_dx, ref_dv = causal_linear_bwd_ref(da[0].astype(np.float64), x[0].astype(np.float64),
                                           v[0].astype(np.float64), None)
    assert_close("dx", ref_dx, dx[0], rtol=1e-5)
    assert_close("dv", ref_dv, dv[0], rtol=1e-5)


def test_shared_memory_past_the_device_limit_is_a_clear_error():
    T, N, D = 1, 32768, 4  # (2N + 3D + 64) * 4 bytes = 256 KiB > 227 KiB
    x, v = np.zeros((1, T, N), np.float32), np.zeros((1, T, D), np.float32)
    table = np.ones((T, N // 2), np.float32)
    with lowbit.use_backend("cudasim"):
        with pytest.raises(ValueError, match="the BDH layer's backward at N=32768, D=4 needs "
                                             "262448 bytes"):
            lowrank_cuda.causal_linear_backward(v, x, v, np.array([0, T]), table, table)


def test_dynamic_shared_raises_the_attribute_only_when_needed():
    codes = np.zeros((1, 8), np.uint8)
    kernel = _kernels.module(pack_cuda.SOURCE, pack_cuda.NAME_EXPRESSIONS, codes).get_function(
        "unpack_bits<1>")
    before = kernel.max_dynamic_shared_size_bytes
    assert _kernels.dynamic_shared(kernel, 1024, codes, "k") == 1024
    assert kernel.max_dynamic_shared_size_bytes == before
    assert _kernels.dynamic_shared(kernel, 100 * 1024, codes, "k") == 100 * 1024
    assert kernel.max_dynamic_shared_size_bytes == 100 * 1024
    with pytest.raises(ValueError, match="k needs 232449 bytes"):
        _kernels.dynamic_shared(kernel, _cudasim.MAX_DYNAMIC_SHARED_OPT_IN + 1, codes, "k")
