"""Vectorized saved-activation packing (array-generic: numpy or cupy).

Siblings: ``_numba/``, ``_cuda.py`` (``cuda/saved_activation.cu``); reference
``reference/saved_activation.py``. Every function takes the arrays ``__init__`` prepared and
returns fresh arrays; value checks come back as a small ``status`` array (``STATUS_NONFINITE``: a
non-finite value, ``STATUS_NEGATIVE``: a negative value where ``nonneg``; defined in
``__init__``), which ``__init__`` turns into errors.
"""

import numpy as np

from ... import _backend
from ..pack_bits import _numpy as _bitpack
from ..quantize import EPS as _EPS
from . import MIX1 as _MIX1
from . import MIX2 as _MIX2
from . import STATUS_NEGATIVE, STATUS_NONFINITE

#: The scale floor (``lowbit.ops.quantize.EPS``) in float32.
EPS = np.float32(_EPS)
#: splitmix64 finalizer multipliers (``__init__``; the seed step lives in ``noise_key``).
MIX1 = np.uint64(_MIX1)
MIX2 = np.uint64(_MIX2)


def noise(index, key):
    """float32 noise in [0, 1) of uint64 flat indices (splitmix64 finalizer, top 24 bits)."""
    z = index + np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def _codes(v, lo, scale, levels, nonneg, stochastic, index, key):
    xp = _backend.array_module(v)
    t = (v - lo) / scale
    q = xp.floor(t + noise(index, key)) if stochastic else xp.rint(t)
    q = xp.clip(q, 0, levels).astype(np.uint8)
    if nonneg:
        # A positive value never unpacks to 0: the ReLU derivative stays exact.
        q[(q == 0) & (v > 0)] = 1
    return q


def _status(values, nonneg, axis=-1):
    xp = _backend.array_module(values)
    status = (~xp.isfinite(values)).any(axis=axis).astype(np.uint8) * np.uint8(STATUS_NONFINITE)
    if nonneg:
        status |= (values < 0).any(axis=axis).astype(np.uint8) * np.uint8(STATUS_NEGATIVE)
    return status


@np.errstate(invalid="ignore", over="ignore")
def pack_dense(x, bits, nonneg, group_size, stochastic, key):
    """Per-group quantize and bit-pack rows.

    Args:
        x: [rows, n] float32 or float64, C-contiguous.
        bits: 2, 4 or 8. nonneg: min fixed at 0 and positives kept nonzero.
        group_size: contiguous elements per group along n. stochastic: floor(t + noise).
        key: uint64 noise stream key of the seed.

    Returns:
        codes [rows, ceil(n * bits / 8)] uint8, scales [rows, groups] float32, mins
        [rows, groups] float32 (None when nonneg), status [rows, groups] uint8.
    """
    xp = _backend.array_module(x)
    rows, n = x.shape
    groups = -(-n // group_size)
    levels = (1 << bits) - 1
    v = x.astype(np.float32, copy=False)
    pad = groups * group_size - n
    if pad:
        # Repeating the last element pads a group without changing its min or max.
        v = xp.concatenate([v, xp.repeat(v[:, -1:], pad, axis=1)], axis=1)
    g = v.reshape(rows, groups, group_size)
    status = _backend.empty((rows, groups), np.uint8, xp)
    status[...] = _status(g, nonneg)
    hi = g.max(axis=-1)
    # + 0.0 canonicalizes a -0.0 minimum (see reference/saved_activation.py).
    lo = xp.zeros_like(hi) if nonneg else g.min(axis=-1) + np.float32(0)
    scales = _backend.empty((rows, groups), np.float32, xp)
    scales[...] = xp.maximum(hi - lo, EPS) / np.float32(levels)
    index = xp.arange(rows * groups * group_size, dtype=np.uint64).reshape(g.shape)
    index = index - (xp.arange(rows, dtype=np.uint64) * np.uint64(pad))[:, None, None]
    q = _codes(g, lo[..., None], scales[..., None], levels, nonneg, stochastic, index, key)
    codes = _bitpack.pack(xp.ascontiguousarray(q.reshape(rows, -1)[:, :n]), bits)
    mins = None
    if not nonneg:
        mins = _backend.empty((rows, groups), np.float32, xp)
        mins[...] = lo
    return codes, scales, mins, status


def unpack_dense(codes, scales, mins, bits, n, group_size):
    """Inverse of ``pack_dense``: [rows, n] float32 (``mins`` None means nonneg)."""
    xp = _backend.array_module(codes)
    rows = codes.shape[0]
    q = _bitpack.unpack(codes, bits, n).astype(np.float32)
    group = xp.arange(n) // group_size
    out = _backend.empty((rows, n), np.float32, xp)
    out[...] = q * scales[:, group]
    if mins is not None:
        out += mins[:, group]
    return out


@np.errstate(invalid="ignore", over="ignore")
def pack_sparse(flat, group_size, stochastic, key):
    """1-bit nonzero mask plus 8-bit codes of the nonzeros in groups of ``group_size``.

    Args:
        flat: [size] float32 or float64, non-negative.

    Returns:
        mask [ceil(size / 8)] uint8, codes [nnz] uint8, scales [ceil(nnz / group_size)] float32,
        status [1] uint8.
    """
    xp = _backend.array_module(flat)
    status = _backend.empty((1,), np.uint8, xp)
    status[...] = _status(flat, True, axis=None)
    v = flat.astype(np.float32, copy=False)
    nonzero = v != 0
    mask = _bitpack.pack(nonzero.astype(np.uint8).reshape(1, -1), 1).reshape(-1)
    index = xp.flatnonzero(nonzero)
    values = v[index]
    nnz = values.size
    groups = -(-nnz // group_size)
    pad = groups * group_size - nnz
    padded = xp.concatenate([values, xp.zeros(pad, np.float32)]).reshape(groups, group_size)
    scales = _backend.empty((groups,), np.float32, xp)
    scales[...] = xp.maximum(padded.max(axis=-1), EPS) / np.float32(255)
    group = xp.arange(nnz) // group_size
    codes = _backend.empty((nnz,), np.uint8, xp)
    codes[...] = _codes(values, np.float32(0), scales[group], 255, True, stochastic,
                        index.astype(np.uint64), key)
    return mask, codes, scales, status


def unpack_sparse(mask, codes, scales, size, group_size):
    """Inverse of ``pack_sparse``: [size] float32."""
    xp = _backend.array_module(mask)
    nonzero = _bitpack.unpack(mask.reshape(1, -1), 1, size).reshape(-1).view(np.bool_)
    out = _backend.empty((size,), np.float32, xp)
    out.fill(0)
    group = xp.arange(codes.size) // group_size
    out[nonzero] = codes.astype(np.float32) * scales[group]
    return out
