"""GGUF's TQ1_0 / TQ2_0 (``lowbit/io/gguf.py``, conversions in ``lowbit/io/_numpy.py`` and
``_numba.py``) against the ``gguf`` package's own ``quants.quantize`` / ``quants.dequantize``,
``GGUFWriter`` and ``GGUFReader``; round trips, the packed matmul on an imported weight, bad input.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import lowbit
import lowbit.io
from helpers import assert_close, assert_equal

QTYPES = ("TQ2_0", "TQ1_0")
#: A scale that fp16 holds exactly, so round trips through ggml's fp16 block scale are bitwise.
EXACT = np.float32(0.0234375)


@pytest.fixture
def gguf():
    """The gguf package, the oracle (the conversions themselves do not need it)."""
    return pytest.importorskip("gguf", reason='the gguf package (pip install "lowbit[io]")')


@pytest.fixture(params=["numpy", "numba"])
def codec(request):
    """The conversion module in use: dispatch's numpy or numba backend, forced."""
    if request.param not in lowbit.available_backends():
        pytest.skip(f"backend {request.param} is not available here")
    with lowbit.use_backend(request.param):
        yield request.param


def ternary(rng, K, N, scale=EXACT, zero_rows=0):
    """A ternary PackedWeight with random codes (the first ``zero_rows`` input rows all zero,
    so the first blocks of every output are all-zero blocks) and the given scale."""
    codes = rng.integers(-1, 2, (K, N)).astype(np.int8)
    codes[:zero_rows] = 0
    data = lowbit.pack_bits(np.ascontiguousarray((codes.T + 1).astype(np.uint8)), 2)
    return lowbit.PackedWeight("ternary", (K, N), data, np.asarray(scale, dtype=np.float32))


def fp16(x):
    return np.float32(np.float16(np.float32(x)))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("K, N", [(256, 1), (256, 3), (4096, 3), (256, 4097)])
def test_round_trip_is_bitwise(codec, rng, qtype, K, N):
    pw = ternary(rng, K, N, zero_rows=256 if K > 256 else 0)
    before = pw.data.copy()
    blocks = lowbit.io.to_gguf(pw, qtype)
    assert blocks.shape == (N, K // 256 * lowbit.io.gguf.TYPES[qtype]) and blocks.dtype == np.uint8
    back = lowbit.io.from_gguf(blocks, (K, N), qtype)
    assert_equal("data", pw.data, back.data)
    assert_equal("scale", pw.scale, back.scale)
    assert_equal("input", before, pw.data)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("K, N", [(256, 3), (768, 37)])
def test_export_equals_the_gguf_quantizer(codec, rng, qtype, K, N, gguf):
    """lowbit's bytes are gguf.quants.quantize's for the (N, K) transpose, zero blocks included;
    the package's dequantization of them is pw.dequantize() with the scale rounded to fp16."""
    w = rng.standard_normal((K, N)).astype(np.float32)
    w[:256, : N // 2] = 0.0  # all-zero blocks: ggml writes scale 0 there
    pw = lowbit.quantize_weight(w, "ternary")
    kind = gguf.GGMLQuantizationType[qtype]
    ours = lowbit.io.to_gguf(pw, qtype)
    ref = gguf.quants.quantize(np.ascontiguousarray(pw.dequantize().T), kind)
    assert_equal("blocks", ref, ours)
    deq = gguf.quants.dequantize(ours, kind)
    assert_equal("dequantized", pw.codes().T.astype(np.float32) * fp16(pw.scale), deq)
    assert_close("dequantized vs pw", pw.dequantize().T, deq, rtol=2.0**-11)


@pytest.mark.parametrize("qtype", QTYPES)
def test_import_of_the_gguf_quantizer(codec, rng, qtype, gguf):
    pw = ternary(rng, 512, 5, zero_rows=256)
    ref = gguf.quants.quantize(np.ascontiguousarray(pw.dequantize().T),
                               gguf.GGMLQuantizationType[qtype])
    back = lowbit.io.from_gguf(ref, (512, 5), qtype)
    assert_equal("codes", pw.codes(), back.codes())
    assert_equal("scale", pw.scale, back.scale)


@pytest.mark.parametrize("qtype", QTYPES)
def test_inexact_scale_is_rounded_to_fp16(codec, rng, qtype):
    pw = ternary(rng, 256, 4, scale=0.1)
    back = lowbit.io.from_gguf(lowbit.io.to_gguf(pw, qtype), (256, 4), qtype)
    assert_equal("codes", pw.codes(), back.codes())
    assert back.scale == fp16(0.1) and abs(back.scale / np.float32(0.1) - 1) <= 2.0**-11


@pytest.mark.parametrize("qtype", QTYPES)
def test_packed_matmul_on_an_imported_weight(codec, rng, qtype):
    pw = ternary(rng, 512, 7)
    imported = lowbit.io.from_gguf(lowbit.io.to_gguf(pw, qtype), (512, 7), qtype)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    assert_equal("y", lowbit.packed_matmul(x, pw), lowbit.packed_matmul(x, imported))


def test_all_zero_weight_gets_the_scale_floor(codec, rng):
    pw = ternary(rng, 256, 2, zero_rows=256)
    blocks = lowbit.io.to_gguf(pw, "TQ2_0")
    assert not blocks[:, 64:].any()  # ggml's scale of an all-zero block is 0
    back = lowbit.io.from_gguf(blocks, (256, 2), "TQ2_0")
    assert back.scale == np.float32(lowbit.ops.quantize.EPS) and not back.codes().any()


@pytest.mark.parametrize("qtype", QTYPES)
def test_different_block_scales(codec, rng, qtype, gguf):
    """gguf's quantizer on a non-ternary weight gives one absmax per block: refused, or
    re-ternarized by lowbit's rule with the relative error reported."""
    w = rng.standard_normal((512, 3)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(np.ascontiguousarray(w.T), kind)
    with pytest.raises(ValueError, match="different scales"):
        lowbit.io.from_gguf(blocks, (512, 3), qtype)
    with pytest.warns(UserWarning, match="relative error"):
        pw = lowbit.io.from_gguf(blocks, (512, 3), qtype, requantize=True)
    ref = lowbit.quantize_weight(np.ascontiguousarray(gguf.quants.dequantize(blocks, kind).T),
                                 "ternary")
    assert_equal("codes", ref.codes(), pw.codes())
    assert_equal("scale", ref.scale, pw.scale)


def _tq2_with(value_at, rng):
    blocks = lowbit.io.to_gguf(ternary(rng, 256, 2), "TQ2_0")
    value_at(blocks)
    return blocks


BAD_EXPORTS = {
    "qtype": (lambda pw: lowbit.io.to_gguf(pw, "TQ3_0"), ValueError, "qtype"),
    "not packed": (lambda pw: lowbit.io.to_gguf(pw.dequantize(), "TQ2_0"), TypeError, "pw"),
    "format": (lambda pw: lowbit.io.to_gguf(
        lowbit.quantize_weight(pw.dequantize(), "int8"), "TQ2_0"), ValueError, "format"),
    "K": (lambda pw: lowbit.io.to_gguf(lowbit.ops.quantize.weight_rows(pw, 0, 300), "TQ1_0"),
          ValueError, "K = 300"),
    "scale overflows fp16": (lambda pw: lowbit.io.to_gguf(lowbit.PackedWeight(
        "ternary", pw.shape, pw.data, np.asarray(1e6, np.float32)), "TQ2_0"), ValueError, "fp16"),
    "scale underflows fp16": (lambda pw: lowbit.io.to_gguf(lowbit.PackedWeight(
        "ternary", pw.shape, pw.data, np.asarray(1e-9, np.float32)), "TQ2_0"), ValueError,
        "fp16"),
    "field 3": (lambda pw: lowbit.io.to_gguf(lowbit.PackedWeight(
        "ternary", pw.shape, pw.data | np.uint8(3), pw.scale), "TQ2_0"), ValueError, "value 3"),
}


@pytest.mark.parametrize("case", BAD_EXPORTS)
def test_bad_export(codec, rng, case):
    fn, exc, match = BAD_EXPORTS[case]
    pw = ternary(rng, 512, 3)
    with pytest.raises(exc, match=match):
        fn(pw)


def _set_scale_inf(blocks):
    blocks[0, 64:66] = np.array([0x7C00], "<u2").view(np.uint8)


BAD_IMPORTS = {
    "qtype": (lambda b: lowbit.io.from_gguf(b, (256, 2), "Q4_0"), ValueError, "qtype"),
    "not an array": (lambda b: lowbit.io.from_gguf(b.tolist(), (256, 2)), TypeError, "data"),
    "truncated": (lambda b: lowbit.io.from_gguf(b[:, :-1], (256, 2)), ValueError, "data"),
    "oversized": (lambda b: lowbit.io.from_gguf(np.hstack([b, b]), (256, 2)), ValueError, "data"),
    "shape vs bytes": (lambda b: lowbit.io.from_gguf(b, (512, 2)), ValueError, "data"),
    "rows": (lambda b: lowbit.io.from_gguf(b, (256, 3)), ValueError, "data"),
    "dtype": (lambda b: lowbit.io.from_gguf(b.view(np.int8), (256, 2)), ValueError, "uint8"),
    "K": (lambda b: lowbit.io.from_gguf(b, (300, 2)), ValueError, "K = 300"),
    "shape": (lambda b: lowbit.io.from_gguf(b, (256,)), ValueError, "shape"),
    "non-finite scale": (lambda b: (_set_scale_inf(b), lowbit.io.from_gguf(b, (256, 2))),
                         ValueError, "non-finite"),
    "field 3": (lambda b: (b.__setitem__((1, 5), 0xFF), lowbit.io.from_gguf(b, (256, 2))),
                ValueError, "value 3"),
}


@pytest.mark.parametrize("case", BAD_IMPORTS)
def test_bad_import(codec, rng, case):
    fn, exc, match = BAD_IMPORTS[case]
    blocks = lowbit.io.to_gguf(ternary(rng, 256, 2), "TQ2_0")
    with pytest.raises(exc, match=match):
        fn(blocks)


# -- files ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_save_gguf_reads_back_through_the_gguf_reader(rng, tmp_path, qtype, gguf):
    pw = ternary(rng, 512, 3)
    dense = {"norm": rng.standard_normal(7).astype(np.float32),
             "emb": rng.standard_normal((4, 6)).astype(np.float16),
             "ids": np.arange(5, dtype=np.int32)}
    path = tmp_path / "m.gguf"
    lowbit.io.save_gguf(path, {"w": pw, **dense}, arch="bdh", qtype=qtype)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["w"].tensor_type == gguf.GGMLQuantizationType[qtype]
    assert [int(d) for d in tensors["w"].shape] == [512, 3]  # ne = [K, N]
    assert_equal("w blocks", lowbit.io.to_gguf(pw, qtype), np.array(tensors["w"].data))
    assert tensors["norm"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["emb"].tensor_type == gguf.GGMLQuantizationType.F16
    assert [int(d) for d in tensors["emb"].shape] == [6, 4]
    loaded = lowbit.io.load_gguf(path)
    assert set(loaded) == {"w", *dense}
    assert_equal("w", pw.data, loaded["w"].data)
    assert_equal("w scale", pw.scale, loaded["w"].scale)
    for name, arr in dense.items():
        assert_equal(name, arr, loaded[name])


def test_save_gguf_is_atomic(rng, tmp_path, monkeypatch, gguf):
    path = tmp_path / "m.gguf"
    lowbit.io.save_gguf(path, {"w": ternary(rng, 256, 2)})
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"tensors\['bad'\].*K = 300"):
        lowbit.io.save_gguf(path, {"w": ternary(rng, 256, 2), "bad": ternary(rng, 300, 2)})

    def fail(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="disk full"):
        lowbit.io.save_gguf(path, {"w": ternary(rng, 256, 2)})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.gguf"]


def test_bad_gguf_files(rng, tmp_path, gguf):
    good = tmp_path / "good.gguf"
    lowbit.io.save_gguf(good, {"w": ternary(rng, 512, 2)})
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated.gguf"):
        lowbit.io.load_gguf(truncated)
    # A ternary tensor whose ne does not match its block count: K = 300 is no whole block.
    wrong = tmp_path / "wrong.gguf"
    writer = gguf.GGUFWriter(wrong, "lowbit")
    writer.add_tensor("w", np.zeros((2, 66), np.int8), raw_shape=(2, 300),
                      raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="wrong.gguf|block"):
        lowbit.io.load_gguf(wrong)


def test_gguf_functions_say_which_extra_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r'pip install "lowbit\[io\]"'):
        lowbit.io.save_gguf(tmp_path / "x.gguf", {})
    with pytest.raises(ImportError, match=r'pip install "lowbit\[io\]"'):
        lowbit.io.load_gguf(tmp_path / "x.gguf")


def unaligned(a):
    """A copy of ``a`` whose data starts one byte past an allocation (no word alignment)."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = buf[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("qtype", QTYPES)
def test_unaligned_and_strided_inputs(codec, rng, qtype):
    pw = ternary(rng, 512, 5)
    blocks = lowbit.io.to_gguf(pw, qtype)
    odd = lowbit.PackedWeight("ternary", pw.shape, unaligned(pw.data), pw.scale)
    assert_equal("export", blocks, lowbit.io.to_gguf(odd, qtype))
    assert_equal("import", pw.data, lowbit.io.from_gguf(unaligned(blocks), (512, 5), qtype).data)
    wide = np.zeros((5, 2 * blocks.shape[1]), np.uint8)
    wide[:, ::2] = blocks
    assert_equal("strided", pw.data, lowbit.io.from_gguf(wide[:, ::2], (512, 5), qtype).data)


def test_gguf_files_of_other_writers(rng, tmp_path, gguf):
    """Files written by the gguf package alone: a non-ternarized TQ2_0 weight (per-block scales)
    and a 1-d one."""
    kind = gguf.GGMLQuantizationType.TQ2_0
    w = rng.standard_normal((3, 512)).astype(np.float32)  # (N, K): ne = [512, 3]
    for name, arr in (("blocks", w), ("flat", w[0])):
        path = tmp_path / f"{name}.gguf"
        writer = gguf.GGUFWriter(path, "other")
        writer.add_tensor("w", gguf.quants.quantize(arr, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    with pytest.raises(ValueError, match="tensor 'w': data: the blocks carry different scales"):
        lowbit.io.load_gguf(tmp_path / "blocks.gguf")
    with pytest.warns(UserWarning, match="relative error"):
        pw = lowbit.io.load_gguf(tmp_path / "blocks.gguf", requantize=True)["w"]
    assert pw.shape == (512, 3)
    with pytest.raises(ValueError, match="must be 2-d"):
        lowbit.io.load_gguf(tmp_path / "flat.gguf")
