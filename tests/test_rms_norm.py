"""Tests of the RMS norm op (``lowbit/ops/rms_norm``).

The float64 reference (``reference/rms_norm.py``) against central finite differences (dx and
dweight) and against the closed form; every backend against the reference, forward, inference
form and both gradients, over feature counts 1, 3, 37, 128, 300 (not multiples of the block
sizes, and several feature blocks of the weight-gradient kernels), one row, 3-d and 4-d inputs,
row counts past one weight-gradient chunk, float32 and float64; zero rows, an empty batch,
non-contiguous inputs; saved-activation policies; determinism, inputs left unchanged; one test
per validation rule.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import assert_close, assert_equal, numerical_grad, to_numpy

import lowbit
from lowbit.reference.rms_norm import rms_norm_bwd_ref, rms_norm_ref

DTYPES = [np.float32, np.float64]
#: Relative error allowed against the float64 reference, per dtype (forward; gradients x5).
RTOL = {np.float32: 2e-6, np.float64: 1e-13}
#: Largest row count under cudasim (one OS thread per CUDA thread: a few blocks only).
CUDASIM_ROWS = 150


def _shape(backend, shape):
    """``shape`` with its row count cut down for cudasim (features kept)."""
    if backend.name != "cudasim" or math.prod(shape[:-1]) <= CUDASIM_ROWS:
        return shape
    return (CUDASIM_ROWS, shape[-1])


def _inputs(rng, shape, dtype, scale=3.0):
    x = (rng.standard_normal(shape) * scale + 0.5).astype(dtype)
    weight = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    return x, weight, dy


def _run(backend, x, weight, dy, **options):
    """Forward, inference form and backward on ``backend``'s arrays, as host arrays."""
    y, ctx = lowbit.rms_norm_forward(backend.to(x), backend.to(weight), **options)
    options.pop("saved", None)
    y_inf = lowbit.rms_norm(backend.to(x), backend.to(weight), **options)
    dx, dweight = lowbit.rms_norm_backward(backend.to(dy), ctx)
    for name, out in (("y", y), ("y (inference)", y_inf), ("dx", dx), ("dweight", dweight)):
        assert out.dtype == x.dtype, f"{name}: dtype {out.dtype}"
        assert type(out) is type(backend.to(x)), f"{name}: {type(out)}"
    return ctx, *(to_numpy(a) for a in (y, y_inf, dx, dweight))


# -- the reference ---------------------------------------------------------------------------------

# One feature with a tiny eps: dx ~ eps / x**2 is all rounding, so D = 1 is checked at eps 0.1.
@pytest.mark.parametrize("shape,eps", [((3,), 1e-6), ((2, 7), 1e-6), ((2, 3, 5), 1e-6),
                                       ((1,), 0.1), ((4, 1), 0.1), ((2, 7), 0.1)])
def test_reference_backward_matches_finite_differences(rng, shape, eps):
    x = rng.standard_normal(shape)
    weight = rng.standard_normal(shape[-1])
    probe = rng.standard_normal(shape)

    def loss():
        return float((rms_norm_ref(x, weight, eps) * probe).sum())

    dx, dweight = rms_norm_bwd_ref(probe, x, weight, eps)
    assert dx.shape == x.shape and dweight.shape == weight.shape
    assert_close("dx", numerical_grad(loss, x), dx, rtol=1e-6, atol=1e-8)
    assert_close("dweight", numerical_grad(loss, weight), dweight, rtol=1e-6, atol=1e-8)


def test_reference_backward_at_a_zero_row_matches_finite_differences(rng):
    x = rng.standard_normal((3, 4))
    x[1] = 0.0
    weight, probe = rng.standard_normal(4), rng.standard_normal((3, 4))

    def loss():
        return float((rms_norm_ref(x, weight, 0.1) * probe).sum())

    dx, dweight = rms_norm_bwd_ref(probe, x, weight, 0.1)
    assert_close("dx", numerical_grad(loss, x), dx, rtol=1e-6, atol=1e-8)
    assert_close("dweight", numerical_grad(loss, weight), dweight, rtol=1e-6, atol=1e-8)


def test_reference_is_the_closed_form(rng):
    """``weight * x / sqrt(mean(x**2) + eps)``; with unit weight every row has RMS ~1."""
    x = rng.standard_normal((4, 37)) * 5 + 2
    weight = rng.standard_normal(37)
    want = weight * x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm_ref(x, weight), want, rtol=1e-13)
    y = rms_norm_ref(x, np.ones(37), 1e-12)
    np.testing.assert_allclose(np.sqrt((y**2).mean(-1)), 1, rtol=1e-9)


# -- every backend against the reference -----------------------------------------------------------

SHAPES = [(1, 1), (5, 1), (1, 3), (37,), (1, 37), (4, 37), (2, 3, 37), (1, 128), (7, 128),
          (2, 300), (150, 3), (3, 50, 37), (2, 2, 3, 5), (300, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_match_reference(backend, rng, shape, dtype):
    x, weight, dy = _inputs(rng, _shape(backend, shape), dtype)
    # With one feature dx = weight * dy * eps / (x**2 + eps)**1.5: a difference of nearly equal
    # terms for a tiny eps (ill-conditioned in any precision), so D = 1 runs at a large eps.
    eps = 4.0 if shape[-1] == 1 else 1e-6
    ctx, y, y_inf, dx, dweight = _run(backend, x, weight, dy, eps=eps)
    ref_dx, ref_dweight = rms_norm_bwd_ref(dy, x, weight, eps)
    assert_close("y", rms_norm_ref(x, weight, eps), y, RTOL[dtype])
    assert_equal("y (inference)", y, y_inf)
    assert_close("dx", ref_dx, dx, RTOL[dtype] * 5)
    assert_close("dweight", ref_dweight, dweight, RTOL[dtype] * 5)
    rstd = np.asarray(1 / np.sqrt((x.astype(np.float64) ** 2).mean(axis=-1) + eps))
    assert_close("rstd", rstd, ctx.rstd.unpack(), RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-3, 2.5])
def test_eps_is_added_to_the_mean_square(backend, rng, dtype, eps):
    x, weight, dy = _inputs(rng, _shape(backend, (6, 37)), dtype, scale=0.05)
    ctx, y, y_inf, dx, dweight = _run(backend, x, weight, dy, eps=eps)
    assert ctx.eps == eps
    ref_dx, ref_dweight = rms_norm_bwd_ref(dy, x, weight, eps)
    assert_close("y", rms_norm_ref(x, weight, eps), y, RTOL[dtype])
    assert_close("y (inference)", rms_norm_ref(x, weight, eps), y_inf, RTOL[dtype])
    assert_close("dx", ref_dx, dx, RTOL[dtype] * 5)
    assert_close("dweight", ref_dweight, dweight, RTOL[dtype] * 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [2, 37, 300])
def test_zero_rows(backend, rng, dtype, D):
    """All-zero rows (even rows; odd rows ordinary): y = 0, dx = weight * dy / sqrt(eps), and
    they add nothing to dweight."""
    x, weight, dy = _inputs(rng, (8, D), dtype)
    x[0::2] = 0
    ctx, y, _, dx, dweight = _run(backend, x, weight, dy)
    assert not y[0::2].any()
    want = (weight.astype(np.float64) * dy[0::2] / np.sqrt(1e-6))
    assert_close("dx (zero rows)", want, dx[0::2], RTOL[dtype] * 5)
    ref_dx, ref_dweight = rms_norm_bwd_ref(dy, x, weight)
    assert_close("dx", ref_dx, dx, RTOL[dtype] * 5)
    assert_close("dweight", ref_dweight, dweight, RTOL[dtype] * 5)
    assert_close("dweight (odd rows only)", rms_norm_bwd_ref(dy[1::2], x[1::2], weight)[1],
                 dweight, RTOL[dtype] * 5)


def test_empty_batch(backend):
    for dtype in DTYPES:
        x = backend.to(np.zeros((0, 5), dtype))
        weight = backend.to(np.ones(5, dtype))
        y, ctx = lowbit.rms_norm_forward(x, weight)
        dx, dweight = lowbit.rms_norm_backward(x, ctx)
        assert y.shape == dx.shape == (0, 5) and y.dtype == dx.dtype == dtype
        assert_equal("dweight", np.zeros(5, dtype), dweight)


def test_non_contiguous_inputs(backend, rng):
    """Strided views and Fortran order: the op makes them contiguous itself."""
    base, wbase, dbase = _inputs(rng, (2 * 37, 2 * 37), np.float32)
    views = [(base[::2, ::2], wbase[::2], dbase[::2, ::2]),
             (np.asfortranarray(base[:9]), wbase[::-1], dbase[:9, ::-1])]
    for x, weight, dy in views:
        _, y, _, dx, dweight = _run(backend, x, weight, dy)
        ref_dx, ref_dweight = rms_norm_bwd_ref(dy, x, weight)
        assert_close("y", rms_norm_ref(x, weight), y, RTOL[np.float32])
        assert_close("dx", ref_dx, dx, RTOL[np.float32] * 5)
        assert_close("dweight", ref_dweight, dweight, RTOL[np.float32] * 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_unchanged_and_results_deterministic(backend, rng, dtype):
    x, weight, dy = _inputs(rng, _shape(backend, (130, 37)), dtype)
    args = [backend.to(a) for a in (x, weight, dy)]
    keep = [to_numpy(a).copy() for a in args]
    y1, ctx1 = lowbit.rms_norm_forward(args[0], args[1])
    g1 = lowbit.rms_norm_backward(args[2], ctx1)
    y2, ctx2 = lowbit.rms_norm_forward(args[0], args[1])
    g2 = lowbit.rms_norm_backward(args[2], ctx2)
    g3 = lowbit.rms_norm_backward(args[2], ctx1)
    for name, want, a in zip(("x", "weight", "dy"), keep, args):
        assert_equal(name, want, to_numpy(a))
    assert_equal("y", to_numpy(y1), to_numpy(y2))
    for name, a, b, c in zip(("dx", "dweight"), g1, g2, g3):
        assert_equal(name, to_numpy(a), to_numpy(b))
        assert_equal(f"{name} (second backward on one ctx)", to_numpy(a), to_numpy(c))
    assert y1 is not args[0] and g1[0] is not args[2]


def test_cuda_weight_gradient_with_longer_chunks(rng, monkeypatch):
    """More rows than ``MAX_CHUNKS * CHUNK_ROWS``: the launcher lengthens the chunks (here to
    75 rows, the last one short)."""
    if "cudasim" not in lowbit.available_backends():
        pytest.skip("cudasim unavailable")
    from lowbit.ops.rms_norm import _cuda
    monkeypatch.setattr(_cuda, "MAX_CHUNKS", 2)
    x, weight, dy = _inputs(rng, (150, 37), np.float64)
    with lowbit.use_backend("cudasim"):
        _, ctx = lowbit.rms_norm_forward(x, weight)
        dx, dweight = lowbit.rms_norm_backward(dy, ctx)
    ref_dx, ref_dweight = rms_norm_bwd_ref(dy, x, weight)
    assert_close("dx", ref_dx, dx, RTOL[np.float64] * 5)
    assert_close("dweight", ref_dweight, dweight, RTOL[np.float64] * 5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_parallel_equals_serial(rng, monkeypatch, dtype):
    """The numba chunks (several, the last one short) give the same bits in parallel and in
    serial, and match the reference."""
    if "numba" not in lowbit.available_backends():
        pytest.skip("numba unavailable")
    from lowbit.ops.rms_norm import _numba
    x, weight, dy = _inputs(rng, (3 * _numba.CHUNK + 5, 37), dtype)
    with lowbit.use_backend("numba"):
        y, ctx = lowbit.rms_norm_forward(x, weight)
        dx, dweight = lowbit.rms_norm_backward(dy, ctx)
        monkeypatch.setattr(_numba, "PARALLEL_MIN", 0)
        y_par, ctx_par = lowbit.rms_norm_forward(x, weight)
        dx_par, dweight_par = lowbit.rms_norm_backward(dy, ctx_par)
    assert_equal("y", y, y_par)
    assert_equal("dx", dx, dx_par)
    assert_equal("dweight", dweight, dweight_par)
    ref_dx, ref_dweight = rms_norm_bwd_ref(dy, x, weight)
    assert_close("dx", ref_dx, dx, RTOL[dtype] * 5)
    assert_close("dweight", ref_dweight, dweight, RTOL[dtype] * 5)


# -- ctx and saved-activation policies -------------------------------------------------------------

def test_ctx_keeps_x_rstd_and_weight(rng):
    x, weight, _ = _inputs(rng, (4, 6, 37), np.float32)
    y, ctx = lowbit.rms_norm_forward(x, weight)
    assert isinstance(ctx, lowbit.RMSNormCtx) and isinstance(ctx, lowbit._ctx.Ctx)
    assert ctx.x.unpack() is x and ctx.weight is weight and ctx.rstd.unpack().shape == (4, 6)
    assert ctx.nbytes == x.nbytes + 4 * 6 * 4  # the weight is a parameter: not counted
    names = {row.name for row in lowbit.memory_report(ctx).rows}
    assert names == {"RMSNormCtx.x", "RMSNormCtx.rstd"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.eps = 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("saved", ["fp32", "int8", lowbit.SavedConfig("int4", group_size=37)])
def test_saved_policies(backend, rng, dtype, saved):
    x, weight, dy = _inputs(rng, _shape(backend, (6, 37)), dtype)
    y, ctx = lowbit.rms_norm_forward(backend.to(x), backend.to(weight), saved=saved)
    exact_y, exact_ctx = lowbit.rms_norm_forward(backend.to(x), backend.to(weight))
    assert_equal("y", to_numpy(exact_y), to_numpy(y))
    assert ctx.x.format == (saved if isinstance(saved, str) else saved.format)
    dx, dweight = lowbit.rms_norm_backward(backend.to(dy), ctx)
    assert dx.dtype == dweight.dtype == dtype
    assert ctx.nbytes < exact_ctx.nbytes or (saved == "fp32" and dtype == np.float32)
    rtol = {"fp32": RTOL[np.float32] * 5, "int8": 3e-2}.get(saved, 0.2)
    ref_dx, ref_dweight = rms_norm_bwd_ref(dy, x, weight)
    assert_close("dx", ref_dx, dx, rtol)
    assert_close("dweight", ref_dweight, dweight, rtol)


# -- validation: one rule per test, nothing runs before it -----------------------------------------

def _x(dtype=np.float32):
    return (np.ones((2, 3)) + np.arange(3)).astype(dtype)


def _w(dtype=np.float32):
    return np.array([1.0, 0.5, 2.0], dtype)


FORWARDS = ["rms_norm", "rms_norm_forward"]


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("x,error", [
    ([[1.0, 2.0, 3.0]], TypeError),
    (np.ones((2, 3), np.int32), TypeError),
    (np.ones((2, 3), np.float16), TypeError),
    (np.float32(1.0), TypeError),
    (np.array(1.0, np.float32), ValueError),
    (np.ones((2, 0), np.float32), ValueError),
])
def test_rejects_bad_x(never_runs, fn, x, error):
    with pytest.raises(error, match="^x "):
        getattr(lowbit, fn)(x, _w())


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("weight,error", [
    ([1.0, 0.5, 2.0], TypeError),
    (np.ones(3, np.float64), TypeError),
    (np.ones(3, np.int32), TypeError),
    (np.ones(4, np.float32), ValueError),
    (np.ones(2, np.float32), ValueError),
    (np.ones((1, 3), np.float32), ValueError),
    (np.array(1.0, np.float32), ValueError),
])
def test_rejects_bad_weight(never_runs, fn, weight, error):
    with pytest.raises(error, match="^weight "):
        getattr(lowbit, fn)(_x(), weight)


@pytest.mark.parametrize("fn", FORWARDS)
def test_rejects_a_float32_weight_for_float64_x(never_runs, fn):
    with pytest.raises(TypeError, match="^weight must have x's dtype float64"):
        getattr(lowbit, fn)(_x(np.float64), _w())


@pytest.mark.parametrize("fn", FORWARDS)
@pytest.mark.parametrize("eps,error", [(0.0, ValueError), (-1e-6, ValueError),
                                       (math.nan, ValueError), (math.inf, ValueError),
                                       ("1e-6", TypeError), (True, TypeError), (None, TypeError)])
def test_rejects_bad_eps(never_runs, fn, eps, error):
    with pytest.raises(error, match="^eps "):
        getattr(lowbit, fn)(_x(), _w(), eps=eps)


@pytest.mark.parametrize("saved,error", [("int3", ValueError), (8, TypeError)])
def test_rejects_bad_saved_first(never_runs, saved, error):
    with pytest.raises(error, match="saved"):
        lowbit.rms_norm_forward([[1.0]], None, eps=-1.0, saved=saved)


def _ctx(never_runs, dtype=np.float32):
    with never_runs.paused():
        return lowbit.rms_norm_forward(_x(dtype), _w(dtype))[1]


def test_backward_rejects_foreign_ctx(never_runs):
    with pytest.raises(TypeError, match="^ctx "):
        lowbit.rms_norm_backward(_x(), object())
    with never_runs.paused():
        other = lowbit.layer_norm_forward(_x())[1]  # another op's ctx is refused too
    with pytest.raises(TypeError, match="^ctx must be an RMSNormCtx, got LayerNormCtx"):
        lowbit.rms_norm_backward(_x(), other)


def test_backward_rejects_non_array_dy(never_runs):
    ctx = _ctx(never_runs)
    with pytest.raises(TypeError, match="^dy "):
        lowbit.rms_norm_backward(_x().tolist(), ctx)


@pytest.mark.parametrize("forward,dy", [(np.float32, np.float64), (np.float32, np.int32),
                                        (np.float64, np.float32)])
def test_backward_rejects_dy_dtype(never_runs, forward, dy):
    ctx = _ctx(never_runs, forward)
    with pytest.raises(TypeError, match="^dy must have the forward output's dtype"):
        lowbit.rms_norm_backward(_x(dy), ctx)


@pytest.mark.parametrize("shape", [(2, 4), (3, 3), (6,), (1, 2, 3)])
def test_backward_rejects_dy_shape(never_runs, shape):
    ctx = _ctx(never_runs)
    with pytest.raises(ValueError, match="^dy must have the forward output's shape"):
        lowbit.rms_norm_backward(np.zeros(shape, np.float32), ctx)


@pytest.mark.gpu
def test_rejects_arrays_of_two_kinds():
    cupy = pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="^weight must be a cupy array"):
        lowbit.rms_norm(cupy.asarray(_x()), _w())
    with pytest.raises(TypeError, match="^weight must be a numpy array"):
        lowbit.rms_norm(_x(), cupy.asarray(_w()))
    _, ctx = lowbit.rms_norm_forward(cupy.asarray(_x()), cupy.asarray(_w()))
    with pytest.raises(TypeError, match="^dy must be a cupy array"):
        lowbit.rms_norm_backward(_x(), ctx)


def test_exported():
    for name in ("rms_norm", "rms_norm_forward", "rms_norm_backward", "RMSNormCtx"):
        assert getattr(lowbit, name) is getattr(lowbit.ops.rms_norm, name)
        assert name in lowbit.__all__
