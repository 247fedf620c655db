"""Numba segmented attention forward for segments of few queries against their own keys: decoding
against a KV cache (one query per sequence) and short chunks of it.

The blocked kernels of ``_numba.py`` pack whole query blocks and copy the keys and values head
by head before they start, which a decode step (one query row per sequence, thousands of cached
keys, once per layer and generated token) would spend most of its time on. Here nothing is
copied: one work item per (segment, split of ``split_keys`` keys) reads its keys and values in
place and in memory order (all heads of a token are contiguous: reading them head by head ran
3x slower, bound by memory), computes the scores of every (query, head) row of the segment and
keeps a partial softmax state per row (running max, sum, unnormalized output); a second pass
merges the splits of each row in split order (flash-decoding), so results do not depend on the
thread count. In float32 with feature sizes that are multiples of 16 (``USE_TILES``), the
scores run the register tiles of ``_f32_gemv.py``: four query rows of one kv head against one
key, the key's vectors read once for the four, each score summed in that file's lane order, the
keys and their heads in memory order (tiles of four keys, one head at a time, ran ~15% slower
when the cache came from memory). Elsewhere each score is one dot product over the feature
axis, vectorized with reassociated partial sums (a fixed order for a given build). The scores
are held [keys, rows], so each row's max, exps and sum run over the rows' lanes (each sum still
in order of the keys; the exps masked by a select, so that the loop vectorizes). A call with
1024 cached keys at BitNet b1.58 2B's H = 20, Hkv = 5, D = 128 on the 2-core EPYC Zen 4, 2
threads, the tiles against the dot products in one process: 187 against 218 us with the cache
in the caches (compiled for Haswell: 175 against 196), the same speed from memory (30 caches in
turn: 241 against 256 us, Haswell 272 against 267; items of 32 keys then, see ``SPLITS``). A
values product on register tiles of rows by 64 columns, summed over 16 keys of one head at a
time, was 1.5x faster in cache but 10% slower from memory, and four keys' value rows at a time
(one load and store of the accumulators for four) 1.18x in cache, 0.84x from DRAM (1024 keys,
Haswell build), so the values are added one key's row at a time. A prefetch of each key's
values while its scores run cost 25% from DRAM.
Allocations are per item and linear: scores [split keys, rows], partial outputs [rows, Dv].

Used when ``takes``: the keys have segments of their own (``k_lengths`` unlike ``lengths``: the
calls without ``k_lengths`` keep the blocked kernels and their results bit for bit) and no
segment has more than ``SHORT_ROWS`` queries. Siblings: ``_numba.py``, ``_numba_softmax.py``;
reference ``reference/segmented_attention.py``.
"""

import functools

import numba
import numpy as np

from ... import _backend
from ..packed_matmul._numba import _f32_gemv
from ._numba_softmax import _CONTRACT, _EXP_MIN, _visible_exp

#: Most queries per segment for this path; longer segments reuse each key over a query block,
#: which the blocked kernels do better.
SHORT_ROWS = 16
#: Keys per work item (all heads) of a segment of ``k`` keys: ``SPLITS`` items of a multiple of
#: 32 keys, at least ``SPLIT_KEYS`` (128 cached keys give 4 items, enough to keep a few threads
#: busy at one sequence: 128 keys a split left one of 2 cores idle at a context of 129, 78
#: against 67 us) and at most ``MAX_SPLIT_KEYS`` (its keys and values, 640 KiB at Hkv = 5, D =
#: 128 in float32, and its scores stream through L2). Each item costs a few microseconds of its
#: own (its rows, scratch and partial state, and their merge): at 1024 keys, BitNet 2B's H =
#: 20, Hkv = 5, D = 128, 30 caches from DRAM in turn, compiled for Haswell on the 2-core EPYC
#: Zen 4, 32 keys an item took 344 us a call, 64 277 us, 128 248 us (2048 keys: 511, 457, 445).
#: A segment's split depends on its own keys only: its results do not depend on the thread count
#: or on the other segments of the call.
SPLITS = 8
SPLIT_KEYS = 32
MAX_SPLIT_KEYS = 128


def split_keys(k_lengths):
    """Keys per work item of each key segment (int64 array like ``k_lengths``)."""
    return np.clip(-(-k_lengths // (32 * SPLITS)) * 32, SPLIT_KEYS, MAX_SPLIT_KEYS)


#: Whether float32 scores with a feature size that is a multiple of 16 run the register tiles
#: of ``_f32_gemv.py`` (four query rows of one kv head by one key; else one dot per score).
USE_TILES = _f32_gemv.AVAILABLE


def _key(offsets):
    return np.ascontiguousarray(offsets, np.int64).tobytes()


def takes(offsets, k_offsets):
    """Whether this path runs the forward of these query and key segments (from the bytes of
    the offsets and their cached ``_plan``: ``np.array_equal`` and ``np.diff`` took 5 us, a
    tenth of a decode layer's attention at 128 keys)."""
    q_key, k_key = _key(offsets), _key(k_offsets)
    return q_key != k_key and _plan(q_key, k_key)[2] <= SHORT_ROWS


@numba.njit(cache=True, fastmath={"reassoc", "contract"})
def _dot(a, b):
    """sum(a * b) over one feature axis, in vectorized partial sums."""
    total = a.dtype.type(0)
    for d in range(a.size):
        total += a[d] * b[d]
    return total


@numba.njit(cache=True)
def _scores(qs, heads_kv, k, ka, stop, scores):
    """scores[j, r] = qs[r] . k[ka + j, heads_kv[r]] for the keys row r sees (ka + j < stop[r]),
    -inf for the others: the key rows are read in memory order, each once for every row."""
    neg = scores.dtype.type(-np.inf)
    for j in range(scores.shape[0]):
        for r in range(qs.shape[0]):
            scores[j, r] = _dot(qs[r], k[ka + j, heads_kv[r]]) if ka + j < stop[r] else neg


@numba.njit(cache=True)
def _scores_tiles(qs, k2, ka, heads, kv_heads, group, scores):
    """``_scores`` without the -inf (the callers' ``_probabilities`` masks by ``seen``), float32
    by ``_f32_gemv``'s tiles: ``k2`` is the keys [tokens * kv_heads, D] (D a multiple of 16),
    each tile four query rows of one kv head (the rest of a group one at a time) by one key, the
    keys and their heads in memory order (tiles of several keys, one head at a time, ran 15%
    slower from memory at 1024 keys)."""
    one = np.ones(1, np.float32)
    nvec = qs.shape[1] // 16
    grouped = group - group % 4
    for j in range(scores.shape[0]):
        for p in range(qs.shape[0] // heads):
            for h in range(kv_heads):
                r0 = p * heads + h * group
                n0 = (ka + j) * kv_heads + h
                for m in range(r0, r0 + grouped, 4):
                    _f32_gemv.T_41(qs, m, k2, n0, kv_heads, nvec, one, 0, scores, j)
                for r in range(r0 + grouped, r0 + group):
                    _f32_gemv.T_11(qs, r, k2, n0, kv_heads, nvec, one, 0, scores, j)


@numba.njit(cache=True, fastmath=_CONTRACT)
def _probabilities(scores, seen, top, total):
    """In place, rows in the lanes: ``top[r]`` the max of row r's scores over the keys it sees
    (``j < seen[r]``; -inf: none), ``scores[j, r] = exp(scores[j, r] - top[r])`` there and
    exactly 0 elsewhere, ``total[r]`` their sum in order of j."""
    zero = scores.dtype.type(0)
    top[:] = -np.inf
    total[:] = zero
    low = scores.dtype.type(_EXP_MIN)
    for j in range(scores.shape[0]):
        for r in range(scores.shape[1]):
            x = scores[j, r]
            top[r] = x if x > top[r] and j < seen[r] else top[r]
    for j in range(scores.shape[0]):
        for r in range(scores.shape[1]):
            # A hidden key weighs exactly 0 (and a row that sees none has no exp to take): the
            # exp of every lane, masked by a select, so that the loop vectorizes.
            e = _visible_exp(scores[j, r], top[r], j < seen[r], low, zero)
            scores[j, r] = e
            total[r] += e


@numba.njit(cache=True)
def _weighted_values(weights, heads_kv, v, ka, acc):
    """acc[r] += sum_j weights[j, r] * v[ka + j, heads_kv[r]], the value rows in memory order."""
    for j in range(weights.shape[0]):
        for r in range(acc.shape[0]):
            e = weights[j, r]
            value = v[ka + j, heads_kv[r]]
            for d in range(acc.shape[1]):
                acc[r, d] += e * value[d]


@numba.njit(cache=True)
def _rows(q, offsets, k_offsets, item, scale, causal, group):
    """The rows of a work item (segment, first key, key stop), row r = query r // H of the
    segment, head r % H: their scaled queries (contiguous), kv heads and the end of the keys
    each sees."""
    heads, dim = q.shape[1], q.shape[2]
    s, ka, kb = item[0], item[1], item[2]
    q0 = offsets[s]
    # Query p sees keys up to p + shift (bottom-right alignment), when causal.
    shift = k_offsets[s + 1] - offsets[s + 1]
    rows = (offsets[s + 1] - q0) * heads
    qs = np.empty((rows, dim), q.dtype)
    heads_kv = np.empty(rows, np.int64)
    stop = np.empty(rows, np.int64)
    for r in range(rows):
        p, h = q0 + r // heads, r % heads
        for d in range(dim):  # a contiguous row (the head's index inside it kept it scalar)
            qs[r, d] = q[p, h, d] * scale
        heads_kv[r] = h // group
        stop[r] = max(ka, min(kb, p + shift + 1)) if causal else kb
    return qs, heads_kv, stop


@numba.njit(cache=True)
def _softmax(scores, stop, ka, m_part, l_part, it):
    """The softmax state of item ``it`` (``scores`` [keys, rows] to probabilities, in place)."""
    rows = scores.shape[1]
    top = np.empty(rows, scores.dtype)
    total = np.empty(rows, scores.dtype)
    _probabilities(scores, stop - ka, top, total)
    m_part[it, :rows] = top
    l_part[it, :rows] = total


@numba.njit(parallel=True, cache=True)
def _partials(q, k, v, offsets, k_offsets, items, scale, causal, group, m_part, l_part,
              acc_part):
    """Per item (segment, first key, key stop): for each row r (query r // H of the segment,
    head r % H), m_part[it, r] the max of the scaled scores it sees among these keys (-inf:
    none), l_part[it, r] the sum of exp(score - max), acc_part[it, r] those weights times v."""
    for it in numba.prange(items.shape[0]):
        ka, kb = items[it, 1], items[it, 2]
        qs, heads_kv, stop = _rows(q, offsets, k_offsets, items[it], scale, causal, group)
        # Scores [keys, rows]: the softmax steps run along each row's column, over the rows'
        # lanes (row by row, its max, exps and sum took a third of the item's time).
        scores = np.empty((kb - ka, qs.shape[0]), q.dtype)
        _scores(qs, heads_kv, k, ka, stop, scores)
        _softmax(scores, stop, ka, m_part, l_part, it)
        acc = np.zeros((qs.shape[0], v.shape[2]), q.dtype)
        _weighted_values(scores, heads_kv, v, ka, acc)
        acc_part[it, :qs.shape[0]] = acc


@numba.njit(parallel=True, cache=True)
def _partials_tiles(q, k, v, offsets, k_offsets, items, scale, causal, group, m_part, l_part,
                    acc_part):
    """``_partials`` of float32, the scores by ``_scores_tiles``."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    k2 = k.reshape((k.shape[0] * kv_heads, dim))
    for it in numba.prange(items.shape[0]):
        ka, kb = items[it, 1], items[it, 2]
        qs, heads_kv, stop = _rows(q, offsets, k_offsets, items[it], scale, causal, group)
        scores = np.empty((kb - ka, qs.shape[0]), q.dtype)
        _scores_tiles(qs, k2, ka, heads, kv_heads, group, scores)
        _softmax(scores, stop, ka, m_part, l_part, it)
        acc = np.zeros((qs.shape[0], v.shape[2]), q.dtype)
        _weighted_values(scores, heads_kv, v, ka, acc)
        acc_part[it, :qs.shape[0]] = acc


@numba.njit(cache=True)
def _merge(m_part, l_part, acc_part, offsets, first, group, out, lse):
    """Merges the splits first[s]:first[s + 1] of each row of segment s, in split order."""
    heads, dv = out.shape[1], out.shape[2]
    for sh in range((offsets.size - 1) * heads):
        s, h = sh // heads, sh % heads
        q0 = offsets[s]
        for p in range(q0, offsets[s + 1]):
            r = (p - q0) * heads + h
            top = m_part[first[s], r]
            for c in range(first[s] + 1, first[s + 1]):
                top = max(top, m_part[c, r])
            for d in range(dv):
                out[p, h, d] = 0
            if top == -np.inf:  # the row sees no key: out 0, lse -inf
                lse[h, p] = top
                continue
            total = l_part.dtype.type(0)
            for c in range(first[s], first[s + 1]):
                w = np.exp(m_part[c, r] - top)  # 0 for a split the row sees nothing of
                total += w * l_part[c, r]
                for d in range(dv):
                    out[p, h, d] += w * acc_part[c, r, d]
            inv = 1 / total
            for d in range(dv):
                out[p, h, d] *= inv
            lse[h, p] = top + np.log(total)


@functools.lru_cache(maxsize=64)
def _plan(offset_bytes: bytes, k_offset_bytes: bytes):
    """(items [n, 3] (segment, first key, key stop), first [segments + 1], most rows a segment
    has) of these segments, read-only: the same for every layer of a decode step."""
    offsets = np.frombuffer(offset_bytes, np.int64)
    k_offsets = np.frombuffer(k_offset_bytes, np.int64)
    k_lengths = np.diff(k_offsets)
    split = split_keys(k_lengths)
    splits = np.maximum(1, -(-k_lengths // split))  # an empty key segment: one empty split
    first = np.zeros(splits.size + 1, np.int64)
    np.cumsum(splits, out=first[1:])
    # Items in (segment, split) order: segment s has items first[s]:first[s + 1].
    seg = np.repeat(np.arange(splits.size), splits)
    ka = k_offsets[:-1][seg] + (np.arange(seg.size) - first[seg]) * split[seg]
    items = np.stack([seg, ka, np.minimum(ka + split[seg], k_offsets[1:][seg])],
                     axis=1).astype(np.int64)
    items.flags.writeable = first.flags.writeable = False
    return items, first, int(np.diff(offsets).max())


def forward(q, k, v, offsets, k_offsets, scale, causal):
    """q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> (out [Tq, H, Dv], lse [H, Tq])."""
    tokens, heads, _ = q.shape
    dv = v.shape[2]
    items, first, most = _plan(_key(offsets), _key(k_offsets))
    rows = most * heads
    n = items.shape[0]
    m_part = np.empty((n, rows), q.dtype)
    l_part = np.empty((n, rows), q.dtype)
    acc_part = np.empty((n, rows, dv), q.dtype)
    q, k, v = _backend.read_only(q, k, v)
    tiles = (USE_TILES and q.dtype == np.float32 and q.shape[2] % 16 == 0
             and k.flags.c_contiguous)
    (_partials_tiles if tiles else _partials)(
        q, k, v, offsets, k_offsets, items, q.dtype.type(scale), causal, heads // k.shape[1],
        m_part, l_part, acc_part)
    out = _backend.empty((tokens, heads, dv), q.dtype)
    lse = _backend.empty((heads, tokens), q.dtype)
    _merge(m_part, l_part, acc_part, offsets, first, heads // k.shape[1], out, lse)
    return out, lse
