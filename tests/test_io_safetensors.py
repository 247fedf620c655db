"""lowbit's own checkpoints (``lowbit/io/safetensors.py``): the ``safetensors`` package is the
oracle (lowbit's files load there, its files load here), PackedWeights round trip, writes are
atomic, and headers that lie are refused.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import lowbit
import lowbit.io
from lowbit import _backend
from lowbit.io import safetensors as lst
from helpers import assert_equal

DTYPES = (np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.float16, np.uint32, np.int32,
          np.float32, np.uint64, np.int64, np.float64)


@pytest.fixture
def st_numpy():
    return pytest.importorskip("safetensors.numpy", reason='pip install "lowbit[io]"')


def arrays(rng):
    out = {f"a/{np.dtype(d).name}": (rng.standard_normal((3, 5)) * 50).astype(d) for d in DTYPES}
    out["scalar"] = np.asarray(2.5, np.float32)
    out["empty"] = np.zeros((0, 4), np.float32)
    return out


def weights(rng):
    w = rng.standard_normal((37, 5)).astype(np.float32)
    return {f"pw/{f}": lowbit.quantize_weight(w, f) for f in ("ternary", "sign", "int8")}


def test_round_trip(rng, tmp_path):
    tensors = {**arrays(rng), **weights(rng)}
    tensors["fortran"] = np.asfortranarray(rng.standard_normal((4, 3)))
    tensors["strided"] = rng.standard_normal(10)[::-3]
    tensors["big-endian"] = np.arange(6, dtype=">i4")
    path = tmp_path / "c.safetensors"
    lowbit.io.save(path, tensors, metadata={"note": "hello"})
    loaded, meta = lowbit.io.load(path, with_metadata=True)
    assert meta == {"note": "hello"} and set(loaded) == set(tensors)
    for name, value in tensors.items():
        if isinstance(value, lowbit.PackedWeight):
            got = loaded[name]
            assert (got.format, got.shape) == (value.format, value.shape)
            assert_equal(name + ".data", value.data, got.data)
            assert_equal(name + ".scale", value.scale, got.scale)
        else:
            assert_equal(name, value.astype(value.dtype.newbyteorder("=")), loaded[name])
    assert all(v.flags.writeable for v in loaded.values() if isinstance(v, np.ndarray))
    head = path.read_bytes()
    assert (8 + int.from_bytes(head[:8], "little")) % 8 == 0  # the data starts 8-byte aligned


def test_the_safetensors_package_reads_our_files(rng, tmp_path, st_numpy):
    tensors = {**arrays(rng), **weights(rng)}
    path = tmp_path / "c.safetensors"
    lowbit.io.save(path, tensors)
    theirs = st_numpy.load_file(str(path))
    for name, value in tensors.items():
        if isinstance(value, lowbit.PackedWeight):
            assert_equal(name, value.data, theirs[name])
            assert_equal(name + lst.SCALE_SUFFIX, value.scale, theirs[name + lst.SCALE_SUFFIX])
        else:
            assert_equal(name, value, theirs[name])


def test_we_read_the_safetensors_package_files(rng, tmp_path, st_numpy):
    tensors = arrays(rng)
    path = tmp_path / "theirs.safetensors"
    st_numpy.save_file(tensors, str(path), metadata={"format": "np"})
    loaded, meta = lowbit.io.load(path, with_metadata=True)
    assert meta == {"format": "np"}
    for name, value in tensors.items():
        assert_equal(name, value, loaded[name])


@pytest.mark.skipif(_backend.cuda_device_count() == 0, reason="needs cupy and a CUDA device")
def test_load_onto_the_gpu(rng, tmp_path):
    import cupy

    tensors = {"x": rng.standard_normal(4).astype(np.float32), **weights(rng)}
    path = tmp_path / "c.safetensors"
    lowbit.io.save(path, tensors)
    loaded = lowbit.io.load(path, xp=cupy)
    assert isinstance(loaded["x"], cupy.ndarray)
    assert isinstance(loaded["pw/ternary"].data, cupy.ndarray)
    assert isinstance(loaded["pw/ternary"].scale, cupy.ndarray)
    lowbit.io.save(path, loaded)  # cupy-held tensors are written from the host copy
    assert_equal("x", tensors["x"], lowbit.io.load(path)["x"])


def test_a_failed_save_leaves_the_previous_file(rng, tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    lowbit.io.save(path, arrays(rng))
    before = path.read_bytes()
    calls = []

    def half_then_fail(f, arr):
        calls.append(arr.nbytes)
        if len(calls) == 3:
            f.write(arr.reshape(-1).view(np.uint8)[: arr.nbytes // 2].data)
            raise KeyboardInterrupt
        f.write(arr.reshape(-1).view(np.uint8).data)

    monkeypatch.setattr(lst, "_write_array", half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        lowbit.io.save(path, {**arrays(rng), "more": np.ones(9)})
    monkeypatch.undo()

    def no_rename(*args):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="rename failed"):
        lowbit.io.save(path, arrays(rng))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.safetensors"]


def _file(header: dict, data: bytes, pad=True) -> bytes:
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text + data


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
BAD_FILES = {
    "overlap": (_file({"a": F32x2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                      bytes(12)), "overlaps"),
    "gap": (_file({"a": F32x2, "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}},
                  bytes(16)), "gap"),
    "out of range": (_file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                           bytes(8)), "cover 16 bytes"),
    "trailing bytes": (_file({"a": F32x2}, bytes(12)), "trailing"),
    "truncated": (_file({"a": F32x2}, bytes(8))[:-3], "truncated"),
    "dtype vs bytes": (_file({"a": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}},
                             bytes(8)), "takes 16"),
    "shape vs bytes": (_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                             bytes(8)), "takes 12"),
    "unknown dtype": (_file({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}},
                            bytes(8)), "unknown dtype"),
    "negative offsets": (_file({"a": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}},
                               bytes(0)), "data_offsets"),
    "bad shape": (_file({"a": {"dtype": "U8", "shape": [-8], "data_offsets": [0, 8]}},
                        bytes(8)), "shape"),
    "extra keys": (_file({"a": dict(F32x2, extra=1)}, bytes(8)), "exactly"),
    "metadata": (_file({"__metadata__": {"a": 1}, "a": F32x2}, bytes(8)), "__metadata__"),
    "header length": ((10**6).to_bytes(8, "little") + b"{}", "header length"),
    "not json": (b"\x04\x00\x00\x00\x00\x00\x00\x00{abc", "not JSON"),
    "too short": (b"\x01\x00", "shorter"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_lying_header_is_refused(tmp_path, case):
    content, match = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        lowbit.io.load(path)


def test_a_good_handmade_file_loads(tmp_path):
    """The fixture maker of the cases above, on a consistent header."""
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_file({"a": F32x2}, np.array([1.5, -2.0], "<f4").tobytes()))
    assert_equal("a", np.array([1.5, -2.0], np.float32), lowbit.io.load(path)["a"])


def test_packed_weight_metadata_is_checked(rng, tmp_path):
    path = tmp_path / "c.safetensors"
    pw = weights(rng)["pw/ternary"]
    lst.write_file(path, {"w": pw.data, "w" + lst.SCALE_SUFFIX: pw.scale},
                   {"lowbit": json.dumps({"version": 1, "packed": {
                       "w": {"format": "ternary", "shape": [41, 5]}}})})
    with pytest.raises(ValueError, match="data must be uint8 of shape"):
        lowbit.io.load(path)
    lst.write_file(path, {"w": pw.data}, {"lowbit": json.dumps({"version": 1, "packed": {
        "w": {"format": "ternary", "shape": [37, 5]}}})})
    with pytest.raises(ValueError, match="lacks"):
        lowbit.io.load(path)
    lst.write_file(path, {}, {"lowbit": json.dumps({"version": 99, "packed": {}})})
    with pytest.raises(ValueError, match="version 99"):
        lowbit.io.load(path)


BAD_SAVES = {
    "not a dict": (lambda rng: [np.ones(2)], TypeError, "tensors"),
    "not an array": (lambda rng: {"a": [1.0]}, TypeError, r"tensors\['a'\]"),
    "dtype": (lambda rng: {"a": np.ones(2, np.complex64)}, ValueError, "complex64"),
    "name": (lambda rng: {"": np.ones(2)}, ValueError, "name"),
    "scale name clash": (lambda rng: {**weights(rng), "pw/int8:scale": np.ones(2)}, ValueError,
                         "used twice"),
}


@pytest.mark.parametrize("case", BAD_SAVES)
def test_bad_save(rng, tmp_path, case):
    make, exc, match = BAD_SAVES[case]
    with pytest.raises(exc, match=match):
        lowbit.io.save(tmp_path / "c.safetensors", make(rng))
    with pytest.raises(ValueError, match="reserved"):
        lowbit.io.save(tmp_path / "c.safetensors", {}, metadata={"lowbit": "x"})
    with pytest.raises(TypeError, match="metadata"):
        lowbit.io.save(tmp_path / "c.safetensors", {}, metadata={"n": 1})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("entry", ["{not json", '{"version": 1}', '{"version": 1, "packed": '
                                   '{"w": {"shape": [4, 4]}}}'])
def test_a_malformed_lowbit_entry_is_refused(tmp_path, entry):
    path = tmp_path / "c.safetensors"
    lst.write_file(path, {"w": np.zeros((4, 1), np.uint8), "w:scale": np.ones((), np.float32)},
                   {"lowbit": entry})
    with pytest.raises(ValueError, match="lowbit|format or shape"):
        lowbit.io.load(path)
