"""Low-bit weight and activation formats: ``quantize_weight`` -> ``PackedWeight``,
``quantize_activation`` -> ``QuantizedActivation``, and the straight-through fake quantizers.

Backends: ``_numpy.py``, ``_numba.py``, ``_cuda.py`` (kernels in ``cuda/quantize.cu``); bit
layout through ``lowbit.pack_bits``; reference ``reference/quantize.py``; tests
``tests/test_quantize.py``. The packed matmul that consumes these lives in
``lowbit/ops/packed_matmul``.

Formats (docs/ops.rst and docs/architecture.rst): a scale is the dequantization step
(value = code x scale), codes are rounded half to even from quotients formed in the input's
dtype, scale floors use 1e-5.

- ``"ternary"`` (BitNet b1.58): ``scale = max(mean|w|, 1e-5)``, ``code = clip(rint(w / scale),
  -1, 1)``, stored as ``code + 1`` in 2 bits, 4 codes a byte.
- ``"sign"``: ``scale = max(mean|w|, 1e-5)``, ``code = +1 where w >= 0 else -1``, 1 bit a code
  (bit 1 means +1), 8 codes a byte.
- ``"int8"``: ``scale[n] = max(max_k |w[k, n]|, 1e-5) / 127`` per output column,
  ``code = clip(rint(w / scale), -127, 127)``, stored as int8.

Storage is output-major and packed along K, LSB-first: ``data.shape == (N, ceil(K / per))``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ... import _backend, _dispatch, _kernels, _validate
from ..._typing import Array
from ..pack_bits import pack_codes, packed_length

#: Weight formats and the bits each stored code takes.
WEIGHT_FORMATS = {"ternary": 2, "sign": 1, "int8": 8}
#: Weight formats and their largest code magnitude.
WEIGHT_QMAX = {"ternary": 1, "sign": 1, "int8": 127}
#: Activation formats and their largest code magnitude.
ACT_FORMATS = {"int8": 127, "int4": 7}
#: Scale floor (BitNet b1.58's), applied to the statistic before dividing by the level count.
EPS = 1e-5


def check_weight_format(value, name: str = "weight_format") -> str:
    """Validate a weight format string (``None`` is not accepted here)."""
    if not isinstance(value, str) or value not in WEIGHT_FORMATS:
        raise ValueError(f"{name} must be one of {tuple(WEIGHT_FORMATS)}, got {value!r}")
    return value


def check_act_format(value, name: str = "act_format") -> str:
    """Validate an activation format string (``None`` is not accepted here)."""
    if not isinstance(value, str) or value not in ACT_FORMATS:
        raise ValueError(f"{name} must be one of {tuple(ACT_FORMATS)}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight matrix ``W`` of shape ``(K, N)`` in a low-bit format.

    Layout: ``(K, N)`` is (in features, out features), so that ``y = x @ W`` for ``x`` of shape
    ``[..., K]``: the transpose of ``torch.nn.Linear.weight`` (``(out, in)``); pass
    ``linear.weight.T`` to ``lowbit.quantize_weight``.

    Attributes:
        format: "ternary", "sign" or "int8".
        shape: ``(K, N)`` of the dense weight.
        data: ternary/sign: [N, ceil(K / codes_per_byte)] uint8, codes LSB-first along K;
            int8: [N, K] int8 codes.
        scale: float32, a 0-d array (ternary, sign) or [N] (int8); value = code x scale.
    """

    format: str
    shape: tuple
    data: Array
    scale: Array

    @property
    def codes_per_byte(self) -> int:
        return 8 // WEIGHT_FORMATS[self.format]

    @property
    def nbytes(self) -> int:
        """Bytes of every array held (packed codes and scales)."""
        return int(self.data.itemsize * self.data.size + self.scale.itemsize * self.scale.size)

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the same weight held densely in float32: ``K * N * 4``."""
        return int(4 * self.shape[0] * self.shape[1])

    def codes(self) -> Array:
        """Signed codes [K, N] int8 (ternary {-1, 0, 1}, sign {-1, 1}, int8 [-127, 127])."""
        pw = checked_packed(self, "PackedWeight")
        _, impl = _dispatch.resolve("quantize", pw.data)
        return impl.unpack_weight(pw.data, pw.format, pw.shape[0]).T.astype(np.int8)

    def dequantize(self) -> Array:
        """float32 [K, N]: ``codes * scale``."""
        return self.codes().astype(np.float32) * self.scale.astype(np.float32)


def checked_packed(pw: PackedWeight, name: str) -> PackedWeight:
    """A PackedWeight's fields checked against its format and shape (a hand-built one could send
    the kernels past its data); returns it, with ``data`` made contiguous where it was not.
    Messages name ``name.field``."""
    bits = WEIGHT_FORMATS[check_weight_format(pw.format, f"{name}.format")]
    if not (isinstance(pw.shape, tuple) and len(pw.shape) == 2
            and all(isinstance(d, (int, np.integer)) and d > 0 for d in pw.shape)):
        raise ValueError(f"{name}.shape must be (K, N) with positive integers, got {pw.shape!r}")
    K, N = (int(d) for d in pw.shape)
    data = _validate.as_array(pw.data, f"{name}.data")
    scale = _validate.as_array(pw.scale, f"{name}.scale")
    dtype = np.int8 if pw.format == "int8" else np.uint8
    want = (N, -(-K // (8 // bits)))
    if data.dtype != dtype or data.shape != want:
        raise ValueError(f"{name}.data must be {np.dtype(dtype).name} of shape {want} for a "
                         f"{pw.format} weight of shape {(K, N)}, got {data.dtype} {data.shape}")
    if scale.dtype != np.float32 or scale.ndim > 1 or scale.size not in (1, N):
        raise ValueError(f"{name}.scale must be float32 with 1 or N = {N} values, got "
                         f"{scale.dtype} {scale.shape}")
    _backend.array_kind(data, scale)
    if not data.flags.c_contiguous:
        pw = dataclasses.replace(pw, data=_backend.array_module(data).ascontiguousarray(data))
    return pw


@dataclasses.dataclass(frozen=True)
class QuantizedActivation:
    """Per-row quantized activations.

    Attributes:
        format: "int8" or "int4".
        codes: int8, the shape of the input, in ``[-qmax, qmax]``.
        scale: float32, the input's shape without its last axis; value = code x scale.
    """

    format: str
    codes: Array
    scale: Array

    @property
    def nbytes(self) -> int:
        return int(self.codes.itemsize * self.codes.size + self.scale.itemsize * self.scale.size)

    def dequantize(self) -> Array:
        """float32, the input's shape: ``codes * scale[..., None]``."""
        return self.codes.astype(np.float32) * self.scale[..., None]


def _weight_input(w, name="w"):
    w = _validate.as_array(w, name)
    _validate.floating(w, name)
    if w.ndim != 2:
        raise ValueError(f"{name} must have shape (K, N), got rank {w.ndim} shape {w.shape}")
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"{name} must have K >= 1 and N >= 1, got shape {w.shape}")
    return w


def _finite_scale(scale, w, name):
    """The weight's scale as stored (float32), or an error if it is not finite: the statistic
    carries any NaN or inf of ``w`` (mean |w| in float64, or the column absmax), and a float64
    scale past float32's range becomes inf, so one read of one flag checks the weight."""
    xp = _backend.array_module(scale)
    with np.errstate(over="ignore"):  # past float32's range: the error below, no warning
        scale32 = xp.asarray(scale, dtype=np.float32)
    if _kernels.read_status(~xp.isfinite(scale32).all()):
        _validate.all_finite(w, name)
        if not bool(xp.isfinite(scale).all()):
            raise ValueError(f"{name} must have a finite scale; mean |{name}| overflows "
                             f"{w.dtype}")
        raise ValueError(f"{name}'s scale overflows float32 (the scale is stored as float32): "
                         f"max |{name}| = {float(xp.abs(w).max()):.3g}")
    return scale32


def quantize_weight(w: Array, weight_format: str) -> PackedWeight:
    """Quantize and pack a weight matrix.

    Args:
        w: [K, N] (in features x out features: the transpose of ``torch.nn.Linear.weight``)
            float32 or float64 (numpy or cupy); must be finite. The scale statistic is formed
            in the input's dtype (``mean |w|`` in float64); the scale is stored as float32.
        weight_format: "ternary", "sign" or "int8".

    Returns:
        ``PackedWeight`` whose arrays live on the array module of ``w``.

    Raises:
        TypeError: ``w`` is not a float array.
        ValueError: unknown ``weight_format``, ``w`` not 2-d or empty, non-finite ``w``, a
            scale past float32's range (a float64 ``w`` beyond it).
    """
    fmt = check_weight_format(weight_format)
    w = _weight_input(w)
    _, impl = _dispatch.resolve("quantize", w)
    stored, scale = impl.weight_codes(w, fmt)
    scale32 = _finite_scale(scale, w, "w")
    bits = WEIGHT_FORMATS[fmt]
    if fmt != "int8" and stored.shape[-1] != packed_length(w.shape[0], bits):
        # A backend may pack as it quantizes (numba does); one code (K = 1) packs to itself.
        # The codes come from the kernel, in range by construction: no range check to read.
        stored = pack_codes(stored, bits, axis=-1)
    return PackedWeight(fmt, tuple(w.shape), stored, scale32)


def _rows(x, name):
    x = _validate.as_array(x, name)
    _validate.floating(x, name)
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension (..., K), got a 0-d array")
    if x.shape[-1] < 1:
        raise ValueError(f"{name} must have K = x.shape[-1] >= 1, got shape {x.shape}")
    return x


def quantize_rows(x, act_format, name="x"):
    """Validated per-row quantization shared with ``packed_matmul``: ``(codes, scale)``.

    ``x`` must already be checked by ``_rows``. Non-finite rows are found by the backend in the
    same pass as the absmax (their scale comes back non-finite) and raise ``ValueError`` here,
    after one read of one flag (the row is looked up only on that error path).
    """
    xp = _backend.array_module(x)
    K = x.shape[-1]
    rows = xp.ascontiguousarray(x).reshape(-1, K)
    _, impl = _dispatch.resolve("quantize", rows)
    codes, scale = impl.row_codes(rows, ACT_FORMATS[act_format])
    if scale.size and _kernels.read_status(~xp.isfinite(scale).all()):
        bad = int(xp.flatnonzero(~xp.isfinite(scale))[0])
        raise ValueError(f"{name} must be finite, got a non-finite value in row {bad}")
    return codes.reshape(x.shape), scale.reshape(x.shape[:-1])


def quantize_activation(x: Array, act_format: str = "int8") -> QuantizedActivation:
    """Quantize activations per row over the last axis.

    ``scale = max(max|x_row|, 1e-5) / qmax`` (qmax 127 for "int8", 7 for "int4"),
    ``code = clip(rint(x / scale), -qmax, qmax)``.

    Args:
        x: [..., K] float32 or float64, K >= 1; the quotients are formed in its dtype.
        act_format: "int8" or "int4" (codes are held one per int8 either way).

    Returns:
        ``QuantizedActivation`` with ``codes`` int8 [..., K] and ``scale`` float32 [...].

    Raises:
        TypeError: ``x`` is not a float array.
        ValueError: unknown ``act_format``, a non-finite value.
    """
    fmt = check_act_format(act_format)
    x = _rows(x, "x")
    codes, scale = quantize_rows(x, fmt)
    return QuantizedActivation(fmt, codes, scale)


def fake_quantize_weight(w: Array, weight_format: str) -> Array:
    """Quantize then dequantize a weight: same shape and dtype as ``w``.

    The dequantized values ``code * scale`` are formed in float32 (the scale is stored float32)
    and returned in ``w``'s dtype. Its backward is the identity (straight-through estimator):
    pass the incoming gradient through unchanged.
    """
    pw = quantize_weight(w, weight_format)
    return pw.dequantize().astype(w.dtype, copy=False)


def fake_quantize_activation(x: Array, act_format: str = "int8") -> Array:
    """Quantize then dequantize activations per row: same shape and dtype as ``x``.

    ``code * scale`` is formed in float32 and returned in ``x``'s dtype. Its backward is the
    identity (straight-through estimator).
    """
    return quantize_activation(x, act_format).dequantize().astype(x.dtype, copy=False)


def weight_rows(pw, k0: int, k1: int) -> PackedWeight:
    """Rows ``k0:k1`` (input features) of a packed weight: a ``PackedWeight`` of shape
    ``(k1 - k0, N)`` with the same scale, on the array module of ``pw.data``.

    A slice on byte boundaries copies those bytes; any other is re-packed from the codes.
    """
    pw = checked_packed(pw, "pw")
    K, N = pw.shape
    if not 0 <= k0 < k1 <= K:
        raise ValueError(f"rows {k0}:{k1} must be a non-empty range inside K = {K}")
    xp = _backend.array_module(pw.data)
    per = pw.codes_per_byte
    if k0 % per == 0 and (k1 % per == 0 or k1 == K):
        data = xp.ascontiguousarray(pw.data[:, k0 // per:-(-k1 // per)])
        return PackedWeight(pw.format, (k1 - k0, N), data, pw.scale)
    return _repacked_rows(pw, pw.codes()[k0:k1])


def weight_rows_at(pw, rows) -> PackedWeight:
    """Rows ``rows`` (input features: a sorted index array of the array module of ``pw.data``)
    of a packed weight, re-packed from its codes with the same scale (nothing is re-quantized)."""
    return _repacked_rows(checked_packed(pw, "pw"), pw.codes()[rows])


def _repacked_rows(pw, codes):
    """A ``PackedWeight`` of the format and scale of ``pw`` holding the signed codes [k, N]."""
    xp = _backend.array_module(codes)
    codes_nk = codes.T
    if pw.format == "int8":
        data = xp.ascontiguousarray(codes_nk)
    else:
        stored = codes_nk + 1 if pw.format == "ternary" else codes_nk > 0
        data = pack_codes(xp.ascontiguousarray(stored.astype(np.uint8)),
                          WEIGHT_FORMATS[pw.format], axis=-1)
    return PackedWeight(pw.format, (codes.shape[0], pw.shape[1]), data, pw.scale)
