"""Numba segmented attention: flash-style blocks, online softmax, BLAS products via ``np.dot``.

Forward: one work item per (segment, head, query block of ``BLOCK_Q`` rows); each walks the key
blocks of its segment with an online softmax, so one ``BLOCK_Q x BLOCK_K`` block of scores is
alive per thread. Backward: one work item per (segment, head); it walks key blocks, recomputes
the probabilities from the saved logsumexp one block at a time, accumulates ``dk``/``dv`` of the
key block and ``dq`` of the whole segment (owned by the item, so no atomics). Grouped heads
write per-query-head ``dk``/``dv`` partials that are summed over each group in a fixed order,
so results are bitwise deterministic whatever the thread count.

Work items are sorted by cost and dealt to one slot per thread (``_schedule``): segments of
very different lengths would otherwise leave threads idle under Numba's static chunking.
``np.dot`` runs the products through the BLAS SciPy ships; that BLAS is held at one thread
during a call (``lowbit._backend.single_threaded_blas``) because the items already occupy every
core.

Siblings: ``_numpy.py``, ``_cuda.py``; reference ``reference/segmented_attention.py``.
"""


import numba
import numpy as np
from numba import types
from numba.extending import overload

from ... import _backend

BLOCK_Q = 64
BLOCK_K = 128

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


def _exp_inplace(row, shift, count):
    """row[:count] = exp(row[:count] - shift); returns their sum (a Numba overload).

    In place on one array: with a separate destination LLVM adds a runtime overlap check and
    falls back to scalar code when the two are the same buffer.
    """
    raise NotImplementedError("only callable from Numba code")


@overload(_exp_inplace, jit_options={"fastmath": True})
def _exp_inplace_impl(row, shift, count):
    # fastmath lets LLVM vectorize the polynomial and the sum; inputs never hold inf or NaN.
    if row.dtype != types.float32:
        def exp64(row, shift, count):
            total = 0.0
            for c in range(count):
                row[c] = np.exp(row[c] - shift)
                total += row[c]
            return total
        return exp64

    c0, c1, c2, c3, c4, c5 = (np.float32(c) for c in _EXP_POLY)
    log2e, hi, lo = np.float32(_LOG2E), np.float32(_LN2_HI), np.float32(_LN2_LO)
    lowest, half, one = np.float32(_EXP_MIN), np.float32(0.5), np.float32(1.0)
    bias, bits = np.int32(_FLOAT32_BIAS), np.int32(_FLOAT32_MANTISSA_BITS)

    def exp32(row, shift, count):
        total = np.float32(0.0)
        for c in range(count):
            x = max(row[c] - shift, lowest)
            n = np.floor(x * log2e + half)
            r = x - n * hi - n * lo
            p = c0
            p = p * r + c1
            p = p * r + c2
            p = p * r + c3
            p = p * r + c4
            p = p * r + c5
            p = p * r * r + r + one
            e = p * np.int32((np.int32(n) + bias) << bits).view(np.float32)
            row[c] = e
            total += e
        return total
    return exp32


# No NaN among the scores lets LLVM vectorize the max; infinities stay allowed (start = -inf).
@numba.njit(fastmath={"nnan", "nsz", "reassoc"}, cache=True)
def _row_max(row, count, start):
    """max(start, row[:count])."""
    best = start
    for c in range(count):
        best = max(best, row[c])
    return best


@numba.njit(parallel=True, cache=True)
def _forward(q, kt, vt, items, order, slots, scale, causal, group, out, lse):
    dim, dv = q.shape[2], vt.shape[2]
    for slot in numba.prange(slots.size - 1):
        for pos in range(slots[slot], slots[slot + 1]):
            it = order[pos]
            h, q0, q1, s0, s1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3], items[it, 4]
            g = h // group
            rows = q1 - q0
            qs = np.empty((rows, dim), q.dtype)
            for r in range(rows):
                for d in range(dim):
                    qs[r, d] = q[q0 + r, h, d] * scale
            m = np.full(rows, -np.inf, q.dtype)
            den = np.zeros(rows, q.dtype)
            acc = np.zeros((rows, dv), q.dtype)
            stop = min(s1, q1) if causal else s1
            for k0 in range(s0, stop, BLOCK_K):
                k1 = min(k0 + BLOCK_K, stop)
                cols = k1 - k0
                s = np.dot(qs, kt[g, k0:k1].T)  # scores, then probabilities in place
                for r in range(rows):
                    # Causal rows above this key block see none of it (valid = 0).
                    valid = max(0, min(cols, q0 + r - k0 + 1)) if causal else cols
                    new_m = _row_max(s[r], valid, m[r])
                    alpha = np.exp(m[r] - new_m)
                    den[r] = den[r] * alpha + _exp_inplace(s[r], new_m, valid)
                    for c in range(valid, cols):
                        s[r, c] = 0
                    m[r] = new_m
                    for d in range(dv):
                        acc[r, d] *= alpha
                acc += np.dot(s, vt[g, k0:k1])
            for r in range(rows):
                inv = 1 / den[r]
                for d in range(dv):
                    out[q0 + r, h, d] = acc[r, d] * inv
                lse[h, q0 + r] = m[r] + np.log(den[r])


@numba.njit(parallel=True, cache=True)
def _backward(dout, q, kt, vt, out, lse, items, order, slots, scale, causal, group, dq, dk_part,
              dv_part):
    dim, dv = q.shape[2], vt.shape[2]
    for slot in numba.prange(slots.size - 1):
        for pos in range(slots[slot], slots[slot + 1]):
            it = order[pos]
            h, s0, s1 = items[it, 0], items[it, 1], items[it, 2]
            g = h // group
            length = s1 - s0
            # Scores use q * scale, so dk = dS^T (q * scale) directly; dq is scaled at the end.
            qs = np.empty((length, dim), q.dtype)
            do = np.empty((length, dv), q.dtype)
            delta = np.zeros(length, q.dtype)
            for r in range(length):
                for d in range(dim):
                    qs[r, d] = q[s0 + r, h, d] * scale
                for d in range(dv):
                    do[r, d] = dout[s0 + r, h, d]
                    delta[r] += dout[s0 + r, h, d] * out[s0 + r, h, d]
            dq_acc = np.zeros((length, dim), q.dtype)
            for k0 in range(s0, s1, BLOCK_K):
                k1 = min(k0 + BLOCK_K, s1)
                cols = k1 - k0
                kb, vb = kt[g, k0:k1], vt[g, k0:k1]
                dk_acc = np.zeros((cols, dim), q.dtype)
                dv_acc = np.zeros((cols, dv), q.dtype)
                for r0 in range(k0 - s0 if causal else 0, length, BLOCK_Q):
                    r1 = min(r0 + BLOCK_Q, length)
                    rows = r1 - r0
                    p = np.dot(qs[r0:r1], kb.T)  # scores, then probabilities in place
                    for r in range(rows):
                        # r0 >= k0 - s0 when causal: every row sees at least one key.
                        valid = min(cols, s0 + r0 + r - k0 + 1) if causal else cols
                        _exp_inplace(p[r], lse[h, s0 + r0 + r], valid)
                        for c in range(valid, cols):
                            p[r, c] = 0
                    dv_acc += np.dot(p.T, do[r0:r1])
                    ds = np.dot(do[r0:r1], vb.T)
                    for r in range(rows):
                        for c in range(cols):
                            ds[r, c] = p[r, c] * (ds[r, c] - delta[r0 + r])
                    dk_acc += np.dot(ds.T, qs[r0:r1])
                    dq_acc[r0:r1] += np.dot(ds, kb)
                dk_part[h, k0:k1] = dk_acc
                dv_part[h, k0:k1] = dv_acc
            for r in range(length):
                for d in range(dim):
                    dq[s0 + r, h, d] = dq_acc[r, d] * scale


def _schedule(costs, slots):
    """Deal items to ``slots`` lists, costliest first in snake order, balancing their totals.

    Returns:
        (order, bounds): slot ``i`` runs items ``order[bounds[i]:bounds[i + 1]]``.
    """
    by_cost = np.argsort(-costs, kind="stable")
    lap = np.arange(by_cost.size) % (2 * slots)
    slot_of = np.where(lap < slots, lap, 2 * slots - 1 - lap)
    grouped = np.argsort(slot_of, kind="stable")
    order = by_cost[grouped].astype(np.int64)
    bounds = np.zeros(slots + 1, np.int64)
    np.cumsum(np.bincount(slot_of, minlength=slots), out=bounds[1:])
    return order, bounds


def _by_head(x):
    """[T, heads, dim] -> contiguous [heads, T, dim]: key/value blocks become contiguous rows."""
    return np.ascontiguousarray(x.transpose(1, 0, 2))


def _forward_items(offsets, heads, causal):
    starts, stops = offsets[:-1], offsets[1:]
    blocks = -(-(stops - starts) // BLOCK_Q)
    seg = np.repeat(np.arange(starts.size), blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    q0 = starts[seg] + (np.arange(seg.size) - first) * BLOCK_Q
    q1 = np.minimum(q0 + BLOCK_Q, stops[seg])
    per_head = np.stack([q0, q1, starts[seg], stops[seg]], axis=1)
    items = np.concatenate([np.column_stack([np.full(seg.size, h), per_head])
                            for h in range(heads)]).astype(np.int64)
    keys = (items[:, 2] if causal else items[:, 4]) - items[:, 3]
    return items, (items[:, 2] - items[:, 1]) * keys


def forward(q, k, v, offsets, scale, causal):
    """q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] -> (out [T, H, Dv], lse [H, T])."""
    tokens, heads, _ = q.shape
    out = _backend.empty((tokens, heads, v.shape[2]), q.dtype)
    lse = _backend.empty((heads, tokens), q.dtype)
    items, costs = _forward_items(offsets, heads, causal)
    order, slots = _schedule(costs, numba.get_num_threads())
    with _backend.single_threaded_blas():
        _forward(q, _by_head(k), _by_head(v), items, order, slots, q.dtype.type(scale), causal,
                 heads // k.shape[1], out, lse)
    return out, lse


def backward(dout, q, k, v, out, lse, offsets, scale, causal):
    """Recompute probabilities from ``lse`` block by block -> (dq, dk, dv) like q, k, v."""
    tokens, heads, dim = q.shape
    kv_heads, dv_dim = k.shape[1], v.shape[2]
    group = heads // kv_heads
    lengths = np.diff(offsets)
    items = np.stack([np.repeat(np.arange(heads), lengths.size),
                      np.tile(offsets[:-1], heads), np.tile(offsets[1:], heads)],
                     axis=1).astype(np.int64)
    order, slots = _schedule(np.tile(lengths, heads) ** 2, numba.get_num_threads())
    dq = _backend.empty(q.shape, q.dtype)
    dk_part = np.empty((heads, tokens, dim), q.dtype)
    dv_part = np.empty((heads, tokens, dv_dim), q.dtype)
    with _backend.single_threaded_blas():
        _backward(dout, q, _by_head(k), _by_head(v), out, lse, items, order, slots,
                  q.dtype.type(scale), causal, group, dq, dk_part, dv_part)
    dk = _backend.empty(k.shape, k.dtype)
    dv = _backend.empty(v.shape, v.dtype)
    # The group's partials add in head order: the same sum whatever the thread count.
    dk[...] = dk_part.reshape(kv_heads, group, tokens, dim).sum(axis=1).transpose(1, 0, 2)
    dv[...] = dv_part.reshape(kv_heads, group, tokens, dv_dim).sum(axis=1).transpose(1, 0, 2)
    return dq, dk, dv
