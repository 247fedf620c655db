"""Properties of ``lowbit/ops/pack_bits`` and ``lowbit/ops/saved_activation`` on every CPU backend.

Packed bytes, codes, scales and minima equal ``reference/pack_bits.py`` and
``reference/saved_activation.py`` exactly, unpacked values bitwise; shapes cross the numba
kernels' task size (``TASK_ELEMENTS``) and group boundaries. Example-based tests:
``tests/test_pack_bits.py``, ``tests/test_saved_activation.py``.
"""

import numpy as np
import pytest
from helpers import assert_equal
from hypothesis import example, given, strategies as st
from strategies import LAYOUTS, arrays, dims, on_backends, relayout, unchanged

import lowbit
from lowbit.ops.saved_activation import _numba as sa_numba
from lowbit.reference.pack_bits import pack_bits_ref, unpack_bits_ref
from lowbit.reference.saved_activation import pack_activation_ref, unpack_activation_ref

BITS = (1, 2, 4, 8)
INT_DTYPES = (np.uint8, np.int8, np.int16, np.uint32, np.int64)


@st.composite
def codes_arrays(draw):
    bits = draw(st.sampled_from(BITS))
    shape = tuple(draw(st.lists(dims(9, 17, low=0, high=17), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(INT_DTYPES))
    size = int(np.prod(shape))
    top = min((1 << bits) - 1, int(np.iinfo(dtype).max))
    flat = draw(st.lists(st.integers(0, top), min_size=size, max_size=size))
    codes = np.asarray(flat, dtype=dtype).reshape(shape)
    return bits, relayout(codes, draw(st.sampled_from(LAYOUTS))), draw(
        st.integers(-len(shape), len(shape) - 1))


@given(case=codes_arrays())
def test_pack_unpack_equal_reference(case):
    bits, codes, axis = case
    want = pack_bits_ref(codes, bits, axis)
    count = codes.shape[axis]
    out = on_backends(lambda: lowbit.pack_bits(codes, bits, axis=axis), codes.size, codes=codes)
    for name, packed in out.items():
        assert_equal(f"{name} packed", want, packed)
        back = on_backends(lambda: lowbit.unpack_bits(packed, bits, count, axis=axis), packed.size,
                           packed=packed)
        for other, got in back.items():
            assert_equal(f"{name}->{other} unpacked", unpack_bits_ref(want, bits, count, axis),
                         got)
            assert_equal(f"{name}->{other} round trip", codes.astype(np.uint8), got)


@given(bits=st.sampled_from(BITS), bad=st.sampled_from(["negative", "high", "float"]),
       n=dims(high=13))
def test_bad_codes_are_rejected(bits, bad, n):
    codes = np.zeros(n, np.int32)
    if bad == "negative":
        codes[-1] = -1
    elif bad == "high":
        codes[-1] = 1 << bits
    else:
        codes = codes.astype(np.float32)
    error = TypeError if bad == "float" else ValueError
    for name in on_backends(lambda: 0):
        with lowbit.use_backend(name), unchanged(codes=codes):
            with pytest.raises(error, match="codes"):
                lowbit.pack_bits(codes, bits)


@pytest.mark.parametrize("bits", [0, 3, 16, 2.0, "2"])
def test_bad_bits_are_rejected(bits):
    with pytest.raises((TypeError, ValueError), match="bits"):
        lowbit.pack_bits(np.zeros(4, np.uint8), bits)


GROUPS = dims(7, 256, high=257)


@st.composite
def activations(draw):
    fmt = draw(st.sampled_from(["fp32", "int8", "int4", "int2", "sparse"]))
    kind = "nonneg" if fmt == "sparse" else draw(st.sampled_from(["values", "nonneg"]))
    n = draw(dims(7, 256, sa_numba.TASK_ELEMENTS // 8, high=sa_numba.TASK_ELEMENTS // 8 + 1))
    lead = tuple(draw(st.lists(dims(low=0, high=13), max_size=2)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    x = draw(arrays((*lead, n), dtype))
    if kind == "nonneg":
        x = np.abs(x) * draw(st.sampled_from([0.0, 1.0]))
        x = np.where(np.arange(x.size).reshape(x.shape) % 3 == 0, 0, x).astype(dtype)
    if draw(st.booleans()):
        x[...] = x.reshape(-1)[0] if x.size else 0  # all equal: the scale floor or one level
    # fp32 takes no group size nor rounding, nearest rounding no seed (they would raise)
    group = 256 if fmt == "fp32" else draw(GROUPS)
    rounding = "nearest" if fmt == "fp32" else draw(st.sampled_from(["nearest", "stochastic"]))
    seed = draw(st.integers(0, 2**64 - 1)) if rounding == "stochastic" else 0
    return (fmt, kind, relayout(x, draw(st.sampled_from(LAYOUTS))), group, rounding, seed)


@given(case=activations())
@example(case=("int8", "values", np.array([[0.5, 1.5, 2.5, -0.5]], np.float32), 4, "nearest",
               0)).via("ties")
@example(case=("int2", "nonneg", np.full((2, 3), 1e-30, np.float32), 2, "nearest", 0))
def test_pack_activation_equals_reference(case):
    fmt, kind, x, group, rounding, seed = case
    ref = pack_activation_ref(x, fmt, kind, group, rounding, seed)
    want = unpack_activation_ref(ref, x.shape, fmt, kind, group)
    out = on_backends(lambda: lowbit.pack_activation(x, fmt, kind=kind, group_size=group,
                                                     rounding=rounding, seed=seed), x.size, x=x)
    for name, packed in out.items():
        assert sorted(packed.arrays) == sorted(ref), name
        for key, value in ref.items():
            assert_equal(f"{name} {key}", value, np.ascontiguousarray(packed.arrays[key]))
        got = packed.unpack()
        assert got.shape == x.shape and got.dtype == np.float32
        assert_equal(f"{name} unpack", want.view(np.uint32), got.view(np.uint32))


@given(shape=st.lists(dims(low=0, high=17), min_size=1, max_size=3),
       layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**32 - 1))
def test_pack_mask_round_trip(shape, layout, seed):
    mask = relayout(np.random.default_rng(seed).random(shape) < 0.5, layout)
    want = pack_bits_ref(mask.reshape(-1).astype(np.uint8), 1)
    for name, packed in on_backends(lambda: lowbit.pack_mask(mask), mask.size,
                                    mask=mask).items():
        assert_equal(f"{name} bits", want, packed.bits)
        assert_equal(f"{name} mask", mask, packed.unpack())


@given(fmt=st.sampled_from(["int8", "int4", "int2", "sparse", "fp32"]),
       bad=st.sampled_from([np.nan, np.inf, -np.inf]), where=st.integers(0, 11))
def test_non_finite_activation_is_rejected(fmt, bad, where):
    x = np.ones((3, 4), np.float32)
    x.flat[where] = bad
    kind = "nonneg" if fmt == "sparse" or bad == np.inf else "values"
    for name in on_backends(lambda: 0):
        with lowbit.use_backend(name), unchanged(x=x):
            with pytest.raises(ValueError, match="x must be finite"):
                lowbit.pack_activation(x, fmt, kind=kind)
