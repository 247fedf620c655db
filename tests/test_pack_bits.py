"""pack_bits / unpack_bits on every backend against reference/pack_bits.py.

Op: lowbit/ops/pack_bits; kernels: cuda/pack_bits.cu.
"""

import numpy as np
import pytest

import lowbit
from helpers import assert_equal
from lowbit.reference.pack_bits import pack_bits_ref, unpack_bits_ref

BITS = (1, 2, 4, 8)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape,axis", [((1,), 0), ((3,), -1), ((37,), 0), ((2, 113), -1),
                                        ((5, 7, 3), 1), ((4, 9), 0), ((2, 3, 17), 2)])
def test_round_trip_matches_reference(backend, rng, bits, shape, axis):
    codes = rng.integers(0, 1 << bits, shape, dtype=np.uint8)
    packed = lowbit.pack_bits(backend.to(codes), bits, axis=axis)
    assert_equal("packed", pack_bits_ref(codes, bits, axis), packed)
    count = shape[axis]
    back = lowbit.unpack_bits(packed, bits, count, axis=axis)
    assert_equal("codes", codes, back)
    assert_equal("unpack_ref", unpack_bits_ref(pack_bits_ref(codes, bits, axis), bits, count, axis),
                 back)


@pytest.mark.parametrize("bits", BITS)
def test_multi_block_and_padding(backend, rng, bits):
    # Several thread blocks under cudasim/cuda; a length that leaves a partial last byte.
    codes = rng.integers(0, 1 << bits, (3, 1021), dtype=np.uint8)
    packed = lowbit.pack_bits(backend.to(codes), bits)
    assert packed.shape == (3, -(-1021 * bits // 8))
    assert_equal("packed", pack_bits_ref(codes, bits), packed)
    assert_equal("codes", codes, lowbit.unpack_bits(packed, bits, 1021))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape,axis", [((0,), 0), ((0, 5), 1), ((4, 0), 1), ((4, 0), 0)])
def test_empty_arrays(backend, bits, shape, axis):
    codes = np.zeros(shape, dtype=np.uint8)
    packed = lowbit.pack_bits(backend.to(codes), bits, axis=axis)
    assert_equal("packed", pack_bits_ref(codes, bits, axis), packed)
    assert_equal("codes", codes, lowbit.unpack_bits(packed, bits, shape[axis], axis=axis))


def test_other_integer_dtypes_and_inputs_untouched(backend, rng):
    codes = rng.integers(0, 4, (6, 11)).astype(np.int64)
    keep = codes.copy()
    packed = lowbit.pack_bits(backend.to(codes), 2)
    assert_equal("packed", pack_bits_ref(codes.astype(np.uint8), 2), packed)
    np.testing.assert_array_equal(codes, keep)


def test_numbers_agree_with_numpy_packbits(rng):
    # An independent oracle for the 1-bit layout: NumPy's own little-endian packbits.
    codes = rng.integers(0, 2, (4, 29), dtype=np.uint8)
    np.testing.assert_array_equal(lowbit.pack_bits(codes, 1),
                                  np.packbits(codes, axis=-1, bitorder="little"))


@pytest.mark.slow
def test_more_than_2_31_codes_on_numba():
    n = (1 << 31) + 77
    codes = np.zeros(n, dtype=np.uint8)
    # Mark positions whose flat index needs more than 31 bits, and a few below.
    marks = np.array([3, (1 << 31) - 1, 1 << 31, n - 1], dtype=np.int64)
    codes[marks] = 1
    with lowbit.use_backend("numba"):
        packed = lowbit.pack_bits(codes, 1)
        assert packed.shape == (-(-n // 8),)
        # The set bits, from the nonzero bytes only (unpacking all 2**31 bits took seconds).
        nonzero = np.flatnonzero(packed)
        bits = np.unpackbits(packed[nonzero], bitorder="little").reshape(-1, 8).astype(bool)
        np.testing.assert_array_equal((nonzero[:, None] * 8 + np.arange(8))[bits], marks)
        del codes
        back = lowbit.unpack_bits(packed, 1, n)
    assert back.shape == (n,)
    # flatnonzero(back) == marks, without its 2**31-element scan into a list of indices.
    assert np.count_nonzero(back) == marks.size and back[marks].all()


# -- validation: one test per rule, the message names the argument ---------------------------


@pytest.mark.parametrize("bits", [0, 3, 16, -1])
def test_bits_outside_set(bits):
    with pytest.raises(ValueError, match="bits"):
        lowbit.pack_bits(np.zeros(4, np.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        lowbit.unpack_bits(np.zeros(1, np.uint8), bits, 4)


def test_bits_not_integer():
    with pytest.raises(TypeError, match="bits"):
        lowbit.pack_bits(np.zeros(4, np.uint8), 2.0)


def test_code_too_large():
    with pytest.raises(ValueError, match="codes"):
        lowbit.pack_bits(np.array([0, 4, 1], np.uint8), 2)


def test_negative_code():
    with pytest.raises(ValueError, match="codes"):
        lowbit.pack_bits(np.array([0, -1], np.int16), 2)


def test_non_integer_codes():
    with pytest.raises(TypeError, match="codes"):
        lowbit.pack_bits(np.zeros(4, np.float32), 2)


def test_codes_not_an_array():
    with pytest.raises(TypeError, match="codes"):
        lowbit.pack_bits([0, 1, 2], 2)


def test_packed_not_uint8():
    with pytest.raises(TypeError, match="packed"):
        lowbit.unpack_bits(np.zeros(2, np.int8), 2, 8)


@pytest.mark.parametrize("count", [9, 4, 100])
def test_count_inconsistent(count):
    with pytest.raises(ValueError, match="count"):
        lowbit.unpack_bits(np.zeros(2, np.uint8), 2, count)


def test_count_negative():
    with pytest.raises(ValueError, match="count"):
        lowbit.unpack_bits(np.zeros(0, np.uint8), 2, -1)


def test_axis_out_of_range():
    with pytest.raises(ValueError, match="axis"):
        lowbit.pack_bits(np.zeros((2, 3), np.uint8), 2, axis=2)
