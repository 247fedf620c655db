"""Reference saved-activation packing: explicit loops, one element at a time.

The formats are defined in float32 arithmetic (scales, minima and the quantization division are
float32, rounding is round-half-to-even), so the reference does its arithmetic on ``np.float32``
scalars: that is what makes packed codes comparable bitwise with every backend. The noise hash
is written here with Python integers, independently of the kernels.

Checked against: lowbit/ops/saved_activation/ (every backend), tests/test_saved_activation.py.
"""

from __future__ import annotations

import math

import numpy as np

from .pack_bits import pack_bits_ref, unpack_bits_ref

MASK64 = (1 << 64) - 1
#: Odd constants of the splitmix64 generator: the seed step and the two finalizer multipliers.
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
EPS = np.float32(1e-5)
BITS = {"int8": 8, "int4": 4, "int2": 2}


def noise_key_ref(seed: int) -> int:
    """The 64-bit stream key of ``seed``: ``(seed + 1) * GOLDEN mod 2**64``."""
    return ((seed + 1) * GOLDEN) & MASK64


def noise_ref(seed: int, index: int) -> np.float32:
    """Uniform noise in [0, 1) as a pure function of (seed, flat element index).

    splitmix64's finalizer applied to ``index + key(seed)``; the top 24 bits become the float32
    ``u = k / 2**24``.
    """
    z = (index + noise_key_ref(seed)) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    z ^= z >> 31
    return np.float32(z >> 40) * np.float32(2.0**-24)


def _code(v, lo, scale, levels, nonneg, stochastic, seed, index):
    t = np.float32(np.float32(v - lo) / scale)
    q = math.floor(np.float32(t + noise_ref(seed, index))) if stochastic else round(float(t))
    # Python's round() on a float is round-half-to-even, like np.rint / rintf.
    q = min(max(int(q), 0), levels)
    if nonneg and q == 0 and v > 0:
        q = 1
    return q


def pack_activation_ref(x, format, kind="values", group_size=256, rounding="nearest", seed=0):
    """Pack ``x`` by the rules of ``lowbit.pack_activation``; returns a dict of held arrays.

    Keys: ``"data"`` (fp32: the float32 values), ``"codes"`` (uint8, bit-packed), ``"scales"`` and
    ``"mins"`` (float32, ``[rows, groups]``; no mins for nonneg), ``"mask"`` (sparse: 1-bit mask of
    the flattened tensor).
    """
    x = np.asarray(x, dtype=np.float32)
    stochastic = rounding == "stochastic"
    if format == "fp32":
        return {"data": x.copy()}
    if format == "sparse":
        flat = x.reshape(-1)
        nz = [i for i in range(flat.size) if flat[i] != 0]
        groups = -(-len(nz) // group_size)
        scales = np.zeros(groups, np.float32)
        codes = np.zeros(len(nz), np.uint8)
        for g in range(groups):
            members = nz[g * group_size:(g + 1) * group_size]
            hi = max(flat[i] for i in members)
            scales[g] = np.float32(max(hi, EPS) / np.float32(255))
            for k, i in enumerate(members):
                codes[g * group_size + k] = _code(flat[i], np.float32(0), scales[g], 255, True,
                                                  stochastic, seed, i)
        mask = pack_bits_ref((flat != 0).astype(np.uint8), 1)
        return {"mask": mask, "codes": codes, "scales": scales}
    bits = BITS[format]
    levels = (1 << bits) - 1
    nonneg = kind == "nonneg"
    rows2 = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    rows, n = rows2.shape
    groups = -(-n // group_size)
    scales = np.zeros((rows, groups), np.float32)
    mins = np.zeros((rows, groups), np.float32)
    codes = np.zeros((rows, n), np.uint8)
    for r in range(rows):
        for g in range(groups):
            members = range(g * group_size, min((g + 1) * group_size, n))
            hi = max(rows2[r, i] for i in members)
            # Adding +0.0 turns a -0.0 minimum into +0.0: the stored minimum has one bit pattern.
            lo = np.float32(0) if nonneg else min(rows2[r, i] for i in members) + np.float32(0)
            scales[r, g] = np.float32(max(np.float32(hi - lo), EPS) / np.float32(levels))
            mins[r, g] = lo
            for i in members:
                codes[r, i] = _code(rows2[r, i], lo, scales[r, g], levels, nonneg, stochastic,
                                    seed, r * n + i)
    out = {"codes": pack_bits_ref(codes, bits), "scales": scales}
    if not nonneg:
        out["mins"] = mins
    return out


def unpack_activation_ref(held, shape, format, kind="values", group_size=256):
    """float32 values of shape ``shape`` from the arrays of ``pack_activation_ref``."""
    if format == "fp32":
        return held["data"].reshape(shape).astype(np.float32)
    size = math.prod(shape)
    if format == "sparse":
        mask = unpack_bits_ref(held["mask"], 1, size)
        out = np.zeros(size, np.float32)
        k = 0
        for i in range(size):
            if mask[i]:
                out[i] = np.float32(held["codes"][k]) * held["scales"][k // group_size]
                k += 1
        return out.reshape(shape)
    bits = BITS[format]
    n = shape[-1] if shape else 1
    rows = size // n if n else math.prod(shape[:-1])
    codes = unpack_bits_ref(held["codes"], bits, n)
    out = np.zeros((rows, n), np.float32)
    for r in range(rows):
        for i in range(n):
            g = i // group_size
            step = np.float32(codes[r, i]) * held["scales"][r, g]
            out[r, i] = step if kind == "nonneg" else np.float32(held["mins"][r, g] + step)
    return out.reshape(shape)
