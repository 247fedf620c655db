"""Tests of the layer norm op (``lowbit/ops/layer_norm``).

The float64 reference (``reference/layer_norm.py``) against central finite differences; every
backend against the reference, forward and gradient, over feature counts 1, 3, 37, 256, row
counts up to 300 (several blocks of the CUDA kernel), leading shapes, float32 and float64,
constant rows (variance 0) and large offsets; saved-activation policies; the internal
``normalize`` pair the BDH layer uses; determinism, inputs left unchanged; one test per
validation rule.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import assert_close, assert_equal, numerical_grad, to_numpy

import lowbit
from lowbit.ops.layer_norm import normalize, normalize_backward
from lowbit.reference.layer_norm import layer_norm_bwd_ref, layer_norm_ref

DTYPES = [np.float32, np.float64]
#: Relative error allowed against the float64 reference, per dtype.
RTOL = {np.float32: 2e-6, np.float64: 1e-13}
#: Largest row count under cudasim (one OS thread per CUDA thread: a few blocks only).
CUDASIM_ROWS = 37


def _shape(backend, shape):
    """``shape`` with its row count cut down for cudasim (features kept)."""
    if backend.name != "cudasim" or math.prod(shape[:-1]) <= CUDASIM_ROWS:
        return shape
    return (CUDASIM_ROWS, shape[-1])


def _inputs(rng, shape, dtype, scale=3.0, offset=1.0):
    x = (rng.standard_normal(shape) * scale + offset).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    return x, dy


# -- the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (3,), (2, 37), (2, 3, 5)])
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_reference_backward_matches_finite_differences(rng, shape, eps):
    x = rng.standard_normal(shape)
    weights = rng.standard_normal(shape)

    def loss():
        return float((layer_norm_ref(x, eps) * weights).sum())

    assert_close("dx", numerical_grad(loss, x), layer_norm_bwd_ref(weights, x, eps), rtol=1e-6,
                 atol=1e-8)


def test_reference_backward_on_constant_rows_matches_finite_differences(rng):
    x = np.repeat(rng.standard_normal((3, 1)), 4, axis=1)
    weights = rng.standard_normal(x.shape)

    def loss():
        return float((layer_norm_ref(x, 0.1) * weights).sum())

    assert_close("dx", numerical_grad(loss, x), layer_norm_bwd_ref(weights, x, 0.1), rtol=1e-6)


def test_reference_rows_have_zero_mean_and_unit_variance(rng):
    x = rng.standard_normal((4, 37)) * 5 + 2
    y = layer_norm_ref(x, 1e-12)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose((y**2).mean(-1), 1, rtol=1e-9)


# -- every backend against the reference -----------------------------------------------------------

SHAPES = [(1, 1), (5, 1), (1, 3), (300, 3), (37,), (4, 37), (7, 37), (2, 3, 37), (1, 256),
          (300, 256), (3, 5, 256), (2, 2, 3, 37)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradient_match_reference(backend, rng, shape, dtype):
    x, dy = _inputs(rng, _shape(backend, shape), dtype)
    y, ctx = lowbit.layer_norm_forward(backend.to(x))
    dx = lowbit.layer_norm_backward(backend.to(dy), ctx)
    assert y.dtype == dtype and dx.dtype == dtype
    assert type(y) is type(backend.to(x)) and type(dx) is type(y)
    assert_close("y", layer_norm_ref(x), y, RTOL[dtype])
    assert_close("dx", layer_norm_bwd_ref(dy, x), dx, RTOL[dtype] * 5)
    rstd = np.asarray(1 / np.sqrt(x.astype(np.float64).var(axis=-1) + 1e-5))
    assert_close("rstd", rstd, ctx.rstd.unpack(), RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-3, 2.5])
def test_eps_is_added_to_the_variance(backend, rng, dtype, eps):
    x, dy = _inputs(rng, _shape(backend, (6, 37)), dtype, scale=0.05)
    y, ctx = lowbit.layer_norm_forward(backend.to(x), eps=eps)
    assert ctx.eps == eps
    assert_close("y", layer_norm_ref(x, eps), y, RTOL[dtype])
    assert_close("y (inference)", layer_norm_ref(x, eps), lowbit.layer_norm(backend.to(x), eps=eps),
                 RTOL[dtype])
    assert_close("dx", layer_norm_bwd_ref(dy, x, eps), lowbit.layer_norm_backward(
        backend.to(dy), ctx), RTOL[dtype] * 5)


#: Constant rows: the computed mean may be off by a few ulps of the value (more for long float64
#: sums in sequence), and y = (x - mean) / sqrt(eps) turns that into this absolute error.
CONSTANT_ATOL = {np.float32: 1e-4, np.float64: 1e-11}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 3, 37, 256])
def test_constant_rows(backend, rng, dtype, D):
    """Variance 0 (even rows; odd rows ordinary, in the same array): y = 0 and
    dx = (dy - mean(dy)) / sqrt(eps)."""
    rows = 8
    x = np.repeat(rng.standard_normal((rows, 1)), D, axis=1)
    x[1::2] = rng.standard_normal((rows // 2, D))
    x = x.astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y, ctx = lowbit.layer_norm_forward(backend.to(x))
    dx = to_numpy(lowbit.layer_norm_backward(backend.to(dy), ctx))
    y = to_numpy(y)
    ref_y, ref_dx = layer_norm_ref(x), layer_norm_bwd_ref(dy, x)
    worst = float(np.abs(y[0::2]).max())
    assert worst <= CONSTANT_ATOL[dtype], f"y (constant rows): max |y| {worst:.3e}"
    assert float(np.abs(ref_y[0::2]).max()) <= CONSTANT_ATOL[np.float64]
    assert_close("dx (constant rows)", ref_dx[0::2], dx[0::2], RTOL[dtype] * 5)
    if D > 1:
        assert_close("y (other rows)", ref_y[1::2], y[1::2], RTOL[dtype])
        assert_close("dx (other rows)", ref_dx[1::2], dx[1::2], RTOL[dtype] * 5)


#: Rows of 1e4 + noise of standard deviation 1: the mean is off by a few ulps of 1e4 (float32:
#: 9.8e-4 each), which shifts every y of the row; the error is about ulp(1e4) / std.
OFFSET_RTOL = {np.float32: 4e-3, np.float64: 1e-10}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [3, 37, 256])
def test_large_offsets(backend, rng, dtype, D):
    shape = _shape(backend, (40, D))
    noise = rng.standard_normal(shape)
    noise -= noise.mean(axis=-1, keepdims=True)
    noise /= noise.std(axis=-1, keepdims=True)
    x = (1e4 + noise).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    y, ctx = lowbit.layer_norm_forward(backend.to(x))
    dx = lowbit.layer_norm_backward(backend.to(dy), ctx)
    assert_close("y", layer_norm_ref(x), y, OFFSET_RTOL[dtype])
    assert_close("dx", layer_norm_bwd_ref(dy, x), dx, OFFSET_RTOL[dtype])


def test_empty_rows(backend):
    for dtype in DTYPES:
        x = backend.to(np.zeros((0, 5), dtype))
        y, ctx = lowbit.layer_norm_forward(x)
        dx = lowbit.layer_norm_backward(x, ctx)
        assert y.shape == dx.shape == (0, 5) and y.dtype == dx.dtype == dtype


def test_non_contiguous_inputs(backend, rng):
    """Strided views and a Fortran-ordered array: the op makes them contiguous itself."""
    base, dbase = _inputs(rng, (2 * CUDASIM_ROWS, 2 * 37), np.float32)
    views = [(base[::2, ::2], dbase[::2, ::2]), (np.asfortranarray(base[:9]), dbase[:9, ::-1])]
    for x, dy in views:
        y, ctx = lowbit.layer_norm_forward(backend.to(x))
        dx = lowbit.layer_norm_backward(backend.to(dy), ctx)
        assert_close("y", layer_norm_ref(x), y, RTOL[np.float32])
        assert_close("dx", layer_norm_bwd_ref(dy, x), dx, RTOL[np.float32] * 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_unchanged_and_results_deterministic(backend, rng, dtype):
    x, dy = _inputs(rng, _shape(backend, (9, 37)), dtype)
    x_dev, dy_dev = backend.to(x), backend.to(dy)
    keep_x, keep_dy = to_numpy(x_dev).copy(), to_numpy(dy_dev).copy()
    y1, ctx1 = lowbit.layer_norm_forward(x_dev)
    dx1 = lowbit.layer_norm_backward(dy_dev, ctx1)
    y2, ctx2 = lowbit.layer_norm_forward(x_dev)
    dx2 = lowbit.layer_norm_backward(dy_dev, ctx2)
    dx3 = lowbit.layer_norm_backward(dy_dev, ctx1)
    assert_equal("x", keep_x, to_numpy(x_dev))
    assert_equal("dy", keep_dy, to_numpy(dy_dev))
    assert_equal("y", to_numpy(y1), to_numpy(y2))
    assert_equal("y (inference)", to_numpy(y1), to_numpy(lowbit.layer_norm(x_dev)))
    assert_equal("dx", to_numpy(dx1), to_numpy(dx2))
    assert_equal("dx (second backward on one ctx)", to_numpy(dx1), to_numpy(dx3))
    assert dx1 is not dy_dev and y1 is not x_dev


# -- the internal entry points of composite layers -------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_normalize_pair(backend, rng, dtype):
    x, dy = _inputs(rng, _shape(backend, (3, 5, 37)), dtype)
    y, mean, rstd = normalize(backend.to(x))
    dx = normalize_backward(backend.to(dy), y, rstd)
    assert mean.shape == rstd.shape == x.shape[:-1]
    assert mean.dtype == rstd.dtype == dtype
    assert_close("y", layer_norm_ref(x), y, RTOL[dtype])
    assert_close("mean", x.astype(np.float64).mean(-1), mean, RTOL[dtype])
    assert_close("dx", layer_norm_bwd_ref(dy, x), dx, RTOL[dtype] * 5)
    assert_equal("y (public)", to_numpy(y), to_numpy(lowbit.layer_norm(backend.to(x))))


# -- ctx and saved-activation policies -------------------------------------------------------------

def test_ctx_keeps_y_and_rstd(rng):
    x, _ = _inputs(rng, (4, 6, 37), np.float32)
    y, ctx = lowbit.layer_norm_forward(x)
    assert isinstance(ctx, lowbit.LayerNormCtx) and isinstance(ctx, lowbit._ctx.Ctx)
    assert ctx.y.unpack() is y and ctx.rstd.unpack().shape == (4, 6)
    assert ctx.nbytes == y.nbytes + 4 * 6 * 4
    names = {row.name for row in lowbit.memory_report(ctx).rows}
    assert names == {"LayerNormCtx.y", "LayerNormCtx.rstd"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.eps = 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("saved", ["fp32", "int8", lowbit.SavedConfig("int4", group_size=37)])
def test_saved_policies(backend, rng, dtype, saved):
    x, dy = _inputs(rng, _shape(backend, (6, 37)), dtype)
    y, ctx = lowbit.layer_norm_forward(backend.to(x), saved=saved)
    exact_y, exact_ctx = lowbit.layer_norm_forward(backend.to(x))
    assert_equal("y", to_numpy(exact_y), to_numpy(y))
    assert ctx.y.format == (saved if isinstance(saved, str) else saved.format)
    dx = lowbit.layer_norm_backward(backend.to(dy), ctx)
    assert dx.dtype == dtype
    assert ctx.nbytes < exact_ctx.nbytes or (saved == "fp32" and dtype == np.float32)
    rtol = {"fp32": RTOL[np.float32] * 5, "int8": 3e-2}.get(saved, 0.2)
    assert_close("dx", layer_norm_bwd_ref(dy, x), dx, rtol)


# -- validation: one rule per test, nothing runs before it -----------------------------------------

def _x():
    return np.ones((2, 3), np.float32) + np.arange(3, dtype=np.float32)


@pytest.mark.parametrize("fn", ["layer_norm", "layer_norm_forward"])
@pytest.mark.parametrize("x,error", [
    ([[1.0, 2.0]], TypeError),
    (np.ones((2, 3), np.int32), TypeError),
    (np.ones((2, 3), np.float16), TypeError),
    (np.float32(1.0), TypeError),
    (np.array(1.0, np.float32), ValueError),
    (np.ones((2, 0), np.float32), ValueError),
])
def test_rejects_bad_x(never_runs, fn, x, error):
    with pytest.raises(error, match="x"):
        getattr(lowbit, fn)(x)


@pytest.mark.parametrize("fn", ["layer_norm", "layer_norm_forward"])
@pytest.mark.parametrize("eps,error", [(0.0, ValueError), (-1e-5, ValueError),
                                       (math.nan, ValueError), (math.inf, ValueError),
                                       ("1e-5", TypeError), (True, TypeError), (None, TypeError)])
def test_rejects_bad_eps(never_runs, fn, eps, error):
    with pytest.raises(error, match="eps"):
        getattr(lowbit, fn)(_x(), eps=eps)


@pytest.mark.parametrize("saved,error", [("int3", ValueError), (8, TypeError)])
def test_rejects_bad_saved_first(never_runs, saved, error):
    with pytest.raises(error, match="saved"):
        lowbit.layer_norm_forward([[1.0]], eps=-1.0, saved=saved)


def _ctx(never_runs, dtype=np.float32):
    with never_runs.paused():
        return lowbit.layer_norm_forward(_x().astype(dtype))[1]


def test_backward_rejects_foreign_ctx(never_runs):
    with pytest.raises(TypeError, match="ctx"):
        lowbit.layer_norm_backward(_x(), object())


def test_backward_rejects_non_array_dy(never_runs):
    ctx = _ctx(never_runs)
    with pytest.raises(TypeError, match="dy"):
        lowbit.layer_norm_backward(_x().tolist(), ctx)


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_backward_rejects_dy_dtype(never_runs, dtype):
    ctx = _ctx(never_runs)
    with pytest.raises(TypeError, match="dy"):
        lowbit.layer_norm_backward(_x().astype(dtype), ctx)


def test_backward_rejects_float32_dy_for_a_float64_forward(never_runs):
    ctx = _ctx(never_runs, np.float64)
    with pytest.raises(TypeError, match="dy"):
        lowbit.layer_norm_backward(_x(), ctx)


@pytest.mark.parametrize("shape", [(2, 4), (3, 2), (6,), (1, 2, 3)])
def test_backward_rejects_dy_shape(never_runs, shape):
    ctx = _ctx(never_runs)
    with pytest.raises(ValueError, match="dy"):
        lowbit.layer_norm_backward(np.zeros(shape, np.float32), ctx)


@pytest.mark.gpu
def test_backward_rejects_dy_of_another_array_kind():
    cupy = pytest.importorskip("cupy")
    y, ctx = lowbit.layer_norm_forward(cupy.asarray(_x()))
    with pytest.raises(TypeError, match="dy"):
        lowbit.layer_norm_backward(_x(), ctx)


def test_exported():
    for name in ("layer_norm", "layer_norm_forward", "layer_norm_backward", "LayerNormCtx"):
        assert getattr(lowbit, name) is getattr(lowbit.ops.layer_norm, name)



@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_parallel_rows_equal_serial_rows(rng, monkeypatch, dtype):
    """The numba kernels' row groups (interleaved sums of ``ROWS`` rows, a short last group) give
    the same bits in parallel and in serial, and match the reference."""
    pytest.importorskip("numba")
    from lowbit.ops.layer_norm import _numba
    x, dy = _inputs(rng, (4 * _numba.ROWS + 3, 37), dtype)
    with lowbit.use_backend("numba"):
        y, ctx = lowbit.layer_norm_forward(x)
        dx = lowbit.layer_norm_backward(dy, ctx)
        monkeypatch.setattr(_numba, "PARALLEL_MIN", 0)
        y_par, ctx_par = lowbit.layer_norm_forward(x)
        dx_par = lowbit.layer_norm_backward(dy, ctx_par)
    assert_equal("y", y, y_par)
    assert_equal("dx", dx, dx_par)
    assert_close("y", layer_norm_ref(x), y, RTOL[dtype])
    assert_close("dx", layer_norm_bwd_ref(dy, x), dx, RTOL[dtype] * 5)
