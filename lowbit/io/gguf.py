"""GGUF's ternary types (llama.cpp's TQ1_0 and TQ2_0): ``to_gguf`` / ``from_gguf`` on arrays,
``save_gguf`` / ``load_gguf`` on files (through the ``gguf`` package's writer and reader).

Siblings: ``_numpy.py`` / ``_numba.py`` (the block layouts and the conversions), ``_codecs.py``,
``_files.py`` (atomic writes); tests ``tests/test_io_gguf.py`` (oracle: ``gguf.quants``); speed
``bench/io.py``.

Axes: ggml's blocks run along the contiguous axis ``ne[0]``, which is lowbit's K, so a lowbit
``(K, N)`` weight is ggml's ``ne = [K, N]``: one row of ``K / 256`` blocks per output feature,
the byte array ``gguf.quants.quantize`` returns for the ``(N, K)`` transpose of the weight.

Scales: ggml keeps one fp16 scale per block (its absmax), lowbit one float32 scale per tensor.
"""

from __future__ import annotations

import os
import warnings

from typing import Any

import numpy as np

from .._typing import Array
from ..ops.quantize import EPS, PackedWeight, quantize_weight
from ._codecs import codecs, host_buffer, host_ternary
from ._files import StrPath, atomic_path
from ._numpy import QK, TQ1_BYTES, TQ2_BYTES

#: The ternary types and their bytes per 256-element block.
TYPES = {"TQ1_0": TQ1_BYTES, "TQ2_0": TQ2_BYTES}
_FP16_EXP = 0x7C00  # an fp16 whose exponent bits are all set is inf or NaN
_DENSE = (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64)


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ImportError('GGUF files need the gguf package: pip install "lowbit[io]"') from None
    return gguf


def _qtype(qtype: object, name: str = "qtype") -> str:
    if not isinstance(qtype, str) or qtype not in TYPES:
        raise ValueError(f"{name} must be one of {tuple(TYPES)}, got {qtype!r}")
    return qtype


def _fp16_bits(scale: Array, name: str) -> int:
    with np.errstate(over="ignore"):
        half = np.float16(np.float32(scale))
    if not np.isfinite(half) or half == 0:
        raise ValueError(f"{name}.scale = {float(scale)!r} is not representable in fp16 (GGUF's "
                         f"block scale): it rounds to {float(half)}")
    return int(half.view(np.uint16))


def to_gguf(pw: PackedWeight, qtype: str = "TQ2_0") -> np.ndarray:
    """A ternary weight in ggml's blocks.

    Every block that holds a non-zero code gets the tensor scale rounded to fp16 (an all-zero
    block gets 0, as ggml's own quantizer writes), so the dequantized weight changes by the fp16
    rounding of the scale: a relative error of at most 2^-11 (4.9e-4) for a scale in fp16's
    normal range [6.1e-5, 65504], more for smaller (subnormal) scales.

    Args:
        pw: ternary ``PackedWeight`` of shape ``(K, N)`` on the host, K a multiple of 256.
        qtype: "TQ2_0" (66 bytes a block) or "TQ1_0" (54 bytes a block).

    Returns:
        [N, K // 256 * bytes_per_block] uint8, the bytes ggml stores for ``ne = [K, N]``.

    Raises:
        TypeError: ``pw`` is not a host ``PackedWeight``.
        ValueError: unknown ``qtype``, not ternary, K not a multiple of 256, a scale that fp16
            cannot hold, a 2-bit field holding 3.
    """
    qtype = _qtype(qtype)
    pw = host_ternary(pw)
    K, N = pw.shape
    if K % QK:
        raise ValueError(f"pw.shape[0] = K = {K} must be a multiple of {QK}: ggml's {qtype} "
                         "blocks cannot represent it")
    d16 = _fp16_bits(pw.scale, "pw")
    impl = codecs(pw.data)
    out, flags = (impl.to_tq2 if qtype == "TQ2_0" else impl.to_tq1)(pw.data, K // QK, d16)
    if (flags & 2).any():
        raise ValueError("pw.data holds the 2-bit value 3, which is no ternary code")
    return out


def from_gguf(data: np.ndarray, shape: tuple[int, int], qtype: str = "TQ2_0", *,
              requantize: bool = False) -> PackedWeight:
    """A ternary weight from ggml's blocks.

    Exact when every block holding a non-zero code carries the same fp16 scale (as a ternarized
    BitNet checkpoint does): that scale becomes the tensor's float32 scale. Blocks of zeros may
    carry any finite scale.

    Args:
        data: [N, K // 256 * bytes_per_block] uint8 (host), e.g. ``gguf.quants.quantize`` of the
            ``(N, K)`` weight.
        shape: ``(K, N)`` of the weight (ggml's ``ne``), K a multiple of 256.
        qtype: "TQ2_0" or "TQ1_0".
        requantize: where block scales differ, dequantize, re-ternarize with lowbit's rule
            (``quantize_weight``) and warn with the relative error instead of raising.

    Returns:
        ternary ``PackedWeight`` of shape ``(K, N)``.

    Raises:
        TypeError: ``data`` is not a numpy array.
        ValueError: unknown ``qtype``, a bad ``shape``, ``data`` whose dtype or shape does not
            match ``shape`` (truncated or oversized), non-finite scales, a TQ2_0 field holding 3,
            block scales that differ (without ``requantize``).
    """
    qtype = _qtype(qtype)
    K, N = host_buffer(data, "data", shape)
    if K % QK:
        raise ValueError(f"shape[0] = K = {K} must be a multiple of {QK} for {qtype}")
    nb = K // QK
    want = (N, nb * TYPES[qtype])
    if data.dtype != np.uint8 or data.shape != want:
        raise ValueError(f"data must be uint8 of shape {want} ({nb} {qtype} blocks of "
                         f"{TYPES[qtype]} bytes per row) for shape {(K, N)}, got {data.dtype} "
                         f"{data.shape}")
    data = np.ascontiguousarray(data)
    impl = codecs(data)
    packed, flags, bits = (impl.from_tq2 if qtype == "TQ2_0" else impl.from_tq1)(data, nb)
    if ((bits & _FP16_EXP) == _FP16_EXP).any():
        raise ValueError("data holds non-finite block scales")
    if (flags & 2).any():
        raise ValueError("data holds the TQ2_0 2-bit value 3, which is no ternary code")
    nonzero = (flags & 1).astype(bool)
    if not nonzero.any():  # all codes zero: any scale gives this weight; take quantize_weight's
        return PackedWeight("ternary", (K, N), packed, np.asarray(EPS, dtype=np.float32))
    used = bits[nonzero]
    if (used == used[0]).all():
        scale = used[:1].view(np.float16).astype(np.float32)[0]
        return PackedWeight("ternary", (K, N), packed, np.asarray(scale, dtype=np.float32))
    scales = bits.view(np.float16).astype(np.float32)
    used = scales[nonzero]
    if not requantize:
        raise ValueError(f"data: the blocks carry different scales ({used.min()} to "
                         f"{used.max()}), which one lowbit tensor scale cannot hold; pass "
                         "requantize=True to re-ternarize")
    codes = PackedWeight("ternary", (K, N), packed, np.asarray(1.0, dtype=np.float32)).codes()
    w = codes.astype(np.float32) * np.repeat(scales, QK, axis=1).T
    pw = quantize_weight(w, "ternary")
    err = float(np.linalg.norm(pw.dequantize().astype(np.float64) - w)
                / max(np.linalg.norm(w.astype(np.float64)), np.finfo(np.float64).tiny))
    warnings.warn(f"from_gguf: block scales differ; re-ternarized with relative error {err:.4g}",
                  stacklevel=2)
    return pw


def save_gguf(path: StrPath, tensors: dict[str, PackedWeight | np.ndarray], arch: str = "lowbit",
              qtype: str = "TQ2_0") -> None:
    """Write a GGUF file, atomically (the previous file stays intact on any error).

    Args:
        path: destination file.
        tensors: name -> ternary ``PackedWeight`` (written as ``qtype`` with ``ne = [K, N]``) or
            numpy array of float16/32/64 or int8/16/32/64 (written as is: ggml's ``ne`` is the
            reversed numpy shape).
        arch: ``general.architecture``.
        qtype: "TQ2_0" or "TQ1_0", for every ternary tensor.

    Raises:
        ImportError: the ``gguf`` package is missing (``pip install "lowbit[io]"``).
        TypeError / ValueError: as ``to_gguf``, naming ``tensors[name]``; an unsupported array.
    """
    gguf = _gguf()
    qtype = _qtype(qtype)
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict, got {type(tensors).__name__}")
    # everything converted and checked before the file is opened
    prepared: list[tuple[str, np.ndarray, Any]] = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensors: names must be non-empty strings, got {name!r}")
        if isinstance(value, PackedWeight):
            try:
                prepared.append((name, to_gguf(value, qtype),
                                 gguf.GGMLQuantizationType[qtype]))
            except (TypeError, ValueError) as exc:
                raise exc.__class__(f"tensors[{name!r}]: {exc}") from None
        elif isinstance(value, np.ndarray) and value.dtype.type in _DENSE:
            prepared.append((name, np.ascontiguousarray(value), None))
        else:
            raise TypeError(f"tensors[{name!r}] must be a ternary PackedWeight or a numpy array "
                            f"of {[np.dtype(d).name for d in _DENSE]}, got "
                            f"{getattr(value, 'dtype', value.__class__.__name__)}")
    with atomic_path(path, ".gguf") as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        for name, arr, raw in prepared:
            writer.add_tensor(name, arr, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def load_gguf(path: StrPath, *, requantize: bool = False) -> dict[str, PackedWeight | np.ndarray]:
    """Read a GGUF file's tensors.

    Returns:
        name -> ternary ``PackedWeight`` (TQ1_0, TQ2_0 tensors, through ``from_gguf``) or numpy
        array (dense types as stored; other quantized types dequantized to float32 by
        ``gguf.quants``), each in numpy's axis order (the reverse of ``ne``).

    Raises:
        ImportError: the ``gguf`` package is missing.
        ValueError: a file the reader rejects (truncated, malformed, a ternary tensor whose
            ``ne[0]`` is no whole number of blocks), a ternary tensor that is not 2-d or that
            ``from_gguf`` rejects (the message names the tensor).
    """
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except OSError:
        raise
    except Exception as exc:  # the reader raises assorted errors on malformed files
        raise ValueError(f"path {os.fspath(path)!r} is not a readable GGUF file: {exc}") from None
    out: dict[str, PackedWeight | np.ndarray] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        ne = [int(d) for d in t.shape]
        if kind in TYPES:
            if len(ne) != 2:
                raise ValueError(f"tensor {t.name!r}: a {kind} weight must be 2-d, got ne={ne}")
            try:
                out[t.name] = from_gguf(np.array(t.data, dtype=np.uint8), (ne[0], ne[1]), kind,
                                        requantize=requantize)
            except ValueError as exc:
                raise ValueError(f"tensor {t.name!r}: {exc}") from None
        elif t.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32,
                               gguf.GGMLQuantizationType.F64, gguf.GGMLQuantizationType.I8,
                               gguf.GGMLQuantizationType.I16, gguf.GGMLQuantizationType.I32,
                               gguf.GGMLQuantizationType.I64):
            out[t.name] = np.array(t.data).reshape(ne[::-1])
        else:
            out[t.name] = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
    return out
