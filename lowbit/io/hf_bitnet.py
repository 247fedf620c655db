"""Hugging Face BitNet packed weights (transformers' ``integrations/bitnet.py``):
``to_hf_bitnet`` / ``from_hf_bitnet`` on arrays, ``load_hf_bitnet`` on a safetensors checkpoint.

Siblings: ``_numpy.py`` / ``_numba.py`` (the conversions), ``safetensors.py`` (the reader, no
torch needed); tests ``tests/test_io_hf_bitnet.py``; speed ``bench/io.py``.

The layout (transformers' ``pack_weights`` / ``unpack_weights``): a linear layer's weight of
``out_features x in_features`` (lowbit's ``(K, N)`` transposed: ``N = out_features``) is held
as uint8 ``[R, in_features]`` with ``R = ceil(out_features / 4)``; output ``n`` is the 2-bit
field ``n // R`` (LSB first) of row ``n % R``, holding ``code + 1``; the fields of missing
outputs (``out_features`` not a multiple of 4) are 0.

The scale (``weight_scale``, one value) has two conventions:

- ``"bitlinear"`` (``BitLinear``, the default): the layer computes ``y = (x @ codes.T) /
  weight_scale``, so ``weight_scale`` is the reciprocal of lowbit's scale.
- ``"autobitlinear"`` (``AutoBitLinear`` with offline quantization): ``y = (x @ codes.T) *
  weight_scale``, lowbit's scale itself.
"""

from __future__ import annotations

import numpy as np

from ..ops.quantize import PackedWeight
from ._codecs import codecs, host_buffer, host_ternary
from ._files import StrPath
from .safetensors import read_file

CONVENTIONS = ("bitlinear", "autobitlinear")


def _convention(convention: object) -> str:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    return str(convention)


def to_hf_bitnet(pw: PackedWeight,
                 convention: str = "bitlinear") -> tuple[np.ndarray, np.ndarray]:
    """A ternary weight in transformers' BitNet layout.

    Args:
        pw: ternary ``PackedWeight`` of shape ``(K, N)`` on the host.
        convention: "bitlinear" or "autobitlinear" (see the module docstring).

    Returns:
        ``(packed, weight_scale)``: [ceil(N / 4), K] uint8 and a [1] array: "bitlinear" gives
        ``1 / scale`` in float64 (so that reading it back gives the float32 scale bitwise; cast it
        to the model's dtype as transformers does on load), "autobitlinear" the float32 scale.

    Raises:
        TypeError: ``pw`` is not a host ``PackedWeight``.
        ValueError: not ternary, a zero scale ("bitlinear"), a 2-bit field holding 3.
    """
    convention = _convention(convention)
    pw = host_ternary(pw)
    K, _ = pw.shape
    scale = np.float32(pw.scale)
    if convention == "bitlinear" and scale == 0:
        raise ValueError("pw.scale is 0, whose reciprocal (BitLinear's weight_scale) is infinite")
    packed, bad = codecs(pw.data).to_hf(pw.data, K)
    if bad:
        raise ValueError("pw.data holds the 2-bit value 3, which is no ternary code")
    if convention == "bitlinear":
        return packed, np.array([1.0 / np.float64(scale)], dtype=np.float64)
    return packed, np.array([scale], dtype=np.float32)


def from_hf_bitnet(packed: np.ndarray, weight_scale: np.ndarray | float, shape: tuple[int, int],
                   convention: str = "bitlinear") -> PackedWeight:
    """A ternary weight from transformers' BitNet layout.

    Args:
        packed: [ceil(N / 4), K] uint8 (host).
        weight_scale: one finite non-zero float (a float array of size 1 or a Python float).
        shape: ``(K, N)`` = ``(in_features, out_features)``.
        convention: "bitlinear" (lowbit's scale is ``1 / weight_scale``, rounded once to
            float32) or "autobitlinear" (the scale is ``weight_scale`` in float32).

    Returns:
        ternary ``PackedWeight`` of shape ``(K, N)``; the padding fields are ignored.

    Raises:
        TypeError: ``packed`` is not a numpy array.
        ValueError: unknown ``convention``, a bad ``shape``, ``packed`` whose dtype or shape does
            not match ``shape``, a bad ``weight_scale``, a 2-bit field holding 3.
    """
    convention = _convention(convention)
    K, N = host_buffer(packed, "packed", shape)
    want = (-(-N // 4), K)
    if packed.dtype != np.uint8 or packed.shape != want:
        raise ValueError(f"packed must be uint8 of shape {want} (ceil(N / 4), K) for shape "
                         f"{(K, N)}, got {packed.dtype} {packed.shape}")
    ws = np.asarray(weight_scale)
    if ws.dtype.kind != "f" or ws.size != 1:
        raise ValueError(f"weight_scale must be one float, got {ws.dtype} of shape {ws.shape}")
    ws = np.float64(ws.reshape(()))
    if not np.isfinite(ws) or ws == 0:
        raise ValueError(f"weight_scale must be finite and non-zero, got {ws}")
    data, bad = codecs(packed).from_hf(np.ascontiguousarray(packed), N)
    if bad:
        raise ValueError("packed holds the 2-bit value 3, which is no ternary code")
    scale = 1.0 / ws if convention == "bitlinear" else ws
    return PackedWeight("ternary", (K, N), data, np.asarray(scale, dtype=np.float32))


def load_hf_bitnet(path: StrPath, convention: str = "bitlinear",
                   out_features: dict[str, int] | None = None
                   ) -> dict[str, PackedWeight | np.ndarray]:
    """Read a Hugging Face BitNet safetensors checkpoint, without torch.

    A BitLinear layer is a uint8 ``<prefix>weight`` beside a ``<prefix>weight_scale``; it becomes
    one ``PackedWeight`` under the weight's name (the scale is folded in). Every other tensor
    comes back as a numpy array (bf16 decoded exactly to float32).

    Args:
        path: the ``.safetensors`` file.
        convention: "bitlinear" or "autobitlinear" (see the module docstring).
        out_features: weight name -> out_features where it is not 4 x the packed rows (the
            packing cannot tell ``4 R - 3 .. 4 R`` apart).

    Returns:
        name -> ``PackedWeight`` or numpy array.

    Raises:
        ValueError: a malformed file (see ``safetensors.read_file``), or a layer that
            ``from_hf_bitnet`` rejects (the message names it).
    """
    convention = _convention(convention)
    arrays, _ = read_file(path)
    out_features = dict(out_features or {})
    out: dict[str, PackedWeight | np.ndarray] = {}
    for name, arr in arrays.items():
        scale_name = name + "_scale"
        if name.endswith("weight") and arr.dtype == np.uint8 and scale_name in arrays:
            if arr.ndim != 2:
                raise ValueError(f"{name!r}: a packed BitLinear weight must be 2-d, got shape "
                                 f"{arr.shape}")
            N = out_features.pop(name, 4 * arr.shape[0])
            try:
                out[name] = from_hf_bitnet(arr, arrays[scale_name], (arr.shape[1], N), convention)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name!r}: {exc}") from None
        elif not (name.endswith("weight_scale") and name[:-len("_scale")] in arrays
                  and arrays[name[:-len("_scale")]].dtype == np.uint8):
            out[name] = arr
    if out_features:
        raise ValueError(f"out_features names layers that are not in the file: "
                         f"{sorted(out_features)}")
    return out
