"""Hugging Face BitNet packed weights (``lowbit/io/hf_bitnet.py``): transformers' own docstring
example, a loop reference of its ``pack_weights`` layout, both ``weight_scale`` conventions by
hand, round trips, ``load_hf_bitnet`` on a safetensors file written to the format's spec here
(bf16 without torch), bad input.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import lowbit
import lowbit.io
from helpers import assert_close, assert_equal
from test_io_gguf import codec, ternary, unaligned  # noqa: F401  (codec: the fixture)


def pack_ref(codes):
    """transformers' layout by its definition: codes [out, in] in {-1, 0, 1} -> uint8
    [ceil(out / 4), in], output n in field n // R of row n % R, missing outputs 0."""
    out_f, in_f = codes.shape
    R = -(-out_f // 4)
    packed = np.zeros((R, in_f), np.uint8)
    for n in range(out_f):
        for k in range(in_f):
            packed[n % R, k] |= np.uint8((int(codes[n, k]) + 1) << (2 * (n // R)))
    return packed


def test_the_transformers_docstring_example(codec):
    """``unpack_weights``'s example in transformers' integrations/bitnet.py."""
    packed = np.array([[0b10100001, 0b00011000], [0b10010000, 0b00001010]], np.uint8)
    unpacked = np.array([[0, -1], [-1, 1], [-1, 1], [-1, 1], [1, 0], [0, -1], [1, -1], [1, -1]],
                        np.int8)  # [out_features = 8, in_features = 2]
    pw = lowbit.io.from_hf_bitnet(packed, np.array([1.0], np.float32), (2, 8))
    assert_equal("codes", unpacked.T, pw.codes())
    assert_equal("packed", packed, lowbit.io.to_hf_bitnet(pw)[0])


def test_both_scale_conventions_by_hand(codec):
    """BitLinear divides by weight_scale, AutoBitLinear multiplies by it."""
    codes = np.array([[1, 0, -1], [-1, 1, 0], [0, 0, 1], [1, 1, -1]], np.int8)  # [out 4, in 3]
    packed = pack_ref(codes)
    x = np.array([[0.5, -2.0, 1.0]], np.float64)
    bit = lowbit.io.from_hf_bitnet(packed, np.array([4.0], np.float32), (3, 4), "bitlinear")
    auto = lowbit.io.from_hf_bitnet(packed, np.array([4.0], np.float32), (3, 4), "autobitlinear")
    assert bit.scale == np.float32(0.25) and auto.scale == np.float32(4.0)
    assert_close("bitlinear", (x @ codes.T) / 4.0, x @ bit.dequantize(), rtol=1e-7)
    assert_close("autobitlinear", (x @ codes.T) * 4.0, x @ auto.dequantize(), rtol=1e-7)
    assert lowbit.io.to_hf_bitnet(bit)[1][0] == 4.0
    assert lowbit.io.to_hf_bitnet(auto, "autobitlinear")[1][0] == 4.0


@pytest.mark.parametrize("K, N", [(5, 1), (3, 6), (7, 9), (13, 4)])
def test_layout_equals_the_reference(codec, rng, K, N):
    pw = ternary(rng, K, N)
    packed, _ = lowbit.io.to_hf_bitnet(pw)
    assert_equal("packed", pack_ref(pw.codes().T), packed)


@pytest.mark.parametrize("convention", lowbit.io.hf_bitnet.CONVENTIONS)
@pytest.mark.parametrize("K, N", [(256, 1), (256, 3), (4096, 3), (256, 4097)])
def test_round_trip_is_bitwise(codec, rng, convention, K, N):
    pw = ternary(rng, K, N, scale=rng.uniform(0.01, 1.0))
    before = pw.data.copy()
    packed, weight_scale = lowbit.io.to_hf_bitnet(pw, convention)
    assert packed.shape == (-(-N // 4), K) and packed.dtype == np.uint8
    back = lowbit.io.from_hf_bitnet(packed, weight_scale, (K, N), convention)
    assert_equal("data", pw.data, back.data)
    assert_equal("scale", pw.scale, back.scale)
    assert_equal("input", before, pw.data)


def test_padding_outputs_are_ignored(codec, rng):
    pw = ternary(rng, 6, 5)  # R = 2: fields 2 of row 1 and 3 of both rows are padding
    packed, ws = lowbit.io.to_hf_bitnet(pw)
    assert not (packed[:, :] >> 6).any() and not (packed[1] >> 4).any()
    packed[:, :] |= np.uint8(0b11000000)
    assert_equal("data", pw.data, lowbit.io.from_hf_bitnet(packed, ws, (6, 5)).data)


def test_unaligned_and_strided_inputs(codec, rng):
    pw = ternary(rng, 256, 5)
    packed, ws = lowbit.io.to_hf_bitnet(pw)
    odd = lowbit.PackedWeight("ternary", pw.shape, unaligned(pw.data), pw.scale)
    assert_equal("export", packed, lowbit.io.to_hf_bitnet(odd)[0])
    assert_equal("import", pw.data, lowbit.io.from_hf_bitnet(unaligned(packed), ws, (256, 5)).data)
    assert_equal("strided", pw.data,
                 lowbit.io.from_hf_bitnet(np.asfortranarray(packed), ws, (256, 5)).data)


def test_packed_matmul_on_an_imported_weight(codec, rng):
    pw = ternary(rng, 256, 9, scale=0.37)
    imported = lowbit.io.from_hf_bitnet(*lowbit.io.to_hf_bitnet(pw), (256, 9))
    x = rng.standard_normal((4, 256)).astype(np.float32)
    assert_equal("y", lowbit.packed_matmul(x, pw), lowbit.packed_matmul(x, imported))


BAD = {
    "convention": (lambda p, s: lowbit.io.from_hf_bitnet(p, s, (8, 5), "bitnet"), ValueError,
                   "convention"),
    "not an array": (lambda p, s: lowbit.io.from_hf_bitnet(p.tolist(), s, (8, 5)), TypeError,
                     "packed"),
    "truncated rows": (lambda p, s: lowbit.io.from_hf_bitnet(p[:1], s, (8, 5)), ValueError,
                       "packed"),
    "oversized": (lambda p, s: lowbit.io.from_hf_bitnet(np.vstack([p, p]), s, (8, 5)),
                  ValueError, "packed"),
    "shape vs bytes": (lambda p, s: lowbit.io.from_hf_bitnet(p, s, (9, 5)), ValueError,
                       "packed"),
    "dtype": (lambda p, s: lowbit.io.from_hf_bitnet(p.view(np.int8), s, (8, 5)), ValueError,
              "uint8"),
    "shape": (lambda p, s: lowbit.io.from_hf_bitnet(p, s, (8, 0)), ValueError, r"shape\[1\]"),
    "scale zero": (lambda p, s: lowbit.io.from_hf_bitnet(p, s * 0, (8, 5)), ValueError,
                   "weight_scale"),
    "scale inf": (lambda p, s: lowbit.io.from_hf_bitnet(p, s * np.inf, (8, 5)), ValueError,
                  "weight_scale"),
    "scale size": (lambda p, s: lowbit.io.from_hf_bitnet(p, np.ones(2), (8, 5)), ValueError,
                   "weight_scale"),
    "scale int": (lambda p, s: lowbit.io.from_hf_bitnet(p, np.ones(1, np.int32), (8, 5)),
                  ValueError, "weight_scale"),
    "field 3": (lambda p, s: lowbit.io.from_hf_bitnet(p | np.uint8(3), s, (8, 5)), ValueError,
                "value 3"),
    "export not ternary": (lambda p, s: lowbit.io.to_hf_bitnet(lowbit.quantize_weight(
        np.ones((8, 5), np.float32), "sign")), ValueError, "format"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input(codec, rng, case):
    fn, exc, match = BAD[case]
    packed, ws = lowbit.io.to_hf_bitnet(ternary(rng, 8, 5))
    with pytest.raises(exc, match=match):
        fn(packed, ws)


def _safetensors_file(tensors: dict) -> bytes:
    """A safetensors file by the format's spec, written here independently of lowbit's writer:
    name -> (dtype name, shape, raw little-endian bytes)."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def bf16(values):
    """float32 values that bf16 holds exactly, and their bf16 bytes (the top halves)."""
    exact = (np.asarray(values, np.float32).view(np.uint32) & np.uint32(0xFFFF0000))
    return exact.view(np.float32), (exact >> np.uint32(16)).astype("<u2").tobytes()


def test_load_hf_bitnet_without_torch(rng, tmp_path):
    """A checkpoint as transformers stores it (uint8 packed weights, bf16 scales and norms):
    BitLinear layers as PackedWeights, bf16 decoded exactly to float32."""
    q = ternary(rng, 16, 8, scale=0.5)
    odd = ternary(rng, 16, 6, scale=0.25)
    norm, norm_bytes = bf16(rng.standard_normal(16))
    head = rng.standard_normal((3, 16)).astype(np.float32)
    tensors = {
        "layers.0.q_proj.weight": ("U8", (2, 16), pack_ref(q.codes().T).tobytes()),
        "layers.0.q_proj.weight_scale": ("BF16", (1,), bf16([2.0])[1]),
        "layers.0.o_proj.weight": ("U8", (2, 16), pack_ref(odd.codes().T).tobytes()),
        "layers.0.o_proj.weight_scale": ("BF16", (1,), bf16([4.0])[1]),
        "layers.0.norm.weight": ("BF16", (16,), norm_bytes),
        "lm_head.weight": ("F32", (3, 16), head.astype("<f4").tobytes()),
    }
    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors_file(tensors))
    loaded = lowbit.io.load_hf_bitnet(path, out_features={"layers.0.o_proj.weight": 6})
    assert set(loaded) == {"layers.0.q_proj.weight", "layers.0.o_proj.weight",
                           "layers.0.norm.weight", "lm_head.weight"}
    for name, pw, scale in (("q_proj", q, 0.5), ("o_proj", odd, 0.25)):
        got = loaded[f"layers.0.{name}.weight"]
        assert_equal(name, pw.codes(), got.codes())
        assert got.scale == np.float32(scale)
    assert_equal("norm", norm, loaded["layers.0.norm.weight"])
    assert_equal("lm_head", head, loaded["lm_head.weight"])
    with pytest.raises(ValueError, match="not in the file"):
        lowbit.io.load_hf_bitnet(path, out_features={"missing.weight": 4})
    with pytest.raises(ValueError, match="o_proj"):
        lowbit.io.load_hf_bitnet(path, out_features={"layers.0.o_proj.weight": 9})
