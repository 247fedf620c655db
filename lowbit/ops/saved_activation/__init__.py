"""Bit-packed saved activations: ``pack_activation``, ``pack_mask``, ``SavedConfig``.

The saved-activation policy behind ``save`` (below): every tensor an op keeps for its backward
goes through ``save_activation`` when the op was given ``saved=`` (a format string or a
``SavedConfig``), and comes back as a ``PackedActivation`` / ``PackedMask`` whose ``nbytes`` is
the sum of ``itemsize * size`` of the arrays it holds.

Formats (``group_size`` contiguous elements along the last axis form a group):

- ``"fp32"``: the float32 values, kept as is (a float32 input is held without a copy).
- ``"int8"``, ``"int4"``, ``"int2"``: per-group asymmetric codes (``kind="values"``:
  ``scale = max(max - min, 1e-5) / (2**bits - 1)``, value ``min + code * scale``) or, for
  ``kind="nonneg"``, ``min = 0`` and a positive value never gets code 0; codes bit-packed per row
  in the ``pack_bits`` layout, scales and minima float32 ``[rows, groups]``.
- ``"sparse"`` (``kind="nonneg"`` only): a 1-bit nonzero mask of the flattened tensor plus 8-bit
  codes of the nonzeros in row-major order, one float32 scale per ``group_size`` nonzeros.

Arithmetic is float32 with round-half-to-even; stochastic rounding adds noise that is a pure
function of ``(seed, flat element index)`` (splitmix64's finalizer), so every backend produces
bitwise-identical codes. Value checks (finite, non-negative for ``nonneg``) are fused into the
packing kernels' group statistics, so packing reads the tensor once; they raise before anything
is returned and nothing the caller holds is written.

Backends: ``_numpy.py``, ``_numba/``, ``_cuda.py`` (``cuda/saved_activation.cu``); reference
``reference/saved_activation.py``; tests ``tests/test_saved_activation.py``; benchmark
``bench/memory.py``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ... import _backend, _dispatch, _kernels, _validate
from ..._ctx import Exact, Saved
from ..._typing import Array
from ..pack_bits import pack_bits, unpack_bits

FORMATS = ("fp32", "int8", "int4", "int2", "sparse")
KINDS = ("values", "nonneg")
ROUNDINGS = ("nearest", "stochastic")
#: Bits per code of the grouped integer formats.
FORMAT_BITS = {"int8": 8, "int4": 4, "int2": 2}
#: splitmix64's seed step: seed s draws its noise from the stream starting at (s + 1) * GOLDEN.
GOLDEN = 0x9E3779B97F4A7C15
#: splitmix64's finalizer multipliers: the noise of flat index i is the finalizer of key + i.
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
#: Bits of the ``status`` arrays the backends return (``cuda/saved_activation.cu`` mirrors them).
STATUS_NONFINITE = 1
STATUS_NEGATIVE = 2


def _format(value, name: str = "saved_format") -> str:
    if value not in FORMATS:
        raise ValueError(f"{name} must be one of {FORMATS}, got {value!r}")
    return value


#: The defaults of the options that only some formats read (``_unused_options``).
_OPTION_DEFAULTS = {"group_size": 256, "rounding": "nearest", "seed": 0}


def _unused_options(fmt, group_size, rounding, seed, what):
    """Raise for an option given a non-default value that ``fmt`` would ignore: ``"fp32"``
    keeps the values (no groups, no rounding), and nearest rounding draws no noise (no seed)."""
    given = {"group_size": group_size, "rounding": rounding, "seed": seed}
    unused = ("group_size", "rounding", "seed") if fmt == "fp32" else (
        ("seed",) if rounding == "nearest" else ())
    for name in unused:
        if given[name] != _OPTION_DEFAULTS[name]:
            why = (f"{what}='fp32' keeps the float32 values" if fmt == "fp32"
                   else "rounding='nearest' draws no noise")
            raise ValueError(f"{name}={given[name]!r} has no effect: {why}; leave {name} at "
                             f"its default {_OPTION_DEFAULTS[name]!r}")


def _rounding(rounding) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    return rounding


def _seed(seed) -> int:
    seed = _validate.integer(seed, "seed", minimum=0)
    if seed > _MASK64:
        raise ValueError(f"seed must be below 2**64, got {seed}")
    return seed


@dataclasses.dataclass(frozen=True)
class SavedConfig:
    """How an op keeps the activations its backward needs (the ``saved=`` argument).

    A plain format string ``"int8"`` means ``SavedConfig("int8")``. ``saved=None`` (every op's
    default) keeps them exact. The noise of stochastic rounding depends only on ``seed`` and the
    element index, so vary ``seed`` between steps to decorrelate the rounding across steps.

    Attributes:
        format: ``"fp32"``, ``"int8"``, ``"int4"``, ``"int2"`` or ``"sparse"``.
        group_size: elements per quantization group (>= 1); not with ``"fp32"``.
        rounding: ``"nearest"`` or ``"stochastic"``; not with ``"fp32"``.
        seed: noise seed for stochastic rounding, in ``[0, 2**64)``; only with
            ``rounding="stochastic"``.

    Raises:
        ValueError: a bad value, or an option set away from its default where the format or
            rounding ignores it (the message names it).
    """

    format: str = "int8"
    group_size: int = 256
    rounding: str = "nearest"
    seed: int = 0

    def __post_init__(self) -> None:
        _format(self.format, "format")
        object.__setattr__(self, "group_size",
                           _validate.integer(self.group_size, "group_size", minimum=1))
        _rounding(self.rounding)
        object.__setattr__(self, "seed", _seed(self.seed))
        _unused_options(self.format, self.group_size, self.rounding, self.seed, "format")


def noise_key(seed: int) -> np.uint64:
    """The uint64 stream key every backend adds to the flat index before hashing."""
    return np.uint64(((seed + 1) * GOLDEN) & _MASK64)


class PackedActivation(Saved):
    """A tensor packed by ``pack_activation``; ``unpack()`` gives float32 of the original shape.

    Attributes:
        shape, dtype: of the original tensor.
        format, kind, group_size, rounding, seed: how it was packed.
        data: fp32 only, the float32 values.
        codes: uint8; int formats ``[rows, ceil(n * bits / 8)]`` bit-packed along the last axis,
            sparse ``[nnz]``.
        scales: float32; int formats ``[rows, groups]``, sparse ``[ceil(nnz / group_size)]``.
        mins: float32 ``[rows, groups]`` for ``kind="values"`` int formats, else None.
        mask: sparse only, ``[ceil(size / 8)]`` uint8, the nonzero pattern (``pack_bits``, 1 bit).
    """

    def __init__(self, shape, dtype, format, kind, group_size, rounding, seed, *, data=None,
                 codes=None, scales=None, mins=None, mask=None):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.format = format
        self.kind = kind
        self.group_size = group_size
        self.rounding = rounding
        self.seed = seed
        self.data, self.codes, self.scales, self.mins, self.mask = data, codes, scales, mins, mask

    @property
    def arrays(self) -> dict:
        """Every array this object holds, by name."""
        held = {"data": self.data, "codes": self.codes, "scales": self.scales, "mins": self.mins,
                "mask": self.mask}
        return {name: a for name, a in held.items() if a is not None}

    @property
    def nbytes(self) -> int:
        return sum(int(a.itemsize * a.size) for a in self.arrays.values())

    def __repr__(self):
        return (f"PackedActivation(shape={self.shape}, format={self.format!r}, kind={self.kind!r},"
                f" nbytes={self.nbytes}, dense_nbytes={self.dense_nbytes})")

    def unpack(self) -> Array:
        """float32 array of ``shape`` on the array module of the packed arrays."""
        if self.format == "fp32":
            return self.data
        xp = _backend.array_module(*self.arrays.values())
        size = math.prod(self.shape)
        if size == 0:
            return _backend.empty(self.shape, np.float32, xp)
        _, impl = _dispatch.resolve("saved_activation", *self.arrays.values())
        if self.format == "sparse":
            out = impl.unpack_sparse(self.mask, self.codes, self.scales, size, self.group_size)
        else:
            n = self.shape[-1] if self.shape else 1
            out = impl.unpack_dense(self.codes, self.scales, self.mins, FORMAT_BITS[self.format],
                                    n, self.group_size)
        return out.reshape(self.shape)


def _raise_status(status, kind):
    """Raise for the flags of a backend's status array: one reduction on its array module, then
    one read of one byte (the op's only read from the device)."""
    _raise_flags(_kernels.read_status(status.max()) if status.size else 0, kind)


def _raise_flags(flags, kind):
    if flags & STATUS_NONFINITE:
        raise ValueError("x must be finite, got non-finite values")
    if flags & STATUS_NEGATIVE:
        raise ValueError(f"x must be non-negative for kind={kind!r} (a post-ReLU tensor), "
                         "got negative values")


def pack_activation(x: Array, saved_format: str, *, kind: str = "values", group_size: int = 256,
                    rounding: str = "nearest", seed: int = 0) -> PackedActivation:
    """Pack an activation for the backward pass.

    Precision: the statistics and codes are computed in float32 (a float64 ``x`` is rounded to
    float32 first); ``unpack()`` returns float32.

    Args:
        x: float32 or float64 array (numpy or cupy), any shape; groups run along the last axis.
        saved_format: ``"fp32"``, ``"int8"``, ``"int4"``, ``"int2"`` or ``"sparse"``.
        kind: ``"values"`` (any sign) or ``"nonneg"`` (post-ReLU: the zero pattern is exact;
            with ``"fp32"`` it only checks that ``x`` is non-negative).
        group_size: elements per group (>= 1); for ``"sparse"``, nonzeros per group. Not with
            ``"fp32"``.
        rounding: ``"nearest"`` (half to even) or ``"stochastic"`` (unbiased for ``"values"``).
            Not with ``"fp32"``.
        seed: stochastic-rounding seed in ``[0, 2**64)``; only with ``rounding="stochastic"``.

    Returns:
        PackedActivation on the array module of ``x``.

    Raises:
        TypeError: ``x`` not a float32/float64 array; ``group_size`` or ``seed`` not an integer.
        ValueError: unknown ``saved_format``, ``kind`` or ``rounding``; ``"sparse"`` with
            ``kind="values"``; ``group_size < 1``; an option given a non-default value that the
            format or rounding ignores (named); non-finite ``x``; negative ``x`` with
            ``kind="nonneg"`` or ``"sparse"``.
    """
    x = _validate.floating(_validate.as_array(x, "x"), "x")
    fmt = _format(saved_format)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if fmt == "sparse" and kind != "nonneg":
        raise ValueError(f"saved_format='sparse' stores the zero pattern of a post-ReLU tensor "
                         f"and needs kind='nonneg', got kind={kind!r}")
    group_size = _validate.integer(group_size, "group_size", minimum=1)
    rounding = _rounding(rounding)
    seed = _seed(seed)
    _unused_options(fmt, group_size, rounding, seed, "saved_format")
    xp = _backend.array_module(x)
    meta = (x.shape, x.dtype, fmt, kind, group_size, rounding, seed)
    nonneg = kind == "nonneg"
    if fmt == "fp32":
        if x.size:
            # min and max carry any NaN or inf: two read-only reductions, no boolean temporaries,
            # and one read of both.
            lo, hi = (float(v) for v in _kernels.host_copy(xp.stack([x.min(), x.max()])))
            flags = 0 if math.isfinite(lo) and math.isfinite(hi) else STATUS_NONFINITE
            _raise_flags(flags | (STATUS_NEGATIVE if nonneg and lo < 0 else 0), kind)
        return PackedActivation(*meta, data=x.astype(np.float32, copy=False))
    _, impl = _dispatch.resolve("saved_activation", x)
    stochastic = rounding == "stochastic"
    key = noise_key(seed)
    contiguous = xp.ascontiguousarray(x)
    if fmt == "sparse":
        size = x.size
        if size == 0:
            mask = _backend.empty((0,), np.uint8, xp)
            codes = _backend.empty((0,), np.uint8, xp)
            scales = _backend.empty((0,), np.float32, xp)
        else:
            mask, codes, scales, status = impl.pack_sparse(contiguous.reshape(-1), group_size,
                                                           stochastic, key)
            _raise_status(status, kind)
        return PackedActivation(*meta, codes=codes, scales=scales, mask=mask)
    bits = FORMAT_BITS[fmt]
    n = x.shape[-1] if x.ndim else 1
    rows = math.prod(x.shape[:-1]) if x.ndim else 1
    if x.size == 0:
        groups = -(-n // group_size)
        codes = _backend.empty((rows, -(-n * bits // 8)), np.uint8, xp)
        scales = _backend.empty((rows, groups), np.float32, xp)
        mins = None if nonneg else _backend.empty((rows, groups), np.float32, xp)
    else:
        codes, scales, mins, status = impl.pack_dense(contiguous.reshape(rows, n), bits, nonneg,
                                                      group_size, stochastic, key)
        _raise_status(status, kind)
    return PackedActivation(*meta, codes=codes, scales=scales, mins=mins)


class PackedMask(Saved):
    """A boolean array held at 1 bit per element (``pack_bits`` layout over the flattened array).

    Attributes:
        shape: of the original mask.
        bits: ``[ceil(size / 8)]`` uint8.
    """

    format = "mask1"

    def __init__(self, shape, bits):
        self.shape = tuple(shape)
        self.bits = bits

    @property
    def nbytes(self) -> int:
        return int(self.bits.itemsize * self.bits.size)

    def __repr__(self):
        return f"PackedMask(shape={self.shape}, nbytes={self.nbytes})"

    def unpack(self) -> Array:
        """The boolean mask of ``shape`` on the array module of ``bits``."""
        flat = unpack_bits(self.bits, 1, math.prod(self.shape))
        return flat.view(np.bool_).reshape(self.shape)


def pack_mask(mask: Array) -> PackedMask:
    """Pack a boolean array (numpy or cupy) at 1 bit per element.

    Raises:
        TypeError: ``mask`` is not a boolean array.
    """
    mask = _validate.as_array(mask, "mask")
    if mask.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array, got dtype {mask.dtype}")
    xp = _backend.array_module(mask)
    flat = xp.ascontiguousarray(mask).reshape(-1).view(np.uint8)
    return PackedMask(mask.shape, pack_bits(flat, 1))


def save_activation(x: Array, saved: str | SavedConfig, kind: str = "values") -> Saved:
    """Pack ``x`` by the policy ``saved`` (the body of ``save`` for ``saved`` not None).

    Args:
        x: the array to keep; a boolean array when ``kind="mask"``.
        saved: a format string or a ``SavedConfig``.
        kind: ``"values"``, ``"nonneg"`` or ``"mask"`` (booleans, packed at 1 bit whatever the
            format). Under the ``"sparse"`` policy, ``"values"`` tensors are saved at int8.
    """
    config = saved_policy(saved)
    if config is None:
        raise ValueError("saved must be a format or a SavedConfig here; saved=None keeps a "
                         "tensor exact (save)")
    if kind == "mask":
        return pack_mask(x)
    if config.format == "sparse" and kind == "values":
        # As a policy, "sparse" stores post-ReLU tensors sparsely and tensors of any sign at
        # int8 (the sparse format needs the zero pattern of a non-negative tensor).
        config = dataclasses.replace(config, format="int8")
    return pack_activation(x, config.format, kind=kind, group_size=config.group_size,
                           rounding=config.rounding, seed=config.seed)


def saved_policy(saved: str | SavedConfig | None) -> SavedConfig | None:
    """Parse an op's ``saved=`` argument, before any kernel runs: ``None`` or a ``SavedConfig``.

    Every ``*_forward`` calls this first, so a bad policy raises here, naming ``saved``.

    Raises:
        TypeError: ``saved`` is neither None, a format string nor a ``SavedConfig``.
        ValueError: an unknown format string.
    """
    if saved is None or isinstance(saved, SavedConfig):
        return saved
    if isinstance(saved, str):
        if saved not in FORMATS:
            raise ValueError(f"saved must be None, one of {FORMATS} or a lowbit.SavedConfig, "
                             f"got {saved!r}")
        return SavedConfig(format=saved)
    raise TypeError(f"saved must be None, a format string or a lowbit.SavedConfig, got "
                    f"{type(saved).__name__}")


def save(x: Array, saved: str | SavedConfig | None = None, *, kind: str = "values") -> Saved:
    """The one choke point through which every op stores a tensor in its ctx.

    Args:
        x: the array to keep for the backward.
        saved: ``None`` (exact), a format string or a ``lowbit.SavedConfig`` (as parsed by
            ``saved_policy``).
        kind: ``"values"`` (any sign), ``"nonneg"`` (post-ReLU; the zero pattern stays exact) or
            ``"mask"`` (a boolean array, packed at 1 bit per element whatever the format).

    Returns:
        ``lowbit._ctx.Exact`` for ``saved=None``, else a ``PackedActivation`` (``PackedMask`` for
        masks).
    """
    if saved is None:
        return Exact(x)
    return save_activation(x, saved, kind=kind)
