"""Rotary position embedding (RoPE): ``rotary`` and its training pair.

Each token ``t`` of ``x [T, H, D]`` (or ``[T, D]``) has a position ``p = positions[t]`` (any
non-negative integers: a KV-cache decode step passes e.g. ``[57]``). Pair ``j`` of the head
dimension (``j < D / 2``) turns by the angle::

    angle[t, j] = p * theta ** (-2 j / D)
    y_a = x_a * cos(angle) - x_b * sin(angle);   y_b = x_b * cos(angle) + x_a * sin(angle)

where the pair ``(a, b)`` is ``(j, j + D/2)`` for ``style="half"`` (transformers' Llama and
BitNet ``rotate_half``) and ``(2j, 2j + 1)`` for ``style="interleaved"`` (GPT-J, BDH). The
rotation is orthogonal, so the backward turns ``dy`` by ``-angle``; positions get no gradient.

Angles: formed in float64 whatever x's dtype (``rotary_tables``; at position 100000 a float32
angle would be off by up to 4e-3 rad), on x's array module, then cos and sin are rounded once to
x's dtype. The rotation itself is computed in x's dtype. Every backend gets the same tables, so
numpy, numba and cudasim agree bitwise. Host tables are cached by content (``_host_tables``).

Composite layers share the tables: the BDH layer (``lowrank_residual/_layer.py``) builds its
cos/sin of positions ``0 .. T - 1`` with ``rotary_tables`` and applies them inside its fused
attention kernels (on gathered active pairs, where this op cannot be dropped in).

Backends: ``_numpy.py``, ``_numba.py``, ``_cuda.py`` (``cuda/rotary.cu``). Reference:
``reference/rotary.py``; tests: ``tests/test_rotary.py``; benchmark: ``bench/rotary.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

from ... import _backend, _dispatch, _kernels, _validate
from ..._ctx import Ctx, Saved
from ..._typing import Array
from ..saved_activation import save

OP = "rotary"
#: The rotation styles: which elements of the head dimension pair up.
STYLES = ("half", "interleaved")
#: The default base of the angles (Llama's).
THETA = 10000.0
#: Largest position: positions are turned into float64 exactly up to 2**53.
MAX_POSITION = 2**53


@dataclasses.dataclass(frozen=True)
class RotaryCtx(Ctx):
    """What ``rotary_backward`` needs: the positions and the angle settings, not ``x``.

    Attributes:
        positions: saved (exact) int64 positions [T], a copy made by the forward on x's array
            module (host positions given with a cupy ``x`` are uploaded once).
        theta: the angle base, as given to the forward.
        style: ``"half"`` or ``"interleaved"``.
        shape: the shape of x (and of y and dy).
        dtype: x's dtype (float32 or float64), which ``dy`` must have.
    """

    positions: Saved
    theta: float
    style: str
    shape: tuple
    dtype: np.dtype


def inverse_frequencies(D: int, theta: float) -> np.ndarray:
    """``theta ** (-2 j / D)`` for ``j = 0 .. D // 2 - 1``: host float64 [D // 2].

    Each power is the C library's ``pow`` (``math.pow``), correctly rounded on glibc: NumPy's
    vectorized power is 1 ulp off for some of them on AVX-512 CPUs (Intel Xeon, D = 64, theta
    1e4), which at position 1e6 moves an angle by 1e-10 rad, and the tables would then depend on
    the CPU. Unvalidated (composite layers call it with their own checked sizes; an odd ``D``
    gives ``D // 2`` pairs, the angles still over ``D``).
    """
    return np.array([math.pow(theta, -2.0 * j / D) for j in range(D // 2)], dtype=np.float64)


def rotary_tables(positions: Array, D: int, theta: float, dtype) -> tuple[Array, Array]:
    """cos and sin of the rotary angles, ``[T, D // 2]`` each, of ``dtype``.

    The angles ``positions[t] * inverse_frequencies(D, theta)[j]`` are formed in float64 on the
    array module of ``positions`` (one correctly rounded product), then cos and sin are taken in
    float64 and rounded once to ``dtype``. Unvalidated: for composite layers and this op's own
    entry points (the BDH layer builds its tables of positions ``0 .. T - 1`` here).

    Args:
        positions: [T] integer (or float64 holding integers) numpy or cupy array.
        D: the width the angles are spread over (the head dimension).
        theta: the base, a positive float.
        dtype: the dtype of the tables.

    Returns:
        ``(cos, sin)``, each [T, D // 2] of ``dtype`` on positions' array module.
    """
    xp = _backend.array_module(positions)
    inv = inverse_frequencies(D, theta)
    if xp is not np:
        inv = _kernels.device_constant(inv, positions)
    angle = positions.astype(np.float64)[:, None] * inv[None, :]
    return xp.cos(angle).astype(dtype), xp.sin(angle).astype(dtype)


#: Host tables kept between calls, by positions, D, theta and dtype: a training step rotates
#: the queries and keys of every layer at the same positions, and the float64 cos/sin of the
#: tables cost 4x the rotation itself (3.4 ms against 0.8 ms for x [2048, 16, 128] float32 on
#: one core, measured). ``lowbit.clear_caches()`` empties it.
TABLE_CACHE_ENTRIES = 8


@functools.lru_cache(maxsize=TABLE_CACHE_ENTRIES)
def _host_tables(key: bytes, D: int, theta: float, dtype: str) -> tuple[Array, Array]:
    """``rotary_tables`` of the int64 host positions whose bytes are ``key``, read-only."""
    tables = rotary_tables(np.frombuffer(key, np.int64), D, theta, np.dtype(dtype))
    for t in tables:
        t.flags.writeable = False
    return tables


def _tables(positions, D, theta, dtype):
    """The tables of validated int64 positions: cached for host ones, computed on the device
    (where cos and sin are cheap) for device ones."""
    if isinstance(positions, np.ndarray):
        return _host_tables(positions.tobytes(), D, theta, np.dtype(dtype).str)
    return rotary_tables(positions, D, theta, dtype)


def _style(style) -> str:
    if not isinstance(style, str):
        raise TypeError(f"style must be a string, one of {STYLES}, got {type(style).__name__}")
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    return style


def _x(x):
    """Validate ``x`` and return it contiguous as [T, H, D] (rank 2 gets H = 1)."""
    x = _validate.floating(_validate.as_array(x, "x"), "x")
    if x.ndim not in (2, 3):
        raise ValueError(f"x must have rank 3 [T, H, D] or rank 2 [T, D], got shape {x.shape}")
    D = x.shape[-1]
    if D < 2 or D % 2:
        raise ValueError(f"x must have an even, positive head dimension (its last axis), got "
                         f"shape {x.shape}")
    xp = _backend.array_module(x)
    return xp.ascontiguousarray(x).reshape(x.shape[0], x.shape[1] if x.ndim == 3 else 1, D)


def _positions(positions, x):
    """Validate ``positions`` against [T, H, D] ``x``: int64 [T] on x's array module."""
    if _backend.is_cupy_array(positions):
        if not _backend.is_cupy_array(x):
            raise TypeError("positions must be a numpy array for a numpy x, got a cupy array; "
                            "lowbit never moves data between device and host")
    elif not isinstance(positions, np.ndarray):
        if isinstance(positions, (str, bytes)) or not hasattr(positions, "__len__"):
            raise TypeError(f"positions must be a 1-D integer array, got "
                            f"{type(positions).__name__}")
        if any(isinstance(p, (bool, np.bool_)) or not isinstance(p, numbers.Integral)
               for p in positions):
            raise TypeError("positions must hold integers (not bools)")
        for i, p in enumerate(positions):
            if not 0 <= p <= MAX_POSITION:
                raise ValueError(f"positions must lie in [0, 2**53], got positions[{i}] = {p}")
        positions = np.array(list(positions), dtype=np.int64).reshape(-1)
    if positions.dtype.kind not in "iu":  # bool arrays too: a mask is not a list of positions
        raise TypeError(f"positions must have an integer dtype, got {positions.dtype}")
    if positions.ndim != 1:
        raise ValueError(f"positions must be 1-D, got shape {positions.shape}")
    T = x.shape[0]
    if positions.shape[0] != T:
        raise ValueError(f"positions must have one entry per token of x ({T}), got "
                         f"{positions.shape[0]}")
    if T:
        if isinstance(positions, np.ndarray):
            lo, hi = int(positions.min()), int(positions.max())
        else:  # one read for both bounds of a device array: one transfer
            xp = _backend.array_module(positions)
            lo, hi = (int(v) for v in _kernels.host_copy(xp.stack([positions.min(),
                                                                     positions.max()])))
        if lo < 0:
            raise ValueError(f"positions must be non-negative, got a minimum of {lo}")
        if hi > MAX_POSITION:
            raise ValueError(f"positions must be at most 2**53 (exact in float64), got a maximum "
                             f"of {hi}")
    if _backend.is_cupy_array(x) and not _backend.is_cupy_array(positions):
        # Host positions are accepted for a device x (documented): one small upload.
        positions = _kernels.device_copy(positions.astype(np.int64), x)
    return positions.astype(np.int64)  # a copy: the ctx keeps it


def _prepare(x, positions, theta, style):
    theta = _validate.positive_scalar(theta, "theta")
    style = _style(style)
    x3 = _x(x)
    return x3, _positions(positions, x3), theta, style, tuple(x.shape)


def rotary(x: Array, positions: Array, *, theta: float = THETA, style: str = "half") -> Array:
    """Rotate the pairs of x's head dimension by the angles of ``positions`` (inference).

    Args:
        x: [T, H, D] or [T, D] float32 or float64, numpy or cupy; D even and >= 2.
        positions: [T] integers >= 0 (and at most 2**53): a numpy array, a sequence of ints, or
            for a cupy ``x`` also a cupy array (a host one is uploaded, one small copy).
        theta: the base of the angles, finite and > 0 (10000 Llama, 500000 Llama 3 / BitNet).
        style: ``"half"`` (pairs ``(j, j + D/2)``, transformers' ``rotate_half``) or
            ``"interleaved"`` (pairs ``(2j, 2j + 1)``, GPT-J).

    Returns:
        y of x's shape, dtype and array module.

    Raises:
        TypeError: ``x`` is not a float32/float64 array; ``positions`` is not integer or is a
            cupy array for a numpy ``x``; ``theta`` is not a real number; ``style`` not a string.
        ValueError: ``x`` is not of rank 2 or 3 or has an odd head dimension; ``positions`` is
            not 1-D of length T, or negative; ``theta`` is not finite or not positive; an
            unknown ``style``.
    """
    x3, pos, theta, style, shape = _prepare(x, positions, theta, style)
    cos, sin = _tables(pos, x3.shape[-1], theta, x3.dtype)
    _, impl = _dispatch.resolve(OP, x3, cos)
    return impl.forward(x3, cos, sin, style == "interleaved").reshape(shape)


def rotary_forward(x: Array, positions: Array, *, theta: float = THETA, style: str = "half"
                   ) -> tuple[Array, RotaryCtx]:
    """``rotary`` that also returns the ctx of ``rotary_backward``.

    Args:
        x, positions, theta, style: as ``rotary``.

    Returns:
        ``(y, ctx)``: y as ``rotary``'s, ctx a ``RotaryCtx`` (positions and settings only).

    Raises:
        TypeError, ValueError: as ``rotary``.
    """
    x3, pos, theta, style, shape = _prepare(x, positions, theta, style)
    cos, sin = _tables(pos, x3.shape[-1], theta, x3.dtype)
    _, impl = _dispatch.resolve(OP, x3, cos)
    y = impl.forward(x3, cos, sin, style == "interleaved").reshape(shape)
    return y, RotaryCtx(positions=save(pos, None), theta=theta, style=style, shape=shape,
                        dtype=x3.dtype)


def rotary_backward(dy: Array, ctx: RotaryCtx) -> Array:
    """Gradient of ``rotary_forward``'s output with respect to ``x``: ``dy`` turned back.

    Args:
        dy: gradient of y, of the forward's shape, dtype and array kind.
        ctx: the ``RotaryCtx`` of the forward.

    Returns:
        dx of the forward's shape and dtype (computed in it).

    Raises:
        TypeError: ``ctx`` is not a ``RotaryCtx``; ``dy`` is not an array, or has another dtype
            or array kind than the forward's.
        ValueError: ``dy``'s shape is not the forward output's.
    """
    if not isinstance(ctx, RotaryCtx):
        raise TypeError(f"ctx must be a RotaryCtx, got {type(ctx).__name__}")
    dy = _validate.grad_dtype(_validate.as_array(dy, "dy"), ctx.dtype, "dy")
    _validate.shape(dy, ctx.shape, "dy", "the forward output's")
    pos = ctx.positions.unpack()
    if _backend.is_cupy_array(dy) != _backend.is_cupy_array(pos):
        kind = "cupy" if _backend.is_cupy_array(pos) else "numpy"
        raise TypeError(f"dy must be a {kind} array like the forward's x, got "
                        f"{type(dy).__module__}.{type(dy).__name__}")
    xp = _backend.array_module(dy)
    D = ctx.shape[-1]
    T = ctx.shape[0]
    dy3 = xp.ascontiguousarray(dy).reshape(T, math.prod(ctx.shape[1:]) // D, D)
    cos, sin = _tables(pos, D, ctx.theta, ctx.dtype)
    _, impl = _dispatch.resolve(OP, dy3, cos)
    return impl.backward(dy3, cos, sin, ctx.style == "interleaved").reshape(ctx.shape)
