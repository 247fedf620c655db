"""Saved activations: every backend against the reference, the error contracts, byte accounting.

Op: ``lowbit/ops/saved_activation/`` (kernels ``cuda/saved_activation.cu``); reference:
``reference/saved_activation.py``; the ctx walk: ``lowbit/_ctx.py``; benchmark ``bench/memory.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import numpy as np
import pytest
from helpers import Backend
from helpers import assert_equal, to_numpy

import lowbit
from lowbit import _ctx
from lowbit.ops.saved_activation import (FORMAT_BITS, FORMATS, KINDS, ROUNDINGS, save,
                                         save_activation)
from lowbit.reference.saved_activation import pack_activation_ref, unpack_activation_ref

INT_FORMATS = tuple(FORMAT_BITS)
#: (shape, group_size): a last axis not divisible by the group, one partial group per row,
#: groups of one element, groups that share packed bytes, a 1-D tensor over several blocks.
CASES = [((3, 37), 16), ((2, 3, 113), 256), ((4, 9), 1), ((2, 70), 3), ((300,), 64)]
F32_EPS = float(np.finfo(np.float32).eps)


def _values(rng, shape, dtype=np.float32):
    return (rng.standard_normal(shape) * 3 + 1).astype(dtype)


def _relu(rng, shape, density=0.3, dtype=np.float32):
    """Post-ReLU data with about ``density`` nonzeros, some far below a quantization step."""
    x = np.abs(rng.standard_normal(shape)) * (rng.random(shape) < density)
    x.reshape(-1)[::7] *= 1e-4
    return x.astype(dtype)


def _data(rng, shape, kind, dtype=np.float32):
    return _relu(rng, shape, dtype=dtype) if kind == "nonneg" else _values(rng, shape, dtype)


def _pack(backend, x, fmt, **kw):
    return lowbit.pack_activation(backend.to(x), fmt, **kw)


def _groups(fmt, group_size):
    """``group_size=`` for the formats that group ("fp32" takes none)."""
    return {} if fmt == "fp32" else dict(group_size=group_size)


def _check_against_reference(backend, x, fmt, kind, group_size, rounding, seed=3):
    seed = seed if rounding == "stochastic" else 0  # nearest rounding takes no seed
    packed = _pack(backend, x, fmt, kind=kind, group_size=group_size, rounding=rounding,
                   seed=seed)
    ref = pack_activation_ref(x, fmt, kind, group_size, rounding, seed)
    assert sorted(packed.arrays) == sorted(ref)
    for name, want in ref.items():
        assert_equal(f"{fmt}/{kind}/{rounding} {name}", want, packed.arrays[name])
    want = unpack_activation_ref(ref, x.shape, fmt, kind, group_size)
    got = packed.unpack()
    assert type(got) is type(backend.to(want))
    # float32 results compared by bit pattern: every backend dequantizes identically.
    assert_equal(f"{fmt}/{kind}/{rounding} unpack", want.view(np.uint32),
                 to_numpy(got).view(np.uint32))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_dense_matches_reference(backend, rng, fmt, kind, rounding):
    for shape, group_size in CASES:
        _check_against_reference(backend, _data(rng, shape, kind), fmt, kind, group_size,
                                 rounding)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_sparse_matches_reference(backend, rng, rounding):
    for shape, group_size in CASES + [((5, 200), 8)]:
        _check_against_reference(backend, _relu(rng, shape), "sparse", "nonneg", group_size,
                                 rounding)


def test_numba_parallel_paths_match_reference(rng, monkeypatch):
    """Small tensors run numba's serial functions directly; force the parallel drivers too."""
    from lowbit.ops.saved_activation import _numba

    monkeypatch.setattr(_numba, "SERIAL_ELEMENTS", 0)
    with lowbit.use_backend("numba"):
        for fmt in INT_FORMATS + ("sparse",):
            for kind in KINDS if fmt != "sparse" else ("nonneg",):
                for shape, group_size in CASES:
                    _check_against_reference(Backend("numba"), _data(rng, shape, kind), fmt,
                                             kind, group_size, "stochastic")


@pytest.mark.parametrize("fmt", INT_FORMATS + ("sparse",))
def test_large_tensor_numba_matches_numpy(rng, fmt):
    """Above numba's serial threshold: bitwise equal to the numpy backend (itself checked
    against the reference above)."""
    # Half nonzeros overflow the numba sparse kernel's in-cache compaction slots.
    kinds = KINDS if fmt != "sparse" else ("nonneg",)
    for density, kind, rounding in [(d, k, r) for d in (0.05, 0.5) for k in kinds
                                    for r in ROUNDINGS]:
        x = _relu(rng, (70, 4000), density=density)
        packed = {}
        for name in ("numpy", "numba"):
            with lowbit.use_backend(name):
                p = lowbit.pack_activation(x, fmt, kind=kind, rounding=rounding,
                                           seed=9 if rounding == "stochastic" else 0)
                packed[name] = (p, p.unpack())
        for array in packed["numpy"][0].arrays:
            assert_equal(f"{fmt}/{kind}/{rounding} {array}",
                         packed["numpy"][0].arrays[array], packed["numba"][0].arrays[array])
        assert_equal(f"{fmt}/{kind}/{rounding} unpack", packed["numpy"][1],
                     packed["numba"][1])


@pytest.mark.parametrize("fmt", ["int4", "sparse"])
def test_float64_input_matches_reference(backend, rng, fmt):
    x = _relu(rng, (3, 50), dtype=np.float64)
    _check_against_reference(backend, x, fmt, "nonneg", 16, "stochastic")
    packed = _pack(backend, x, fmt, kind="nonneg", group_size=16)
    assert packed.dtype == np.float64 and packed.unpack().dtype == np.float32


def test_fp32_is_exact(backend, rng):
    x = _values(rng, (3, 37))
    packed = _pack(backend, x, "fp32")
    assert_equal("fp32", x, packed.unpack())
    x64 = x.astype(np.float64) / 3
    assert_equal("fp32 of float64", (x64).astype(np.float32),
                 _pack(backend, x64, "fp32").unpack())


def _element_scales(packed):
    """The step of every element's group, [shape] float64, from the arrays the pack holds."""
    scales = to_numpy(packed.scales).astype(np.float64)
    if packed.format == "sparse":
        nonzero = to_numpy(packed.unpack()).reshape(-1) != 0
        out = np.zeros(nonzero.size)
        out[nonzero] = scales[np.arange(nonzero.sum()) // packed.group_size]
        return out.reshape(packed.shape)
    n = packed.shape[-1]
    return scales[:, np.arange(n) // packed.group_size].reshape(packed.shape)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt,kind", [(f, k) for f in INT_FORMATS for k in KINDS]
                         + [("sparse", "nonneg")])
def test_error_contract(backend, rng, fmt, kind, rounding):
    x = _data(rng, (6, 300), kind)
    packed = _pack(backend, x, fmt, kind=kind, group_size=64, rounding=rounding,
                   seed=11 if rounding == "stochastic" else 0)
    out = to_numpy(packed.unpack()).astype(np.float64)
    scale = _element_scales(packed)
    err = np.abs(out - x)
    # float32 rounding of (x - min) / scale and of min + code * scale.
    slack = 4 * F32_EPS * (np.abs(x) + np.abs(out))
    if kind == "nonneg":
        assert_equal("zero pattern", x == 0, out == 0)
    if rounding == "stochastic":
        assert (err <= scale * (1 + 1e-5) + slack).all(), "stochastic error above one step"
        return
    tiny = (x > 0) & (x < scale / 2) if kind == "nonneg" else np.zeros(x.shape, bool)
    assert (err[~tiny] <= scale[~tiny] / 2 * (1 + 1e-5) + slack[~tiny]).all(), (
        f"nearest error above half a step: max excess "
        f"{(err - scale / 2 - slack)[~tiny].max():.3e}")
    if kind == "nonneg":
        assert tiny.any(), "the data must exercise positives below half a step"
        np.testing.assert_allclose(out[tiny], scale[tiny], rtol=1e-6)


def test_stochastic_rounding_is_unbiased(backend, rng):
    x = _values(rng, (1, 32))
    seeds = 256
    outs = np.stack([to_numpy(_pack(backend, x, "int2", group_size=16, rounding="stochastic",
                                    seed=s).unpack()) for s in range(seeds)]).astype(np.float64)
    packed = _pack(backend, x, "int2", group_size=16)
    scale = _element_scales(packed)
    mins = np.repeat(to_numpy(packed.mins).astype(np.float64), 16, axis=1)
    frac = np.clip((x - mins) / scale % 1.0, 0, 1)
    # Each unpack is floor + Bernoulli(frac) steps: standard error sqrt(p (1 - p) / seeds) steps.
    standard_error = scale * np.sqrt(frac * (1 - frac) / seeds)
    slack = 1e-5 * scale
    excess = np.abs(outs.mean(axis=0) - x) - (4 * standard_error + slack)
    assert (excess <= 0).all(), f"mean over {seeds} seeds off by {excess.max():.3e} beyond 4 SE"
    first = _pack(backend, x, "int2", group_size=16, rounding="stochastic", seed=7)
    again = _pack(backend, x, "int2", group_size=16, rounding="stochastic", seed=7)
    assert_equal("same seed, same codes", first.codes, again.codes)


def test_byte_counts(backend, rng):
    shape = (2, 1024)
    x = _relu(rng, shape, density=0.05)
    for fmt in FORMATS:
        for kind in KINDS if fmt != "sparse" else ("nonneg",):
            packed = _pack(backend, x, fmt, kind=kind)
            held = sum(a.itemsize * a.size for a in packed.arrays.values())
            assert packed.nbytes == held > 0
            assert packed.dense_nbytes == 4 * math.prod(shape)
    dense = _values(rng, shape)
    int2 = _pack(backend, dense, "int2", group_size=256)
    assert int2.nbytes * 14 <= int2.dense_nbytes, f"int2 ratio {int2.nbytes / int2.dense_nbytes}"
    sparse = _pack(backend, x, "sparse", kind="nonneg")
    assert 0.03 < np.count_nonzero(x) / x.size < 0.07
    assert sparse.nbytes * 16 <= sparse.dense_nbytes, (
        f"sparse ratio {sparse.nbytes / sparse.dense_nbytes} at 5% nonzeros")


@pytest.mark.parametrize("fmt", INT_FORMATS + ("sparse",))
def test_zero_and_constant_groups(backend, fmt):
    x = np.zeros((3, 40), np.float32)
    x[1] = 2.5  # a constant row: max == min
    x[2, :20] = 0.75
    kind = "nonneg" if fmt == "sparse" else "values"
    for kinds in ((kind,) if fmt == "sparse" else KINDS):
        packed = _pack(backend, x, fmt, kind=kinds, group_size=16)
        assert np.isfinite(to_numpy(packed.scales)).all()
        out = to_numpy(packed.unpack())
        if kinds == "values":
            assert_equal("constant and zero groups", x, out)
        else:
            assert_equal("zero pattern", x == 0, out == 0)
            levels = 255 if fmt == "sparse" else (1 << FORMAT_BITS[fmt]) - 1
            np.testing.assert_allclose(out, x, atol=x.max() / levels / 2 * (1 + 1e-5))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5), ()])
@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_and_scalar(backend, fmt, shape):
    x = np.full(shape, 1.5, np.float32)
    packed = _pack(backend, x, fmt, kind="nonneg", **_groups(fmt, 4))
    out = packed.unpack()
    assert out.shape == shape and out.dtype == np.float32
    assert packed.dense_nbytes == 4 * x.size
    if x.size:
        np.testing.assert_allclose(to_numpy(out), x, rtol=0.2)
    else:
        assert packed.nbytes == sum(a.itemsize * a.size for a in packed.arrays.values())


def test_input_not_modified_and_strided(backend, rng):
    x = _values(rng, (40, 6))
    keep = x.copy()
    view = x.T  # not contiguous
    packed = _pack(backend, view, "int8", group_size=16)
    assert_equal("input", keep, x)
    ref = pack_activation_ref(np.ascontiguousarray(view), "int8", group_size=16)
    assert_equal("codes of a strided view", ref["codes"], packed.codes)


def test_backward_can_read_twice(backend, rng):
    x = _values(rng, (2, 50))
    packed = _pack(backend, x, "int4", group_size=16)
    first = to_numpy(packed.unpack()).copy()
    assert_equal("second unpack", first, packed.unpack())


def test_pack_mask_round_trip(backend, rng):
    for shape in [(3, 37), (1,), (0, 4), (2, 3, 5)]:
        mask = rng.random(shape) < 0.4
        packed = lowbit.pack_mask(backend.to(mask))
        assert isinstance(packed, _ctx.Saved)
        assert packed.nbytes == -(-mask.size // 8) == packed.bits.size
        assert_equal("mask", mask, packed.unpack())


# -- the policy and the ctx walk ---------------------------------------------------------------


def test_save_choke_point(rng):
    x = _values(rng, (4, 32))
    exact = save(x, None)
    assert isinstance(exact, _ctx.Exact) and exact.unpack() is x and exact.nbytes == x.nbytes
    by_string = save(x, "int4")
    assert isinstance(by_string, lowbit.PackedActivation) and by_string.format == "int4"
    config = lowbit.SavedConfig("int2", group_size=8, rounding="stochastic", seed=5)
    by_config = save(x, config)
    want = pack_activation_ref(x, "int2", "values", 8, "stochastic", 5)
    assert_equal("codes", want["codes"], by_config.codes)
    relu = save(np.maximum(x, 0), "sparse", kind="nonneg")
    assert relu.format == "sparse"
    mask = save(x > 0, "int8", kind="mask")
    assert isinstance(mask, lowbit.PackedMask)
    assert_equal("mask", x > 0, mask.unpack())
    assert save_activation(x, config).format == "int2"


@dataclasses.dataclass(frozen=True)
class _InnerCtx(_ctx.Ctx):
    h: _ctx.Saved
    weight: np.ndarray


@dataclasses.dataclass(frozen=True)
class _OuterCtx(_ctx.Ctx):
    x: _ctx.Saved
    layers: tuple
    extra: dict


def test_memory_report_walks_nested_ctxs(rng):
    x = _values(rng, (8, 64))
    relu = np.maximum(x, 0)
    outer = _OuterCtx(
        x=save(x, "int8"),
        layers=(_InnerCtx(save(relu, "sparse", kind="nonneg"), np.ones((64, 64))),
                _InnerCtx(save(relu, None), np.ones((64, 64)))),
        extra={"mask": save(x > 0, "int8", kind="mask")},
    )
    report = lowbit.memory_report(outer)
    names = [row.name for row in report.rows]
    assert names == ["_OuterCtx.x", "_OuterCtx.layers[0].h", "_OuterCtx.layers[1].h",
                     "_OuterCtx.extra['mask']"]
    assert [row.format for row in report.rows] == ["int8", "sparse", "exact", "mask1"]
    assert report.nbytes == outer.nbytes == sum(row.nbytes for row in report.rows)
    assert report.dense_nbytes == outer.dense_nbytes == 4 * 4 * x.size
    assert outer.layers[1].nbytes == relu.nbytes  # parameters (weight) are not counted
    text = str(report)
    for name in names + ["total", f"{report.nbytes:,}"]:
        assert name in text


def test_memory_report_of_linear_forward(rng):
    x = _values(rng, (4, 16, 64))
    w = rng.standard_normal((64, 32)).astype(np.float32)
    y, ctx = lowbit.linear_forward(x, w, "ternary", None, saved="int8")
    report = lowbit.memory_report(ctx)
    print(report)
    assert [row.format for row in report.rows] == ["int8"]
    assert report.nbytes == ctx.nbytes < x.nbytes / 3
    assert report.dense_nbytes == x.size * 4
    _, exact_ctx = lowbit.linear_forward(x, w, "ternary", None)
    assert exact_ctx.nbytes == x.nbytes
    assert lowbit.linear_backward(np.ones_like(y), ctx)[1].shape == w.shape


# -- bad input: one test per rule, each message names the argument -----------------------------


@pytest.mark.parametrize("kwargs,error,names", [
    (dict(format="int3"), ValueError, "format"),
    (dict(format="int8", kind="relu"), ValueError, "kind"),
    (dict(format="sparse", kind="values"), ValueError, "kind"),
    (dict(format="int8", group_size=0), ValueError, "group_size"),
    (dict(format="int8", group_size=2.5), TypeError, "group_size"),
    (dict(format="int8", rounding="up"), ValueError, "rounding"),
    (dict(format="int8", seed=-1), ValueError, "seed"),
    (dict(format="int8", seed=1 << 64), ValueError, "seed"),
    (dict(format="int8", seed=3), ValueError, "seed=3 has no effect"),
    (dict(format="fp32", group_size=64), ValueError, "group_size=64 has no effect"),
    (dict(format="fp32", rounding="stochastic"), ValueError, "rounding='stochastic' has no"),
])
def test_bad_arguments(never_runs, rng, kwargs, error, names):
    x = np.abs(_values(rng, (2, 8)))
    fmt = kwargs.pop("format")
    with pytest.raises(error, match=names):
        lowbit.pack_activation(x, fmt, **kwargs)


def test_bad_array(never_runs):
    with pytest.raises(TypeError, match="x"):
        lowbit.pack_activation([1.0, 2.0], "int8")
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        lowbit.pack_activation(np.ones(4, np.int32), "int8")
    with pytest.raises(TypeError, match="mask"):
        lowbit.pack_mask(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="saved"):
        save_activation(np.ones(4, np.float32), 8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_values(backend, fmt):
    for bad in (np.inf, np.nan, -np.inf):
        x = np.ones((3, 40), np.float32)
        x[2, 33] = bad
        keep = x.copy()
        with pytest.raises(ValueError, match="x must be finite"):
            _pack(backend, x, fmt, kind="nonneg", **_groups(fmt, 16))
        assert_equal("input", keep, x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_negative_values_with_nonneg(backend, fmt):
    x = np.ones((3, 40), np.float32)
    x[1, 17] = -0.5
    with pytest.raises(ValueError, match="x must be non-negative"):
        _pack(backend, x, fmt, kind="nonneg", **_groups(fmt, 16))


def test_saved_config_validation():
    assert lowbit.SavedConfig() == lowbit.SavedConfig("int8", 256, "nearest", 0)
    with pytest.raises(ValueError, match="format"):
        lowbit.SavedConfig("int16")
    with pytest.raises(ValueError, match="group_size"):
        lowbit.SavedConfig(group_size=-4)
    with pytest.raises(ValueError, match="rounding"):
        lowbit.SavedConfig(rounding="down")
    with pytest.raises(TypeError, match="seed"):
        lowbit.SavedConfig(seed=1.5)
    with pytest.raises(ValueError, match="seed=2 has no effect"):
        lowbit.SavedConfig("int4", seed=2)
    with pytest.raises(ValueError, match="group_size=8 has no effect"):
        lowbit.SavedConfig("fp32", group_size=8)


def test_sparse_policy_saves_signed_tensors_at_int8(rng):
    """Through the choke point, the "sparse" policy keeps a tensor of any sign at int8 (as the
    int8 policy would) and a non-negative one in the sparse format."""
    x = rng.standard_normal((4, 300)).astype(np.float32)
    signed = save(x, "sparse")
    assert signed.format == "int8"
    np.testing.assert_array_equal(signed.unpack(), save(x, "int8").unpack())
    assert save(np.maximum(x, 0), "sparse", kind="nonneg").format == "sparse"


def _forward_cases(rng):
    """Valid arguments for every public forward that takes ``saved=``."""
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    B, T, H, K, V, D, N = 1, 5, 2, 4, 3, 8, 6
    return {
        "linear_forward": ((f32(3, 8), f32(8, 4), "ternary", None), {}),
        "segmented_attention_forward": ((f32(T, H, K), f32(T, H, K), f32(T, H, V), [T]), {}),
        "gated_delta_scan_forward": (
            (f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, V), -np.abs(f32(B, T, H)),
             np.abs(f32(B, T, H))), {}),
        "selective_scan_forward": (
            (f32(B, T, H, V), f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H), f32(H), f32(H),
             f32(H)), {}),
        "lowrank_residual_forward": ((f32(B, T, D), f32(H, D, N), f32(H, D, N), f32(H * N, D)),
                                     {}),
        "cross_entropy_forward": ((f32(T, V), rng.integers(0, V, size=T)), {}),
        "layer_norm_forward": ((f32(T, D),), {}),
        "rms_norm_forward": ((f32(T, D), f32(D)), {}),
    }


def test_every_forward_with_saved_is_covered(rng):
    functions = {name: f for name, f in vars(lowbit).items() if inspect.isfunction(f)}
    with_saved = {name for name, f in functions.items()
                  if "saved" in inspect.signature(f).parameters}
    assert with_saved == set(_forward_cases(rng))


@pytest.mark.parametrize("name", sorted(_forward_cases(np.random.default_rng(0))))
@pytest.mark.parametrize("saved,error", [("bogus", ValueError), (3, TypeError)])
def test_bad_saved_policy_raises_first(never_runs, rng, name, saved, error):
    args, kwargs = _forward_cases(rng)[name]
    with pytest.raises(error, match="saved"):
        getattr(lowbit, name)(*args, saved=saved, **kwargs)


@pytest.mark.parametrize("name", sorted(_forward_cases(np.random.default_rng(0))))
def test_forward_cases_are_valid(rng, name):
    args, kwargs = _forward_cases(rng)[name]
    getattr(lowbit, name)(*args, saved="int8", **kwargs)
