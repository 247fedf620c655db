"""Tests of ``lowbit/ops/quantize`` (weight and activation formats) on every backend.

Reference: ``reference/quantize.py``; kernels: ``cuda/quantize.cu``. Codes and scales must equal
the reference exactly, ties at .5 and zeros included.
"""

import warnings

import numpy as np
import pytest
from helpers import assert_close, assert_equal, to_numpy

import lowbit
from lowbit.ops.quantize import ACT_FORMATS, WEIGHT_FORMATS, weight_rows
from lowbit.reference.quantize import (dequantize_ref, quantize_activation_ref,
                                       quantize_weight_ref, weight_codes_ref)

FORMATS = tuple(WEIGHT_FORMATS)
WEIGHT_SHAPES = [(1, 3), (37, 1), (3, 37), (4097, 3)]


def _weights(rng, shape, dtype):
    w = rng.standard_normal(shape).astype(dtype)
    w.flat[:: max(1, w.size // 5)] = 0  # exact zeros: ternary 0, sign +1
    return w


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("format", FORMATS)
def test_quantize_weight_matches_reference(backend, rng, format, dtype):
    for shape in WEIGHT_SHAPES:
        w = _weights(rng, shape, dtype)
        keep = w.copy()
        pw = lowbit.quantize_weight(backend.to(w), format)
        data, scale = quantize_weight_ref(w, format)
        assert_equal(f"data {shape}", data, pw.data)
        assert_equal(f"scale {shape}", scale, pw.scale)
        assert pw.format == format and pw.shape == shape
        assert isinstance(pw.data, backend.xp.ndarray)
        assert pw.nbytes == data.nbytes + scale.nbytes
        assert pw.dense_nbytes == 4 * shape[0] * shape[1]
        codes, _ = weight_codes_ref(w, format)
        assert_equal(f"codes {shape}", codes, pw.codes())
        axis = None if format != "int8" else 0
        assert_close(f"dequantize {shape}", dequantize_ref(codes, scale, axis), pw.dequantize(),
                     rtol=1e-7)
        assert pw.dequantize().dtype == np.float32
        np.testing.assert_array_equal(to_numpy(backend.to(w)), keep)


@pytest.fixture(scope="module")
def across_blocks():
    """A weight wider than the numba kernels' blocks of 1024 columns (K = 37: int8 rows cross
    their 32-byte tiles, packed rows end in a part word; ``WEIGHT_SHAPES`` has (4097, 3) for
    the packed tiles) and its reference ``(data, scale)`` per format."""
    w = _weights(np.random.default_rng(11), (37, 1029), np.float32)
    return w, {format: quantize_weight_ref(w, format) for format in FORMATS}


def test_quantize_weight_across_blocks(backend, across_blocks):
    w, refs = across_blocks
    for format, (data, scale) in refs.items():
        pw = lowbit.quantize_weight(backend.to(w), format)
        assert_equal(f"data {format}", data, pw.data)
        assert_equal(f"scale {format}", scale, pw.scale)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("k0,k1", [(0, 8), (8, 37), (3, 11), (5, 6), (0, 37), (36, 37)],
                         ids=["aligned", "aligned-to-end", "unaligned", "one", "all", "last"])
def test_weight_rows_are_the_reference_codes(backend, rng, format, k0, k1):
    w = _weights(rng, (37, 5), np.float32)
    pw = lowbit.quantize_weight(backend.to(w), format)
    part = weight_rows(pw, k0, k1)
    codes, _ = weight_codes_ref(w, format)
    assert part.shape == (k1 - k0, 5) and part.format == format
    assert_equal("codes", codes[k0:k1], part.codes())
    assert_equal("scale", pw.scale, part.scale)
    if format == "int8":  # per-column scales of the slice differ; its codes must not
        assert_equal("data", codes[k0:k1].T, part.data)


def test_weight_rows_bad_range(never_runs, rng):
    with never_runs.paused():
        pw = lowbit.quantize_weight(_weights(rng, (8, 2), np.float32), "ternary")
    for k0, k1 in ((0, 9), (4, 4), (-1, 2)):
        with pytest.raises(ValueError, match="rows"):
            weight_rows(pw, k0, k1)


def test_packed_sizes_follow_codes_per_byte(rng):
    w = rng.standard_normal((4097, 3)).astype(np.float32)
    assert lowbit.quantize_weight(w, "ternary").data.shape == (3, 1025)
    assert lowbit.quantize_weight(w, "sign").data.shape == (3, 513)
    assert lowbit.quantize_weight(w, "int8").data.shape == (3, 4097)
    assert lowbit.quantize_weight(w, "int8").data.dtype == np.int8


def test_weight_ties_round_half_to_even(backend):
    # mean |w| is exactly 1, so the quotients are the values themselves: 0.5 -> 0, 1.5 -> 2
    # (clipped to 1), -0.5 -> 0, 2.5 -> 2 -> 1; zeros stay 0 (ternary) and become +1 (sign).
    w = np.array([[0.5, -0.5], [1.5, -1.5], [0.0, 0.0], [2.0, -2.0]], dtype=np.float32)
    for format in ("ternary", "sign"):
        pw = lowbit.quantize_weight(backend.to(w), format)
        codes, scale = weight_codes_ref(w, format)
        assert float(scale) == 1.0
        assert_equal(format, codes, pw.codes())
    assert_equal("ternary ties", np.array([[0, 0], [1, -1], [0, 0], [1, -1]], np.int8),
                 lowbit.quantize_weight(backend.to(w), "ternary").codes())
    # int8: the column max 127 makes the scale exactly 1.
    col = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -126.5, 0.0], dtype=np.float32)[:, None]
    pw = lowbit.quantize_weight(backend.to(col), "int8")
    assert_equal("int8 ties", np.array([[127, 0, 2, 2, 0, -126, 0]], np.int8).T, pw.codes())
    assert_equal("int8 ref", weight_codes_ref(col, "int8")[0], pw.codes())


def test_scale_floor(backend):
    w = np.zeros((5, 3), dtype=np.float32)
    for format in FORMATS:
        pw = lowbit.quantize_weight(backend.to(w), format)
        assert_equal(format, quantize_weight_ref(w, format)[1], pw.scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("format", list(ACT_FORMATS))
def test_quantize_activation_matches_reference(backend, rng, format, dtype):
    for shape in [(2, 3, 37), (1, 4097), (5, 1), (113,)]:
        x = rng.standard_normal(shape).astype(dtype) * 3
        x[..., 0] = 0
        keep = x.copy()
        q = lowbit.quantize_activation(backend.to(x), format)
        codes, scale = quantize_activation_ref(x, format)
        assert_equal(f"codes {shape}", codes, q.codes)
        assert_equal(f"scale {shape}", scale, q.scale)
        assert_close(f"dequantize {shape}", codes * scale[..., None].astype(np.float64),
                     q.dequantize(), rtol=1e-7)
        np.testing.assert_array_equal(to_numpy(backend.to(x)), keep)


def test_activation_ties_and_zero_rows(backend):
    x = np.array([[7.0, 0.5, 1.5, -2.5, 0.0], [0, 0, 0, 0, 0]], dtype=np.float32)
    q = lowbit.quantize_activation(backend.to(x), "int4")
    assert_equal("int4 ties", np.array([[7, 0, 2, -2, 0], [0, 0, 0, 0, 0]], np.int8), q.codes)
    codes, scale = quantize_activation_ref(x, "int4")
    assert_equal("codes", codes, q.codes)
    assert_equal("scale", scale, q.scale)


def test_activation_quotients_in_input_dtype(backend):
    """A float32 scale that is not exact: x / scale is a tie in float32 but not against the
    unrounded scale, so a backend that formed the scale in float64 would round 0.5 s to 1."""
    big = np.nextafter(np.float32(127 / 32), np.float32(np.inf))
    s = big / np.float32(127)
    assert s != np.float32(1 / 32) and float(s) != float(big) / 127  # the premise
    x = np.array([[big, 25.5 * s, -25.5 * s, 0.5 * s, 1.5 * s, -0.5 * s]], dtype=np.float32)
    q = lowbit.quantize_activation(backend.to(x))
    codes, scale = quantize_activation_ref(x)
    assert_equal("codes", np.array([[127, 26, -26, 0, 2, 0]], np.int8), codes)
    assert_equal("codes", codes, q.codes)
    assert_equal("scale", scale, q.scale)


def test_fake_quantize(backend, rng):
    w = rng.standard_normal((37, 5)).astype(np.float32)
    x = rng.standard_normal((3, 37)).astype(np.float64)
    for format in FORMATS:
        fq = lowbit.fake_quantize_weight(backend.to(w), format)
        codes, scale = weight_codes_ref(w, format)
        ref = dequantize_ref(codes, scale, 0 if format == "int8" else None)
        assert fq.shape == w.shape and fq.dtype == w.dtype
        assert_close(format, ref, fq, rtol=1e-7)
    fq = lowbit.fake_quantize_activation(backend.to(x), "int8")
    codes, scale = quantize_activation_ref(x, "int8")
    assert fq.shape == x.shape and fq.dtype == x.dtype
    assert_close("activation", codes * scale[:, None].astype(np.float64), fq, rtol=1e-7)


def test_non_finite_weight_raises(backend):
    w = np.ones((4, 3), dtype=np.float32)
    for bad in (np.nan, np.inf):
        w[2, 1] = bad
        with pytest.raises(ValueError, match="w"):
            lowbit.quantize_weight(backend.to(w), "ternary")



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_weight_raises_without_a_warning(backend, format, dtype, bad):
    # The error is the only signal: no "invalid value encountered in cast/divide" before it.
    w = np.ones((6, 5), dtype=dtype)
    w[4, 2] = bad
    for quantize in (lowbit.quantize_weight, lowbit.fake_quantize_weight):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match="w must be finite"):
                quantize(backend.to(w), format)


def test_overflowing_weight_mean_raises_without_a_warning(backend):
    w = np.full((4, 3), np.finfo(np.float64).max)  # finite, but the sum of |w| overflows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="finite scale"):
            lowbit.quantize_weight(backend.to(w), "ternary")


@pytest.mark.parametrize("format", FORMATS)
def test_weight_scale_past_float32_raises(backend, format):
    # Finite in float64, and so is its scale, but the float32 the scale is stored in is not.
    w = np.full((4, 3), 1e300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="scale overflows float32"):
            lowbit.quantize_weight(backend.to(w), format)
    ok = lowbit.quantize_weight(backend.to(np.full((4, 3), 1e30)), format)  # in range: stored
    assert bool(backend.xp.isfinite(ok.scale).all())


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_activation_raises_without_a_warning(backend, bad):
    x = np.ones((3, 5), dtype=np.float32)
    x[2, 0] = bad
    for quantize in (lowbit.quantize_activation, lowbit.fake_quantize_activation):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match="x must be finite.*row 2"):
                quantize(backend.to(x))


def test_non_finite_activation_row_raises(backend):
    x = np.ones((3, 5), dtype=np.float32)
    for bad in (np.nan, -np.inf):
        x[1, 3] = bad
        with pytest.raises(ValueError, match="x must be finite.*row 1"):
            lowbit.quantize_activation(backend.to(x))


def test_unknown_weight_format(never_runs):
    with pytest.raises(ValueError, match="format"):
        lowbit.quantize_weight(np.ones((2, 2), np.float32), "int4")


def test_unknown_activation_format(never_runs):
    with pytest.raises(ValueError, match="format"):
        lowbit.quantize_activation(np.ones((2, 2), np.float32), "ternary")


def test_weight_rank(never_runs):
    with pytest.raises(ValueError, match="w must have shape"):
        lowbit.quantize_weight(np.ones(4, np.float32), "sign")


def test_weight_empty(never_runs):
    with pytest.raises(ValueError, match="w must have K >= 1"):
        lowbit.quantize_weight(np.ones((0, 4), np.float32), "sign")


def test_weight_dtype(never_runs):
    with pytest.raises(TypeError, match="w must be float32 or float64"):
        lowbit.quantize_weight(np.ones((2, 2), np.int32), "sign")


def test_weight_not_array(never_runs):
    with pytest.raises(TypeError, match="w must be a numpy or cupy array"):
        lowbit.quantize_weight([[1.0]], "sign")


def test_activation_rank(never_runs):
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        lowbit.quantize_activation(np.array(1.0, dtype=np.float32))


def test_activation_dtype(never_runs):
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        lowbit.quantize_activation(np.ones((2, 2), np.int8))



def test_packed_weight_codes_check_fields():
    """codes() / dequantize() of a hand-built PackedWeight check its fields before unpacking."""
    pw = lowbit.quantize_weight(np.ones((4, 3), np.float32), "ternary")
    bad = lowbit.PackedWeight("ternary", (40, 3), pw.data, pw.scale)
    with pytest.raises(ValueError, match=r"PackedWeight.data must be uint8 of shape \(3, 10\)"):
        bad.dequantize()
