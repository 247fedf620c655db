"""Tests of the rotary position embedding op (``lowbit/ops/rotary``).

The float64 reference (``reference/rotary.py``) against central finite differences and against
the complex-number form of the rotation (half style: ``x[:D/2] + i x[D/2:]`` times
``exp(i angle)``; interleaved: ``x[0::2] + i x[1::2]``), its angles against values known in
closed form; every backend (numpy, numba, cudasim) against the reference, forward, inference
form and backward, float32 and float64, both styles, rank 3 and rank 2, arbitrary and large
positions (where float32 angles would fail, which is checked too), a decode step against the
same row of a full sequence, shapes that walk the CUDA kernel's (head, pair) stepping and its
grid-stride loop; the tables the BDH layer shares and the host table cache; ctx, determinism,
inputs left unchanged; one test per validation rule.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import assert_close, assert_equal, numerical_grad, to_numpy

import lowbit
from lowbit.ops.rotary import MAX_POSITION, rotary_tables
from lowbit.reference.rotary import rotary_angles_ref, rotary_bwd_ref, rotary_ref

DTYPES = [np.float32, np.float64]
STYLES = ["half", "interleaved"]
#: Relative error allowed against the float64 reference at positions below a few thousand:
#: float32 is two rounded products and a rounded sum per output; float64 the same at 1e-16.
RTOL = {np.float32: 1e-6, np.float64: 1e-13}
#: At large positions the implementation's float64 angle (one rounded power, one rounded
#: product) is off by at most about 4e-16 rad per unit of position (measured 2e-16 at 1e6),
#: which adds this much error per unit of the largest position, whatever x's dtype.
ANGLE_RTOL_PER_POSITION = 4e-16
POSITIONS = np.array([5, 0, 1023, 7])
LARGE = np.array([100000, 123457, 99999, 1000003])


def _rtol(dtype, positions):
    return RTOL[dtype] + ANGLE_RTOL_PER_POSITION * float(np.max(positions, initial=0))


def _inputs(rng, shape, dtype):
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


# -- the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("shape", [(4, 2, 6), (4, 4)])
def test_reference_backward_matches_finite_differences(rng, style, shape):
    x = rng.standard_normal(shape)
    weights = rng.standard_normal(shape)

    def loss():
        return float((rotary_ref(x, POSITIONS, 100.0, style) * weights).sum())

    assert_close("dx", numerical_grad(loss, x), rotary_bwd_ref(weights, POSITIONS, 100.0, style),
                 rtol=1e-8, atol=1e-9)


def _complex_form(x, positions, theta, style):
    """The rotation as a complex product, from numpy's float64 angles."""
    D = x.shape[-1]
    angle = positions[:, None] * theta ** (-np.arange(0, D, 2) / D)
    turn = np.exp(1j * angle)[:, None, :]
    if style == "half":
        z = (x[..., :D // 2] + 1j * x[..., D // 2:]) * turn
        return np.concatenate([z.real, z.imag], axis=-1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("theta", [10000.0, 500000.0, 3.5])
def test_reference_matches_the_complex_form(rng, style, theta):
    x = rng.standard_normal((4, 3, 16))
    positions = np.array([3, 0, 700, 41])
    want = _complex_form(x, positions, theta, style)
    assert_close("y", want, rotary_ref(x, positions, theta, style), 1e-13)
    assert_close("dx (the inverse)", _complex_form(x, -positions, theta, style),
                 rotary_bwd_ref(x, positions, theta, style), 1e-13)
    assert_close("y then its inverse", x, rotary_bwd_ref(want, positions, theta, style), 1e-13)


def test_reference_angles_in_closed_form():
    """theta = 10**4, D = 8: frequencies 1, 0.1, 0.01, 0.001 (so the angles are p / 10**j, and
    correctly rounded ones must match Python's correctly rounded division exactly)."""
    positions = [0, 1, 7, 100003, 2**40 + 1]
    angles = rotary_angles_ref(positions, 8, 10000.0)
    for t, p in enumerate(positions):
        assert [float(a) for a in angles[t]] == [p / 10**j for j in range(4)]


def test_reference_pairs_by_style():
    """Position 1, D = 4, theta = 1: every angle is 1 rad; the pairs are (0, 2) and (1, 3) for
    the half style, (0, 1) and (2, 3) interleaved."""
    c, s = math.cos(1.0), math.sin(1.0)
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    half = rotary_ref(x, [1], 1.0, "half")[0]
    np.testing.assert_allclose(half, [c - 3 * s, 2 * c - 4 * s, 3 * c + s, 4 * c + 2 * s])
    inter = rotary_ref(x, [1], 1.0, "interleaved")[0]
    np.testing.assert_allclose(inter, [c - 2 * s, 2 * c + s, 3 * c - 4 * s, 4 * c + 3 * s])


# -- every backend against the reference -----------------------------------------------------------

#: (x shape, positions): D/2 odd and even, one pair, H * D/2 past the kernel's 128 threads (its
#: (head, pair) stepping), D/2 past them, rank 2.
CASES = [((4, 3, 64), POSITIONS), ((4, 1, 2), POSITIONS), ((3, 5, 10), np.array([2, 9, 4])),
         ((2, 200, 2), np.array([1, 3])), ((3, 2, 258), np.array([0, 11, 5])),
         ((4, 8), POSITIONS), ((1, 4, 16), np.array([57]))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("shape,positions", CASES)
def test_forward_and_gradient_match_reference(backend, rng, shape, positions, style, dtype):
    x, dy = _inputs(rng, shape, dtype)
    pos = backend.to(positions)
    y, ctx = lowbit.rotary_forward(backend.to(x), pos, style=style)
    dx = lowbit.rotary_backward(backend.to(dy), ctx)
    inference = lowbit.rotary(backend.to(x), pos, style=style)
    assert y.dtype == dx.dtype == inference.dtype == dtype
    assert type(y) is type(backend.to(x)) and type(dx) is type(y)
    assert_close("y", rotary_ref(x, positions, style=style), y, RTOL[dtype])
    assert_equal("y (inference)", to_numpy(y), to_numpy(inference))
    assert_close("dx", rotary_bwd_ref(dy, positions, style=style), dx, RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_large_positions(backend, rng, dtype, style, theta):
    x, dy = _inputs(rng, (4, 2, 128), dtype)
    y, ctx = lowbit.rotary_forward(backend.to(x), backend.to(LARGE), theta=theta, style=style)
    dx = lowbit.rotary_backward(backend.to(dy), ctx)
    rtol = _rtol(dtype, LARGE)
    assert_close("y", rotary_ref(x, LARGE, theta, style), y, rtol)
    assert_close("dx", rotary_bwd_ref(dy, LARGE, theta, style), dx, rtol)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_float32_angles_would_fail_the_large_position_tolerance(rng, theta):
    """What the large-position test guards against: angles formed in float32."""
    x = rng.standard_normal((4, 1, 128)).astype(np.float32)
    inv = np.float32(theta) ** (-np.arange(0, 128, 2, dtype=np.float32) / np.float32(128))
    angle = LARGE.astype(np.float32)[:, None] * inv[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., :64], x[..., 64:]
    y = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    with pytest.raises(AssertionError, match="relative RMS error"):
        assert_close("y (float32 angles)", rotary_ref(x, LARGE, theta), y,
                     100 * _rtol(np.float32, LARGE))


@pytest.mark.parametrize("style", STYLES)
def test_decode_step_equals_its_row_of_the_sequence(backend, rng, style):
    """A KV-cache step at position 57 gives the bits of row 57 of the sequence's tokens 50 ..
    59."""
    x = rng.standard_normal((10, 2, 16)).astype(np.float32)
    chunk = lowbit.rotary(backend.to(x), np.arange(50, 60), style=style)
    step = lowbit.rotary(backend.to(x[7:8]), np.array([57]), style=style)
    assert_equal("y[57]", to_numpy(chunk)[7:8], to_numpy(step))


def test_backends_agree_bitwise(rng):
    """One set of tables and the same arithmetic: numpy, numba and cudasim give the same bits."""
    x, dy = _inputs(rng, (4, 3, 64), np.float32)
    got = []
    for name in ("numpy", "numba", "cudasim"):
        if name not in lowbit.available_backends():
            continue
        with lowbit.use_backend(name):
            y, ctx = lowbit.rotary_forward(x, LARGE, style="interleaved")
            got.append((name, y, lowbit.rotary_backward(dy, ctx)))
    for name, y, dx in got[1:]:
        assert_equal(f"y ({name})", got[0][1], y)
        assert_equal(f"dx ({name})", got[0][2], dx)


def test_grid_stride_over_tokens(rng, monkeypatch):
    """More tokens than blocks: the CUDA kernel's token loop (cudasim, 2 blocks)."""
    if "cudasim" not in lowbit.available_backends():
        pytest.skip("cudasim unavailable")
    from lowbit.ops.rotary import _cuda
    monkeypatch.setattr(_cuda, "MAX_BLOCKS", 2)
    x, dy = _inputs(rng, (5, 3, 6), np.float64)
    positions = np.array([4, 1, 0, 8, 2])
    with lowbit.use_backend("cudasim"):
        y, ctx = lowbit.rotary_forward(x, positions)
        dx = lowbit.rotary_backward(dy, ctx)
    assert_close("y", rotary_ref(x, positions), y, RTOL[np.float64])
    assert_close("dx", rotary_bwd_ref(dy, positions), dx, RTOL[np.float64])


def test_empty_tokens(backend):
    for dtype in DTYPES:
        x = backend.to(np.zeros((0, 2, 4), dtype))
        y, ctx = lowbit.rotary_forward(x, np.zeros(0, np.int64))
        dx = lowbit.rotary_backward(x, ctx)
        assert y.shape == dx.shape == (0, 2, 4) and y.dtype == dx.dtype == dtype


def test_non_contiguous_inputs_and_position_dtypes(backend, rng):
    """Strided and Fortran-ordered x, unsigned and narrow positions: made contiguous int64."""
    base, dbase = _inputs(rng, (8, 4, 32), np.float32)
    positions = np.array([9, 2, 250, 0], np.uint8)
    for x, dy in [(base[::2, 1:3, ::2], dbase[::2, :2, ::2]),
                  (np.asfortranarray(base[:4, 0]), dbase[:4, 0, ::-1])]:
        y, ctx = lowbit.rotary_forward(backend.to(x), backend.to(positions))
        dx = lowbit.rotary_backward(backend.to(dy), ctx)
        assert_close("y", rotary_ref(x, positions), y, RTOL[np.float32])
        assert_close("dx", rotary_bwd_ref(dy, positions), dx, RTOL[np.float32])
    y = lowbit.rotary(backend.to(base[:4]), [9, 2, 250, 0])
    assert_close("y (list positions)", rotary_ref(base[:4], positions), y, RTOL[np.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_unchanged_and_results_deterministic(backend, rng, dtype):
    x, dy = _inputs(rng, (4, 3, 16), dtype)
    x_dev, dy_dev, pos = backend.to(x), backend.to(dy), backend.to(POSITIONS.copy())
    y1, ctx1 = lowbit.rotary_forward(x_dev, pos)
    dx1 = lowbit.rotary_backward(dy_dev, ctx1)
    y2, ctx2 = lowbit.rotary_forward(x_dev, pos)
    dx2 = lowbit.rotary_backward(dy_dev, ctx2)
    assert_equal("x", x, to_numpy(x_dev))
    assert_equal("dy", dy, to_numpy(dy_dev))
    assert_equal("positions", POSITIONS, to_numpy(pos))
    assert_equal("y", to_numpy(y1), to_numpy(y2))
    assert_equal("dx", to_numpy(dx1), to_numpy(dx2))
    assert_equal("dx (second backward on one ctx)", to_numpy(dx1),
                 to_numpy(lowbit.rotary_backward(dy_dev, ctx1)))
    assert y1 is not x_dev and dx1 is not dy_dev


# -- the tables, shared with the BDH layer ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_tables_are_rounded_float64_angles(dtype):
    cos, sin = rotary_tables(LARGE, 64, 10000.0, dtype)
    angles = rotary_angles_ref(LARGE, 64, 10000.0)
    assert cos.shape == sin.shape == (4, 32) and cos.dtype == sin.dtype == dtype
    assert_close("cos", np.cos(angles), cos, _rtol(dtype, LARGE) / 4)
    assert_close("sin", np.sin(angles), sin, _rtol(dtype, LARGE) / 4)


def test_host_tables_are_cached_read_only_and_cleared():
    from lowbit.ops.rotary import _host_tables, _tables

    lowbit.clear_caches()
    first = _tables(POSITIONS, 16, 10000.0, np.float32)
    assert _tables(POSITIONS.copy(), 16, 10000.0, np.float32) is first
    assert _tables(POSITIONS, 16, 10000.0, np.float64) is not first
    assert not first[0].flags.writeable and not first[1].flags.writeable
    assert _host_tables.cache_info().currsize == 2
    lowbit.clear_caches()
    assert _host_tables.cache_info().currsize == 0


def test_bdh_rotation_is_the_interleaved_style():
    """BDH's rope (reference/lowrank_residual.py: pairs (2j, 2j + 1), angle t * 2**16 ** (-2j /
    N)) is this op's interleaved style at positions 0 .. T - 1, and its layer's tables are this
    op's tables."""
    from lowbit.ops.lowrank_residual._layer import ROPE_THETA, rope_tables
    from lowbit.reference.lowrank_residual import rope_ref

    u = np.random.default_rng(3).standard_normal((9, 12))
    T, N = u.shape
    assert_close("rope", rope_ref(u), rotary_ref(u, np.arange(T), ROPE_THETA, "interleaved"),
                 1e-14)
    assert_close("rope inverse", rope_ref(u, inverse=True),
                 rotary_bwd_ref(u, np.arange(T), ROPE_THETA, "interleaved"), 1e-14)
    for got, want in zip(rope_tables(T, N, np), rotary_tables(np.arange(T), N, ROPE_THETA,
                                                              np.float32)):
        assert_equal("table", want, got)


# -- ctx -------------------------------------------------------------------------------------------

def test_ctx_keeps_positions_and_settings_only(rng):
    x = rng.standard_normal((4, 3, 8)).astype(np.float32)
    _, ctx = lowbit.rotary_forward(x, POSITIONS.astype(np.int32), theta=500.0,
                                   style="interleaved")
    assert isinstance(ctx, lowbit.RotaryCtx) and isinstance(ctx, lowbit._ctx.Ctx)
    assert (ctx.theta, ctx.style, ctx.shape, ctx.dtype) == (500.0, "interleaved", (4, 3, 8),
                                                            np.float32)
    assert_equal("positions", POSITIONS.astype(np.int64), ctx.positions.unpack())
    assert ctx.nbytes == 4 * 8
    assert {row.name for row in lowbit.memory_report(ctx).rows} == {"RotaryCtx.positions"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.theta = 1.0


# -- validation: one rule per test, nothing runs before it -----------------------------------------

def _x(shape=(2, 3, 4)):
    return np.ones(shape, np.float32)


@pytest.mark.parametrize("fn", ["rotary", "rotary_forward"])
@pytest.mark.parametrize("x,error", [
    ([[1.0, 2.0]], TypeError),
    (np.ones((2, 3, 4), np.int32), TypeError),
    (np.ones((2, 3, 4), np.float16), TypeError),
    (np.ones(4, np.float32), ValueError),
    (np.ones((2, 1, 3, 4), np.float32), ValueError),
    (np.ones((2, 3, 5), np.float32), ValueError),
    (np.ones((2, 3, 0), np.float32), ValueError),
])
def test_rejects_bad_x(never_runs, fn, x, error):
    with pytest.raises(error, match="^x must"):
        getattr(lowbit, fn)(x, np.arange(2))


@pytest.mark.parametrize("fn", ["rotary", "rotary_forward"])
@pytest.mark.parametrize("positions,error", [
    (np.array([0.0, 1.0]), TypeError),
    (np.array([True, False]), TypeError),
    ([0, True], TypeError),
    ([0, 1.5], TypeError),
    (3, TypeError),
    ("01", TypeError),
    (np.zeros((2, 1), np.int64), ValueError),
    (np.array(1), ValueError),
    (np.arange(3), ValueError),
    ([1], ValueError),
    (np.array([4, -1]), ValueError),
    (np.array([0, MAX_POSITION + 1], np.uint64), ValueError),
    ([0, 2**70], ValueError),
    ([-1, 0], ValueError),
])
def test_rejects_bad_positions(never_runs, fn, positions, error):
    with pytest.raises(error, match="^positions must"):
        getattr(lowbit, fn)(_x(), positions)


@pytest.mark.parametrize("fn", ["rotary", "rotary_forward"])
@pytest.mark.parametrize("theta,error", [(0.0, ValueError), (-10.0, ValueError),
                                         (math.nan, ValueError), (math.inf, ValueError),
                                         ("1e4", TypeError), (True, TypeError), (None, TypeError)])
def test_rejects_bad_theta(never_runs, fn, theta, error):
    with pytest.raises(error, match="^theta must"):
        getattr(lowbit, fn)(_x(), np.arange(2), theta=theta)


@pytest.mark.parametrize("fn", ["rotary", "rotary_forward"])
@pytest.mark.parametrize("style,error", [("rotate_half", ValueError), ("HALF", ValueError),
                                         (1, TypeError), (None, TypeError)])
def test_rejects_bad_style(never_runs, fn, style, error):
    with pytest.raises(error, match="^style must"):
        getattr(lowbit, fn)(_x(), np.arange(2), style=style)


def test_positional_options_are_refused():
    with pytest.raises(TypeError):
        lowbit.rotary(_x(), np.arange(2), 10000.0)  # type: ignore[misc]


def _ctx(never_runs, dtype=np.float32):
    with never_runs.paused():
        return lowbit.rotary_forward(_x().astype(dtype), np.arange(2))[1]


def test_backward_rejects_foreign_ctx(never_runs):
    with pytest.raises(TypeError, match="^ctx must"):
        lowbit.rotary_backward(_x(), object())


def test_backward_rejects_non_array_dy(never_runs):
    ctx = _ctx(never_runs)
    with pytest.raises(TypeError, match="^dy must"):
        lowbit.rotary_backward(_x().tolist(), ctx)


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_backward_rejects_dy_dtype(never_runs, dtype):
    ctx = _ctx(never_runs)
    with pytest.raises(TypeError, match="^dy must"):
        lowbit.rotary_backward(_x().astype(dtype), ctx)


@pytest.mark.parametrize("shape", [(2, 3, 2), (3, 3, 4), (2, 12), (6, 4)])
def test_backward_rejects_dy_shape(never_runs, shape):
    ctx = _ctx(never_runs)
    with pytest.raises(ValueError, match="^dy must"):
        lowbit.rotary_backward(np.zeros(shape, np.float32), ctx)


@pytest.mark.gpu
def test_array_kinds():
    """Device x takes host or device positions (host ones are uploaded); a device positions
    array for a host x, and a host dy for a device forward, are refused."""
    cupy = pytest.importorskip("cupy")
    x = np.random.default_rng(0).standard_normal((4, 3, 8)).astype(np.float32)
    ref = rotary_ref(x, POSITIONS)
    for positions in (POSITIONS, cupy.asarray(POSITIONS)):
        y, ctx = lowbit.rotary_forward(cupy.asarray(x), positions)
        assert_close("y", ref, y, RTOL[np.float32])
    with pytest.raises(TypeError, match="^positions must"):
        lowbit.rotary(x, cupy.asarray(POSITIONS))
    with pytest.raises(TypeError, match="^dy must"):
        lowbit.rotary_backward(x, ctx)


def test_exported():
    for name in ("rotary", "rotary_forward", "rotary_backward", "RotaryCtx"):
        assert getattr(lowbit, name) is getattr(lowbit.ops.rotary, name)
        assert name in lowbit.__all__
