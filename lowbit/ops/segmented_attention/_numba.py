"""Numba segmented attention: flash-style blocks, transposed scores, register-tile products.

Every score block is computed transposed, keys by queries (``S^T = K Q^T``): the softmax then
runs along each query's column, so the max, the exp and the row sums are elementwise over the
query lanes of one key row and vectorize without reassociating any sum.

Products: float32 on a CPU with AVX-512, or AVX2 and FMA (``USE_FMA``), runs the register tiles of
``lowbit/ops/packed_matmul/_numba/_fma.py`` (6 x 64 accumulators, fused multiply-adds in a fixed
order); float64, or a CPU without them, ``np.dot`` to the BLAS SciPy ships, whose OpenBLAS runs its
AVX2 kernels on AMD Zen: on one core of the 2-core EPYC (Zen 5), T = 8192 in 6 segments of 512-2048
tokens, H = 8, D = 64, the tiles take 143-149 ms for the forward against 280-290 ms through BLAS,
309-325 against 642-685 ms for the backward. The tiles read their right operand as panels of 64
columns: the operands read that way are packed so, zero-padded (``_panels``: keys and values per
head; per item the scaled queries and ``dout``, as [D, 64] panels of 64 query lanes and as
64-column panels), and query rows are padded to whole panels; padded lanes (zero q, dout, delta and
lse) only add exact zeros.

Forward: one work item per (head, query block of ``BLOCK_Q`` rows, ``BLOCK_Q_CAUSAL`` when
causal); it walks its segment's keys ``CHUNK_K`` at a time with an online softmax (rescaling
only once per chunk). Backward: one work item per (head, segment), packing its queries and
``dout`` and computing ``delta = rowsum(dout * out)`` once; it walks key blocks of
``BACKWARD_K`` rows and, inside each, query blocks of ``BACKWARD_Q`` rows: the scores and dP,
then one sweep to the probabilities (recomputed from the saved logsumexp) and dS, feeding the
products of ``dv``, ``dk`` and ``dq`` (accumulated in place by the tiles). ``dk``/``dv`` of a key
block and ``dq`` of the segment are owned by the item, so there are no atomics; grouped heads
write per-query-head ``dk``/``dv`` partials that are summed over each group in a fixed order, so
results are bitwise deterministic whatever the thread count.

Keys may have segments of their own (``k_offsets``): items carry their key range, and the
causal mask is aligned bottom-right (query ``p`` sees keys up to ``p + shift``, ``shift`` = key
segment end - query segment end); a row that sees no key keeps a zero state and gets out 0 and
lse -inf. Segments of few queries against their own keys (decoding) run ``_numba_decode.py``.

Work items are sorted by cost and dealt to one slot per thread (``_schedule``): segments of
very different lengths would otherwise leave threads idle under Numba's static chunking. The
BLAS is held at one thread during a call (``lowbit._backend.single_threaded_blas``) because the
items already occupy every core.

Siblings: ``_numba_softmax.py`` (the masked softmax steps these kernels call; on the AVX-512
path their zmm versions in ``_numba_exp.py``), ``_numpy.py``,
``_cuda.py``; reference ``reference/segmented_attention.py``.
"""


import numba
import numpy as np

from ... import _backend
from ..packed_matmul._numba import _f32_gemv, _fma, _llvm
from . import _numba_decode, _numba_exp
from ._numba_softmax import _column_max, _exp_columns, _probabilities_and_dscores

# The tile kernels call the tiles of ``_fma.py`` and the intrinsics of ``_numba_exp.py`` built
# with ``_llvm.py``'s helpers, which Numba's cache does not key on.
_backend.numba_cache_guard(__file__, _fma.__file__, _llvm.__file__, _f32_gemv.__file__)

#: Whether float32 runs the register tiles of ``_fma.py`` (else BLAS, as float64 does).
USE_FMA = _fma.AVAILABLE
# The tile kernels' softmax steps: on zmm registers with AVX-512, else the lane loops (which LLVM
# vectorizes at the CPU's width, 256 bits on AVX2).
if _fma.WIDE:
    _exp_step, _probability_step = _numba_exp.exp_columns, _numba_exp.probabilities_and_dscores
else:
    _exp_step, _probability_step = _exp_columns, _probabilities_and_dscores

#: Forward query rows per item and keys per softmax step: a [CHUNK_K, BLOCK_Q] score block
#: (512 KiB in float32) stays in a core's L2 between its two products. Backward key rows per
#: item step and query rows per block (query rows here and below: multiples of the tiles' 64
#: lanes, ``BLOCK_Q_CAUSAL`` at most ``BLOCK_Q``). Chosen by timing on the EPYC: through BLAS,
#: smaller blocks lose 5-10% to the calls' overhead; the tiles run within 3% of these at 128 to
#: 512 rows or keys (forward and backward, full and causal).
BLOCK_Q = 256
CHUNK_K = 512
BACKWARD_K = 256
BACKWARD_Q = 256
#: Causal forward query rows per item: a block computes the scores of its last keys for every
#: row and masks half of them, so smaller blocks waste less (an eighth of a 1024-token segment).
BLOCK_Q_CAUSAL = 128
#: Causal backward key rows per item step (at most ``BACKWARD_K``), for the same reason.
BACKWARD_K_CAUSAL = 128

@numba.njit(cache=True)
def _matrix(buffer, rows, cols):
    """A C-contiguous [rows, cols] view of the front of a flat scratch buffer (``np.dot``'s
    ``out`` must be contiguous, and a reused buffer spares an allocation per product)."""
    return buffer[:rows * cols].reshape((rows, cols))


@numba.njit(parallel=True, cache=True)
def _forward(q, kt, vt, items, order, slots, scale, causal, group, out, lse):
    dim, dv = q.shape[2], vt.shape[2]
    for slot in numba.prange(slots.size - 1):
        scores = np.empty(CHUNK_K * BLOCK_Q, q.dtype)
        products = np.empty(BLOCK_Q * dv, q.dtype)
        for pos in range(slots[slot], slots[slot + 1]):
            it = order[pos]
            h, q0, q1, s0, s1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3], items[it, 4]
            shift = items[it, 5]
            g = h // group
            rows = q1 - q0
            qs = np.empty((rows, dim), q.dtype)
            for r in range(rows):
                for d in range(dim):
                    qs[r, d] = q[q0 + r, h, d] * scale
            m = np.full(rows, -np.inf, q.dtype)
            alpha = np.empty(rows, q.dtype)  # the old max, then its rescaling factor
            den = np.zeros(rows, q.dtype)
            acc = np.zeros((rows, dv), q.dtype)
            pv = _matrix(products, rows, dv)
            # Causal: the keys after the block's last query are seen by none of its rows.
            stop = _key_stop(q1, s1, shift, causal)
            for k0 in range(s0, stop, CHUNK_K):
                k1 = min(k0 + CHUNK_K, stop)
                # Scores [keys, queries], then probabilities in place.
                block = _matrix(scores, k1 - k0, rows)
                np.dot(kt[g, k0:k1], qs.T, block)
                alpha[:] = m
                _column_max(block, m, q0 + shift - k0, causal)
                for r in range(rows):
                    alpha[r] = _rescale(alpha[r], m[r])
                    den[r] *= alpha[r]
                _exp_columns(block, m, den, q0 + shift - k0, causal)
                np.dot(block.T, vt[g, k0:k1], pv)
                for r in range(rows):
                    for d in range(dv):
                        acc[r, d] = acc[r, d] * alpha[r] + pv[r, d]
            _finish(acc, m, den, rows, q0, h, out, lse)


@numba.njit(parallel=True, cache=True)
def _backward(dout, q, kt, vt, out, lse, items, order, slots, scale, causal, group, key_block,
              dq, dk_part, dv_part):
    dim, dv = q.shape[2], vt.shape[2]
    for slot in numba.prange(slots.size - 1):
        probs = np.empty(BACKWARD_K * BACKWARD_Q, q.dtype)
        dscores = np.empty(BACKWARD_K * BACKWARD_Q, q.dtype)
        products = np.empty(max(BACKWARD_K, BACKWARD_Q) * max(dim, dv), q.dtype)
        for pos in range(slots[slot], slots[slot + 1]):
            it = order[pos]
            h, s0, s1, k_start, k_stop = (items[it, 0], items[it, 1], items[it, 2], items[it, 3],
                                          items[it, 4])
            shift = k_stop - s1
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
            for k0 in range(k_start, k_stop, key_block):
                k1 = min(k0 + key_block, k_stop)
                cols = k1 - k0
                kb, vb = kt[g, k0:k1], vt[g, k0:k1]
                dk_acc = np.zeros((cols, dim), q.dtype)
                dv_acc = np.zeros((cols, dv), q.dtype)
                # Causal: the queries before the key block see none of it.
                for r0 in range(_first_query(k0, s0, shift, causal), length, BACKWARD_Q):
                    r1 = min(r0 + BACKWARD_Q, length)
                    rows = r1 - r0
                    # Scores and dP [keys, queries], then probabilities and dS in place.
                    p = _matrix(probs, cols, rows)
                    ds = _matrix(dscores, cols, rows)
                    np.dot(kb, qs[r0:r1].T, p)
                    np.dot(vb, do[r0:r1].T, ds)
                    _probabilities_and_dscores(p, ds, lse[h, s0 + r0:s0 + r1], delta[r0:r1],
                                               s0 + r0 + shift - k0, causal)
                    _add_product(dv_acc, p, do[r0:r1], products)
                    _add_product(dk_acc, ds, qs[r0:r1], products)
                    _add_product(dq_acc[r0:r1], ds.T, kb, products)
                dk_part[h, k0:k1] = dk_acc
                dv_part[h, k0:k1] = dv_acc
            for r in range(length):
                for d in range(dim):
                    dq[s0 + r, h, d] = dq_acc[r, d] * scale


@numba.njit(cache=True)
def _key_stop(q1, k_stop, shift, causal):
    """End of the keys that queries before ``q1`` see: causally none past ``q1 - 1 + shift``
    (``shift`` = key segment end - query segment end: bottom-right alignment)."""
    return max(0, min(k_stop, q1 + shift)) if causal else k_stop


@numba.njit(cache=True)
def _first_query(k0, s0, shift, causal):
    """First query (segment-relative, from ``s0``) that sees key ``k0``: causally those with
    ``s0 + r + shift >= k0``."""
    return max(0, k0 - shift - s0) if causal else 0


@numba.njit(cache=True)
def _rescale(old, new):
    """exp(old - new): the online softmax's rescaling; 1 for a row that has seen no key yet
    (both -inf), whose state is all zeros."""
    if new == -np.inf:
        return 1.0
    return np.exp(old - new)


@numba.njit(cache=True)
def _finish(acc, m, den, rows, q0, h, out, lse):
    """out = acc / den and lse = m + log(den) of a block's rows; a row that saw no key (den 0)
    gets out 0 and lse -inf."""
    dv = out.shape[2]
    for r in range(rows):
        if den[r] == 0:
            for d in range(dv):
                out[q0 + r, h, d] = 0
            lse[h, q0 + r] = -np.inf
            continue
        inv = 1 / den[r]
        for d in range(dv):
            out[q0 + r, h, d] = acc[r, d] * inv
        lse[h, q0 + r] = m[r] + np.log(den[r])


@numba.njit(cache=True)
def _add_product(acc, a, b, scratch):
    """acc += a @ b through a product in ``scratch`` (``np.dot`` cannot accumulate)."""
    product = _matrix(scratch, a.shape[0], b.shape[1])
    np.dot(a, b, product)
    acc += product


# The tile path (``USE_FMA``): the packings and products of the tiles, and the two kernels.

@numba.njit(cache=True)
def _pack_rows(x, s0, rows, h, scale, out):
    """out[p, r, j] = x[s0 + r, h, 64 p + j] * scale (zero past ``rows`` or x's last column)."""
    out[...] = 0
    dim = x.shape[2]
    for r in range(rows):
        for d in range(dim):
            out[d // _fma.PANEL, r, d % _fma.PANEL] = x[s0 + r, h, d] * scale


@numba.njit(cache=True)
def _pack_columns(x, s0, rows, h, scale, out):
    """out[r // 64, d, r % 64] = x[s0 + r, h, d] * scale: rows as the lanes of [D, 64] panels."""
    out[...] = 0
    for r in range(rows):
        for d in range(x.shape[2]):
            out[r // _fma.PANEL, d, r % _fma.PANEL] = x[s0 + r, h, d] * scale


@numba.njit(cache=True)
def _scores(a, rows, panels, p0, block):
    """block [rows, 64 n] = a[:rows] @ panels[p0:p0 + n]: a [rows, D] times [D, 64] panels."""
    for p in range(block.shape[1] // _fma.PANEL):
        _fma.panel_block(a, rows, a.shape[1], 1, 0, panels[p0 + p], a.shape[1], block,
                          p * _fma.PANEL, False)


@numba.njit(cache=True)
def _accumulate(acc, a, rows, si, sr, count, panels, r0):
    """acc[:rows] += A[:rows, :count] @ panels[p, r0:r0 + count] for each 64-column panel p of
    acc, A read from ``a`` through the strides ``si``, ``sr`` as in ``_fma.fma_tile``."""
    for p in range(panels.shape[0]):
        _fma.panel_block(a, rows, si, sr, 0, panels[p, r0:r0 + count], count, acc,
                          p * _fma.PANEL, True)


@numba.njit(parallel=True, cache=True)
def _forward_fma(q, kt, vp, items, order, slots, scale, causal, group, out, lse):
    dim, lanes = q.shape[2], _fma.PANEL
    for slot in numba.prange(slots.size - 1):
        scores = np.empty(CHUNK_K * BLOCK_Q, np.float32)
        qt = np.empty((BLOCK_Q // lanes, dim, lanes), np.float32)
        acc = np.empty((BLOCK_Q, vp.shape[1] * lanes), np.float32)
        for pos in range(slots[slot], slots[slot + 1]):
            it = order[pos]
            h, q0, q1, s0, s1 = items[it, 0], items[it, 1], items[it, 2], items[it, 3], items[it, 4]
            shift = items[it, 5]
            g = h // group
            rows = q1 - q0
            wide = -(-rows // lanes) * lanes
            _pack_columns(q, q0, rows, h, scale, qt)
            m = np.full(wide, -np.inf, np.float32)
            old = np.empty(wide, np.float32)  # the max before a chunk
            den = np.zeros(wide, np.float32)
            acc[:wide] = 0
            stop = _key_stop(q1, s1, shift, causal)
            for k0 in range(s0, stop, CHUNK_K):
                k1 = min(k0 + CHUNK_K, stop)
                block = _matrix(scores, k1 - k0, wide)
                _scores(kt[g, k0:k1], k1 - k0, qt, 0, block)
                old[:] = m
                _column_max(block, m, q0 + shift - k0, causal)
                # A row whose max did not move keeps its state (a factor of exactly 1): most
                # rows after the first chunks.
                for r in range(wide):
                    if m[r] != old[r]:
                        alpha = _rescale(old[r], m[r])
                        den[r] *= alpha
                        for d in range(acc.shape[1]):
                            acc[r, d] *= alpha
                _exp_step(block, m, den, q0 + shift - k0, causal)
                # out's rows are the query lanes: A = block^T, read down its columns.
                _accumulate(acc, block, wide, 1, wide, k1 - k0, vp[g], k0)
            _finish(acc, m, den, rows, q0, h, out, lse)


@numba.njit(parallel=True, cache=True)
def _backward_fma(dout, q, kt, vt, kp, out, lse, items, order, slots, scale, causal, group,
                  key_block, dq, dk_part, dv_part):
    dim, dv, lanes = q.shape[2], vt.shape[2], _fma.PANEL
    for slot in numba.prange(slots.size - 1):
        probs = np.empty(BACKWARD_K * BACKWARD_Q, np.float32)
        dscores = np.empty(BACKWARD_K * BACKWARD_Q, np.float32)
        dk_acc = np.empty((BACKWARD_K, kp.shape[1] * lanes), np.float32)
        dv_acc = np.empty((BACKWARD_K, -(-dv // lanes) * lanes), np.float32)
        for pos in range(slots[slot], slots[slot + 1]):
            it = order[pos]
            h, s0, s1, k_start, k_stop = (items[it, 0], items[it, 1], items[it, 2], items[it, 3],
                                          items[it, 4])
            shift = k_stop - s1
            g = h // group
            length = s1 - s0
            wide = -(-length // lanes) * lanes
            # Queries (scaled: dk = dS^T (q * scale) directly, dq is scaled at the end) and
            # dout, as the lanes of the score products and as the panels of dk and dv.
            qt = np.empty((wide // lanes, dim, lanes), np.float32)
            dot = np.empty((wide // lanes, dv, lanes), np.float32)
            qp = np.empty((kp.shape[1], wide, lanes), np.float32)
            dop = np.empty((dv_acc.shape[1] // lanes, wide, lanes), np.float32)
            _pack_columns(q, s0, length, h, scale, qt)
            _pack_columns(dout, s0, length, h, 1, dot)
            _pack_rows(q, s0, length, h, scale, qp)
            _pack_rows(dout, s0, length, h, 1, dop)
            delta = np.zeros(wide, np.float32)
            lse_row = np.zeros(wide, np.float32)
            for r in range(length):
                lse_row[r] = lse[h, s0 + r]
                for d in range(dv):
                    delta[r] += dout[s0 + r, h, d] * out[s0 + r, h, d]
            dq_acc = np.zeros((wide, dk_acc.shape[1]), np.float32)
            for k0 in range(k_start, k_stop, key_block):
                k1 = min(k0 + key_block, k_stop)
                cols = k1 - k0
                kb, vb = kt[g, k0:k1], vt[g, k0:k1]
                dk_acc[:cols] = 0
                dv_acc[:cols] = 0
                # Causal: the query panels before the key block see none of it.
                for r0 in range(_first_query(k0, s0, shift, causal) // lanes * lanes, wide,
                                BACKWARD_Q):
                    r1 = min(r0 + BACKWARD_Q, wide)
                    rows = r1 - r0
                    p = _matrix(probs, cols, rows)
                    ds = _matrix(dscores, cols, rows)
                    _scores(kb, cols, qt, r0 // lanes, p)
                    _scores(vb, cols, dot, r0 // lanes, ds)
                    _probability_step(p, ds, lse_row[r0:r1], delta[r0:r1],
                                                         s0 + r0 + shift - k0, causal)
                    _accumulate(dv_acc, p, cols, rows, 1, rows, dop, r0)
                    _accumulate(dk_acc, ds, cols, rows, 1, rows, qp, r0)
                    # dq's rows are the query lanes: A = dS^T, read down the columns of ds.
                    _accumulate(dq_acc[r0:r1], ds, rows, 1, rows, cols, kp[g], k0)
                dk_part[h, k0:k1] = dk_acc[:cols, :dim]
                dv_part[h, k0:k1] = dv_acc[:cols, :dv]
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


def _forward_items(offsets, k_offsets, heads, causal):
    """Rows (h, q0, q1, key start, key stop, shift = key stop - query segment end) and costs."""
    size = BLOCK_Q_CAUSAL if causal else BLOCK_Q
    starts, stops = offsets[:-1], offsets[1:]
    blocks = -(-(stops - starts) // size)
    seg = np.repeat(np.arange(starts.size), blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    q0 = starts[seg] + (np.arange(seg.size) - first) * size
    q1 = np.minimum(q0 + size, stops[seg])
    k0, k1 = k_offsets[:-1][seg], k_offsets[1:][seg]
    per_head = np.stack([q0, q1, k0, k1, k1 - stops[seg]], axis=1)
    items = np.concatenate([np.column_stack([np.full(seg.size, h), per_head])
                            for h in range(heads)]).astype(np.int64).reshape(-1, 6)
    stop = np.clip(items[:, 2] + items[:, 5], items[:, 3], items[:, 4]) if causal else items[:, 4]
    return items, (items[:, 2] - items[:, 1]) * (stop - items[:, 3])


def _panels(x):
    """[T, heads, dim] -> contiguous [heads, ceil(dim / 64), T, 64], zero-padded: the operands
    the tiles read as 64-column panels."""
    tokens, heads, dim = x.shape
    count = -(-dim // _fma.PANEL)
    padded = np.zeros((heads, tokens, count * _fma.PANEL), x.dtype)
    padded[:, :, :dim] = x.transpose(1, 0, 2)
    return np.ascontiguousarray(
        padded.reshape(heads, tokens, count, _fma.PANEL).transpose(0, 2, 1, 3))


def forward(q, k, v, offsets, k_offsets, scale, causal):
    """q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> (out [Tq, H, Dv], lse [H, Tq])."""
    if _numba_decode.takes(offsets, k_offsets):
        return _numba_decode.forward(q, k, v, offsets, k_offsets, scale, causal)
    tokens, heads, _ = q.shape
    out = _backend.empty((tokens, heads, v.shape[2]), q.dtype)
    lse = _backend.empty((heads, tokens), q.dtype)
    items, costs = _forward_items(offsets, k_offsets, heads, causal)
    order, slots = _schedule(costs, numba.get_num_threads())
    if USE_FMA and q.dtype == np.float32:
        _forward_fma(*_backend.read_only(q, _by_head(k), _panels(v)), items, order, slots,
                     np.float32(scale), causal, heads // k.shape[1], out, lse)
        return out, lse
    with _backend.single_threaded_blas():
        _forward(*_backend.read_only(q, _by_head(k), _by_head(v)), items, order, slots,
                 q.dtype.type(scale), causal, heads // k.shape[1], out, lse)
    return out, lse


def backward(dout, q, k, v, out, lse, offsets, k_offsets, scale, causal):
    """Recompute probabilities from ``lse`` block by block -> (dq, dk, dv) like q, k, v."""
    tokens, heads, dim = q.shape
    k_tokens, kv_heads, dv_dim = k.shape[0], k.shape[1], v.shape[2]
    group = heads // kv_heads
    lengths, k_lengths = np.diff(offsets), np.diff(k_offsets)
    items = np.stack([np.repeat(np.arange(heads), lengths.size),
                      np.tile(offsets[:-1], heads), np.tile(offsets[1:], heads),
                      np.tile(k_offsets[:-1], heads), np.tile(k_offsets[1:], heads)],
                     axis=1).astype(np.int64)
    order, slots = _schedule(np.tile(lengths * k_lengths, heads), numba.get_num_threads())
    dq = _backend.empty(q.shape, q.dtype)
    dk_part = np.empty((heads, k_tokens, dim), q.dtype)
    dv_part = np.empty((heads, k_tokens, dv_dim), q.dtype)
    key_block = BACKWARD_K_CAUSAL if causal else BACKWARD_K
    if USE_FMA and q.dtype == np.float32:
        _backward_fma(*_backend.read_only(dout, q, _by_head(k), _by_head(v), _panels(k), out, lse),
                      items, order, slots, np.float32(scale), causal, group, key_block, dq,
                      dk_part, dv_part)
    else:
        with _backend.single_threaded_blas():
            _backward(*_backend.read_only(dout, q, _by_head(k), _by_head(v), out, lse), items,
                      order, slots, q.dtype.type(scale), causal, group, key_block, dq, dk_part,
                      dv_part)
    dk = _backend.empty(k.shape, k.dtype)
    dv = _backend.empty(v.shape, v.dtype)
    # The group's partials add in head order: the same sum whatever the thread count.
    dk[...] = dk_part.reshape(kv_heads, group, k_tokens, dim).sum(axis=1).transpose(1, 0, 2)
    dv[...] = dv_part.reshape(kv_heads, group, k_tokens, dv_dim).sum(axis=1).transpose(1, 0, 2)
    return dq, dk, dv
