"""The segmented attention's masked softmax steps for the Numba kernels of ``_numba.py``: a
float32 exp (Cephes' polynomial, inlined into the lane loops), the running column max, the
probabilities of a transposed score block with their column sums, and the backward's one sweep
to probabilities and dS. Each step masks causally hidden keys to exact zeros.

Siblings: ``_numba.py`` (the kernels that call these), ``_numpy.py``, ``_cuda.py``; reference
``reference/segmented_attention.py``.
"""

import numba
import numpy as np
from numba import types
from numba.extending import overload

# Cephes' single-precision exp: exp(x) = 2**n * exp(r), r = x - n ln 2 split in two parts
# (Cody-Waite), exp(r) by a degree-7 polynomial; relative error ~1.2e-7 on the reduced range.
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)
#: Below this exp underflows float32's normal range; clamping keeps 2**n a normal float.
_EXP_MIN = -87.0
_FLOAT32_BIAS = 127
_FLOAT32_MANTISSA_BITS = 23


def _exp(x):
    """exp(x) of one float (a Numba overload): Cephes' polynomial for float32, ``np.exp`` else."""
    raise NotImplementedError("only callable from Numba code")


@overload(_exp, inline="always")
def _exp_impl(x):
    if x != types.float32:
        return lambda x: np.exp(x)

    c0, c1, c2, c3, c4, c5 = (np.float32(c) for c in _EXP_POLY)
    log2e, hi, lo = np.float32(_LOG2E), np.float32(_LN2_HI), np.float32(_LN2_LO)
    lowest, half, one = np.float32(_EXP_MIN), np.float32(0.5), np.float32(1.0)
    bias, bits = np.int32(_FLOAT32_BIAS), np.int32(_FLOAT32_MANTISSA_BITS)

    def exp32(x):
        x = x if x > lowest else lowest
        n = np.floor(x * log2e + half)
        r = x - n * hi - n * lo
        p = c0
        p = p * r + c1
        p = p * r + c2
        p = p * r + c3
        p = p * r + c4
        p = p * r + c5
        p = p * r * r + r + one
        return p * np.int32((np.int32(n) + bias) << bits).view(np.float32)
    return exp32


# The lane loops below run over every lane and mask with a select: LLVM vectorizes a loop that
# starts at 0 but not one whose start is a runtime value (measured: 0.3 against 7 ns per
# element). Vectorizing across independent lanes reassociates nothing; the exps may fuse their
# multiply-adds (``contract``, the only fast-math flag: one rounding instead of two, nothing
# reordered), which shortens the polynomial's dependency chain: 0.65 against 0.9 ns per element
# of the backward's sweep on the EPYC, where the chain's latency bounds the loop.
_CONTRACT = {"contract"}

@numba.njit(cache=True)
def _first_visible(c, diag, causal, rows):
    """First query lane that sees key row ``c`` of a block: causal keeps key ``k0 + c`` from the
    queries before it, ``diag = q0 - k0`` being the block's first query minus its first key."""
    if not causal:
        return 0
    return min(rows, max(0, c - diag))


@numba.njit(cache=True, fastmath=_CONTRACT, inline="always")
def _visible_exp(score, shift, visible, low, zero):
    """exp(score - shift) if visible, else exactly zero (a hidden score: exp of low, in range)."""
    e = _exp(score - shift if visible else low)
    return e if visible else zero


@numba.njit(cache=True, fastmath=_CONTRACT)
def _exp_columns(block, shift, den, diag, causal):
    """Probabilities of a transposed score block [keys, queries], in place.

    ``block[c, j] = exp(block[c, j] - shift[j])`` where key ``c`` is visible to query ``j``,
    exactly 0 elsewhere; ``den[j]`` gains the column's sum.
    """
    rows = block.shape[1]
    low = block.dtype.type(_EXP_MIN)
    zero = block.dtype.type(0)
    for c in range(block.shape[0]):
        lo = _first_visible(c, diag, causal, rows)
        for j in range(rows):
            e = _visible_exp(block[c, j], shift[j], j >= lo, low, zero)
            block[c, j] = e
            den[j] += e


@numba.njit(cache=True, fastmath=_CONTRACT)
def _probabilities_and_dscores(p, ds, shift, delta, diag, causal):
    """The backward's elementwise step over transposed [keys, queries] blocks, in place, in one
    sweep: ``p`` from scores to probabilities ``exp(p - shift)`` (0 where hidden), ``ds`` from
    ``dP`` to ``dS = p * (dP - delta)``."""
    rows = p.shape[1]
    low = p.dtype.type(_EXP_MIN)
    zero = p.dtype.type(0)
    for c in range(p.shape[0]):
        lo = _first_visible(c, diag, causal, rows)
        for j in range(rows):
            e = _visible_exp(p[c, j], shift[j], j >= lo, low, zero)
            p[c, j] = e
            ds[c, j] = e * (ds[c, j] - delta[j])


@numba.njit(cache=True)
def _column_max(block, m, diag, causal):
    """m[j] = max(m[j], block[c, j]) over the keys ``c`` query ``j`` sees (a running max)."""
    rows = block.shape[1]
    for c in range(block.shape[0]):
        lo = _first_visible(c, diag, causal, rows)
        for j in range(rows):
            x = block[c, j]
            m[j] = x if x > m[j] and j >= lo else m[j]
