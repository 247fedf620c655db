"""Numba pieces of the low-rank residual layer: the chunked causal-linear attention.

The attention runs its (batch row, segment) pairs in parallel (``prange``, each pair's work on
one core: the layer holds BLAS at one thread, ``lowbit._backend.single_threaded_blas``, and so
do these functions) and, inside a segment, walks chunks of CHUNK tokens with an ``[N, D]``
state, so nothing of size ``T x T`` is ever allocated. Each pair is computed the same way
whatever the thread that runs it: results are deterministic. ``causal_linear_recompute`` (for a
backward that recomputes the forward's output) also keeps the rotated queries, the masked chunk
scores and the states entering chunks, which ``causal_linear_backward`` then reads instead of
recomputing them: the same bits. The layer norms are the ``layer_norm`` op's.

Products: on a CPU with AVX-512 or AVX2 + FMA (``USE_FMA``) the register tiles of
``lowbit/ops/packed_matmul/_numba/_fma.py`` (6 x 64 accumulators, fused multiply-adds in a fixed
order); else ``np.dot`` to the BLAS SciPy ships, whose OpenBLAS runs its AVX2 kernels on AMD
Zen (one core of the 2-core EPYC, the BDH bench's head, B = 2, T = 256, D = 256, N = 1024: the
tiles 2.1 ms forward, 6.9 ms backward, against 4.4 and 13.4 ms through BLAS). The tiles read the
left operand through element strides (a transposed one in place) and the right one as
contiguous [count, 64] panels, zero-padded past its last column: a chunk's rows as the rows of
64-column panels (``_row_panels``) or as the lanes of [cols, 64] panels (``_lane_panels``, for
the chunk's scores); the state in D-panels ([D / 64, N, 64]) for ``q @ state``, its transpose
in N-panels ([N / 64, D, 64]) for ``da @ state^T``. Padded lanes and columns add exact zeros.
The masked scores skip the 64-key panels a block of query rows cannot see, and the products with
them the keys past a 64-row block's end; the backward adds ``dp + dp^T`` (disjoint triangles:
exact) before one product with ``q`` instead of two.

Siblings: ``__init__.py``, ``_numpy.py``, ``_cuda.py``; reference
``reference/lowrank_residual.py``.
"""

import numba
import numpy as np

from ... import _backend
from ..packed_matmul._numba import _fma, _llvm

# The tile kernels call the tiles of ``_fma.py`` (emitted with ``_llvm.py``'s helpers), which
# Numba's cache does not key on.
_backend.numba_cache_guard(__file__, _fma.__file__, _llvm.__file__)

#: Whether the attention runs the register tiles (else BLAS; on AVX2, Zen 3, the tiles win too:
#: ``_fma.py``'s docstring).
USE_FMA = _fma.AVAILABLE

#: Tokens per chunk (intra-chunk scores are CHUNK x CHUNK; a multiple of the tiles' 64 lanes).
#: 128 against 64 through BLAS: the BDH bench's attention (T = 256, N = 1024, D = 256) 1.3x
#: faster forward and backward, T = 1024 1.1x (the [N, D] state products take fewer, larger
#: BLAS calls; measured).
CHUNK = 128


@numba.njit(cache=True)
def _rope_rows(x, b, t0, t1, cos, sin, sign, out):
    """out[t - t0] = rope(x[b, t]) for t in [t0, t1) (sign -1: inverse rotation)."""
    half = cos.shape[1]
    n = x.shape[2]
    for t in range(t0, t1):
        for j in range(half):
            c = cos[t, j]
            s = sign * sin[t, j]
            e = x[b, t, 2 * j]
            o = x[b, t, 2 * j + 1]
            out[t - t0, 2 * j] = e * c - o * s
            out[t - t0, 2 * j + 1] = o * c + e * s
        if n % 2:
            out[t - t0, n - 1] = x[b, t, n - 1]


@numba.njit(cache=True)
def _rope_back(dq, b, s0, s1, cos, sin, dx):
    """dx[b, t] = rope^T(dq[t - s0]) for t in [s0, s1): the gradient through the rotation."""
    half = cos.shape[1]
    n = dx.shape[2]  # dq may be wider (the tiles' panels)
    for t in range(s0, s1):
        for j in range(half):
            c = cos[t, j]
            s = sin[t, j]
            e = dq[t - s0, 2 * j]
            o = dq[t - s0, 2 * j + 1]
            dx[b, t, 2 * j] = e * c + o * s
            dx[b, t, 2 * j + 1] = o * c - e * s
        if n % 2:
            dx[b, t, n - 1] = dq[t - s0, n - 1]


@numba.njit(cache=True)
def _mask_strict_lower(m):
    for i in range(m.shape[0]):
        for j in range(i, m.shape[1]):
            m[i, j] = 0.0


@numba.njit(cache=True)
def _job(starts, job):
    """Batch row and token bounds of job ``job``: one segment of one batch row."""
    nseg = starts.shape[0] - 1
    return job // nseg, starts[job % nseg], starts[job % nseg + 1]


@numba.njit(parallel=True, cache=True)
def _forward(x, v, starts, cos, sin, out, keep, qs, ps, states):
    """``out`` = the attention; with ``keep`` also what the backward reuses: the rotated queries
    ``qs`` [B, T, N], each chunk's masked scores ``ps`` [B, T, CHUNK] (row t against its chunk's
    keys) and the state entering every chunk but a segment's first, ``states`` [B, S, N, D]."""
    B, T, N = x.shape
    D = v.shape[2]
    for job in numba.prange(B * (starts.shape[0] - 1)):
        b, s0, s1 = _job(starts, job)
        k = _first_state(starts, job)
        state = np.zeros((N, D), dtype=np.float32)
        qc = np.empty((CHUNK, N), dtype=np.float32)
        for c0 in range(s0, s1, CHUNK):
            c1 = min(c0 + CHUNK, s1)
            m = c1 - c0
            q = qc[:m]
            _rope_rows(x, b, c0, c1, cos, sin, np.float32(1.0), q)
            vc = np.ascontiguousarray(v[b, c0:c1])
            scores = np.dot(q, q.T)
            _mask_strict_lower(scores)
            res = np.dot(scores, vc)
            if c0 > s0:
                res += np.dot(q, state)
            out[b, c0:c1] = res
            if keep:
                qs[b, c0:c1] = q
                ps[b, c0:c1, :m] = scores
                if c0 > s0:
                    states[b, k] = state
                    k += 1
            if c1 < s1:
                state += np.dot(q.T, vc)


@numba.njit(cache=True)
def _first_state(starts, job):
    """Index into ``states``' second axis of the first state job ``job`` keeps (its batch row's
    earlier segments keep one per chunk past their first)."""
    nseg = starts.shape[0] - 1
    k = 0
    for s in range(job % nseg):
        k += (starts[s + 1] - starts[s] + CHUNK - 1) // CHUNK - 1
    return k


@numba.njit(parallel=True, cache=True)
def _backward(da, x, v, starts, cos, sin, dx, dv, kept, qs, ps, states):
    """``(dx, dv)`` into ``dx``, ``dv``; with ``kept`` the rotated queries, chunk scores and
    states come from ``_forward``'s ``keep`` arrays (the same bits) instead of recomputed."""
    B, T, N = x.shape
    D = v.shape[2]
    for job in numba.prange(B * (starts.shape[0] - 1)):
        b, s0, s1 = _job(starts, job)
        length = s1 - s0
        if kept:
            q = np.ascontiguousarray(qs[b, s0:s1])
            k = _first_state(starts, job)
        else:
            q = np.empty((length, N), dtype=np.float32)
            _rope_rows(x, b, s0, s1, cos, sin, np.float32(1.0), q)
        dq = np.empty((length, N), dtype=np.float32)
        state = np.zeros((N, D), dtype=np.float32)
        for c0 in range(s0, s1, CHUNK):
            c1 = min(c0 + CHUNK, s1)
            qc = q[c0 - s0:c1 - s0]
            vc = np.ascontiguousarray(v[b, c0:c1])
            dac = np.ascontiguousarray(da[b, c0:c1])
            dp = np.dot(dac, vc.T)
            _mask_strict_lower(dp)
            if kept:
                p = np.ascontiguousarray(ps[b, c0:c1, :c1 - c0])
                if c0 > s0:
                    state = np.ascontiguousarray(states[b, k])
                    k += 1
            else:
                p = np.dot(qc, qc.T)
                _mask_strict_lower(p)
            g = np.dot(dp, qc) + np.dot(dp.T, qc)
            if c0 > s0:
                g += np.dot(dac, state.T)
            dq[c0 - s0:c1 - s0] = g
            dv[b, c0:c1] = np.dot(p.T, dac)
            if c1 < s1 and not kept:
                state += np.dot(qc.T, vc)
        nchunks = (length + CHUNK - 1) // CHUNK
        rstate = np.zeros((N, D), dtype=np.float32)
        for k in range(nchunks - 1, -1, -1):
            c0 = s0 + k * CHUNK
            c1 = min(c0 + CHUNK, s1)
            qc = q[c0 - s0:c1 - s0]
            if c1 < s1:
                vc = np.ascontiguousarray(v[b, c0:c1])
                dq[c0 - s0:c1 - s0] += np.dot(vc, rstate.T)
                dv[b, c0:c1] += np.dot(qc, rstate)
            if c0 > s0:
                rstate += np.dot(qc.T, np.ascontiguousarray(da[b, c0:c1]))
        _rope_back(dq, b, s0, s1, cos, sin, dx)


# The tile path (``USE_FMA``): the packings and products of the tiles, and the two kernels.

_P = _fma.PANEL


@numba.njit(cache=True)
def _row_panels(a, rows, out):
    """out[p, r, j] = a[r, 64 p + j] for r < rows (zero past a's last column)."""
    cols = a.shape[1]
    for p in range(out.shape[0]):
        for r in range(rows):
            for j in range(_P):
                c = p * _P + j
                out[p, r, j] = a[r, c] if c < cols else 0


@numba.njit(cache=True)
def _lane_panels(a, rows, out):
    """out[r // 64, c, r % 64] = a[r, c] for r < rows (zero up to the last panel's end)."""
    # Along a's rows, not down its columns: a column's stride (4 KiB at N = 1024) maps every
    # read to one cache set (measured 3.4x slower at [128, 1024]).
    cols = a.shape[1]
    if rows % _P:
        out[rows // _P, :cols, rows % _P:] = 0
    for r in range(rows):
        for c in range(cols):
            out[r // _P, c, r % _P] = a[r, c]


@numba.njit(cache=True)
def _product(a, rows, si, sr, count, panels, c, load):
    """c[:rows, 64 p:64 p + 64] (+)= A[:rows, :count] @ panels[p, :count] for every panel p
    (A read from ``a`` through the strides ``si``, ``sr`` as in ``_fma.fma_tile``)."""
    for p in range(panels.shape[0]):
        _fma.panel_block(a, rows, si, sr, 0, panels[p], count, c, p * _P, load)


@numba.njit(cache=True)
def _into_panels(a, rows, si, sr, count, panels, state):
    """state[p] += A[:rows, :count] @ panels[p, :count] for every panel p (state [P, rows, 64])."""
    for p in range(panels.shape[0]):
        _fma.panel_block(a, rows, si, sr, 0, panels[p], count, state[p], 0, True)


@numba.njit(cache=True)
def _causal_scores(a, m, lanes, out):
    """out[:m, :m] = a[:m] @ a'^T masked strictly lower, ``lanes`` holding a' as [cols, 64]
    panels; key panel p is computed only for the rows from 64 p (the earlier rows mask it)."""
    width = a.shape[1]
    for p in range(-(-m // _P)):
        r0 = p * _P
        _fma.panel_block(a[r0:], m - r0, width, 1, 0, lanes[p], width, out[r0:], r0, False)
    _mask_strict_lower(out[:m, :m])


@numba.njit(cache=True)
def _causal_product(scores, m, panels, c, load):
    """c[:m] (+)= scores[:m, :m] @ panels for strictly lower ``scores``: a block of 64 rows sums
    only the keys before its end."""
    for r0 in range(0, m, _P):
        r1 = min(r0 + _P, m)
        _product(scores[r0:], r1 - r0, scores.shape[1], 1, r1, panels, c[r0:], load)


@numba.njit(cache=True)
def _unpanel(panels, out):
    """out[i, 64 p + j] = panels[p, i, j] for the columns of ``out`` [rows, cols]."""
    cols = out.shape[1]
    for i in range(out.shape[0]):
        for p in range(panels.shape[0]):
            for j in range(min(_P, cols - p * _P)):
                out[i, p * _P + j] = panels[p, i, j]


@numba.njit(cache=True)
def _transpose_panels(src, dst, n, d):
    """dst[i // 64, k, i % 64] = src[k // 64, i, k % 64] for i < n, k < d: a D-panel state as
    N-panels (dst's padded lanes are left as they are: zero)."""
    for k in range(d):
        for i in range(n):
            dst[i // _P, k, i % _P] = src[k // _P, i, k % _P]


@numba.njit(parallel=True, cache=True)
def _forward_fma(x, v, starts, cos, sin, out, keep, qs, ps, states):
    """``_forward`` on the tiles (the same arguments)."""
    B, T, N = x.shape
    D = v.shape[2]
    dw = -(-D // _P)
    for job in numba.prange(B * (starts.shape[0] - 1)):
        b, s0, s1 = _job(starts, job)
        k = _first_state(starts, job)
        state = np.zeros((dw, N, _P), dtype=np.float32)
        q = np.empty((CHUNK, N), dtype=np.float32)
        qt = np.empty((CHUNK // _P, N, _P), dtype=np.float32)
        vp = np.empty((dw, CHUNK, _P), dtype=np.float32)
        scores = np.empty((CHUNK, CHUNK), dtype=np.float32)
        res = np.empty((CHUNK, dw * _P), dtype=np.float32)
        for c0 in range(s0, s1, CHUNK):
            c1 = min(c0 + CHUNK, s1)
            m = c1 - c0
            _rope_rows(x, b, c0, c1, cos, sin, np.float32(1.0), q)
            _lane_panels(q, m, qt)
            _row_panels(v[b, c0:c1], m, vp)
            _causal_scores(q, m, qt, scores)
            if c0 > s0:
                _product(q, m, N, 1, N, state, res, False)
            _causal_product(scores, m, vp, res, c0 > s0)
            out[b, c0:c1] = res[:m, :D]
            if keep:
                qs[b, c0:c1] = q[:m]
                ps[b, c0:c1, :m] = scores[:m, :m]
                if c0 > s0:
                    _unpanel(state, states[b, k])
                    k += 1
            if c1 < s1:
                # state += q^T v_c: A = q^T, read down q's columns.
                _into_panels(q, N, 1, N, m, vp, state)


@numba.njit(parallel=True, cache=True)
def _backward_fma(da, x, v, starts, cos, sin, dx, dv, kept, qs, ps, states):
    """``_backward`` on the tiles (the same arguments)."""
    B, T, N = x.shape
    D = v.shape[2]
    nw, dw = -(-N // _P), -(-D // _P)
    for job in numba.prange(B * (starts.shape[0] - 1)):
        b, s0, s1 = _job(starts, job)
        length = s1 - s0
        if kept:
            q = qs[b, s0:s1]
            k = _first_state(starts, job)
        else:
            q = np.empty((length, N), dtype=np.float32)
            _rope_rows(x, b, s0, s1, cos, sin, np.float32(1.0), q)
        dq = np.empty((length, nw * _P), dtype=np.float32)
        dvs = np.empty((length, dw * _P), dtype=np.float32)
        state_t = np.zeros((nw, D, _P), dtype=np.float32)
        qt = np.empty((CHUNK // _P, N, _P), dtype=np.float32)
        vt = np.empty((CHUNK // _P, D, _P), dtype=np.float32)
        qp = np.empty((nw, CHUNK, _P), dtype=np.float32)
        dap = np.empty((dw, CHUNK, _P), dtype=np.float32)
        sym = np.empty((CHUNK, CHUNK), dtype=np.float32)
        probs = np.empty((CHUNK, CHUNK), dtype=np.float32)
        for c0 in range(s0, s1, CHUNK):
            c1 = min(c0 + CHUNK, s1)
            m = c1 - c0
            qc = q[c0 - s0:c1 - s0]
            vc, dac = v[b, c0:c1], da[b, c0:c1]
            _lane_panels(vc, m, vt)
            _row_panels(qc, m, qp)
            _row_panels(dac, m, dap)
            _causal_scores(dac, m, vt, sym)
            # dp + dp^T: dp is strictly lower, so each entry is one of dp's (exact).
            for i in range(m):
                for j in range(i):
                    sym[j, i] = sym[i, j]
            if kept:
                p = ps[b, c0:c1]
                if c0 > s0:
                    _lane_panels(states[b, k], N, state_t)
                    k += 1
            else:
                _lane_panels(qc, m, qt)
                _causal_scores(qc, m, qt, probs)
                p = probs
            g = dq[c0 - s0:c1 - s0]
            if c0 > s0:
                _product(dac, m, D, 1, D, state_t, g, False)
            _product(sym, m, CHUNK, 1, m, qp, g, c0 > s0)
            # dv = p^T da_c: A = p^T, read down p's columns.
            _product(p, m, 1, p.shape[1], m, dap, dvs[c0 - s0:c1 - s0], False)
            if c1 < s1 and not kept:
                _into_panels(vc, D, 1, D, m, qp, state_t)
        rstate = np.zeros((dw, N, _P), dtype=np.float32)
        rstate_t = np.zeros((nw, D, _P), dtype=np.float32)
        for kc in range(-(-length // CHUNK) - 1, -1, -1):
            c0 = s0 + kc * CHUNK
            c1 = min(c0 + CHUNK, s1)
            m = c1 - c0
            qc = q[c0 - s0:c1 - s0]
            if c1 < s1:
                _product(v[b, c0:c1], m, D, 1, D, rstate_t, dq[c0 - s0:c1 - s0], True)
                _product(qc, m, N, 1, N, rstate, dvs[c0 - s0:c1 - s0], True)
            if c0 > s0:
                _row_panels(da[b, c0:c1], m, dap)
                _into_panels(qc, N, 1, N, m, dap, rstate)
                _transpose_panels(rstate, rstate_t, N, D)
        _rope_back(dq, b, s0, s1, cos, sin, dx)
        for t in range(s0, s1):
            dv[b, t] = dvs[t - s0, :D]


def _kernels():
    """The (forward, backward) kernels: the register tiles' where ``USE_FMA``, else BLAS'."""
    return (_forward_fma, _backward_fma) if USE_FMA else (_forward, _backward)


def _no_keep():
    return (np.empty((0, 0, 0), np.float32), np.empty((0, 0, 0), np.float32),
            np.empty((0, 0, 0, 0), np.float32))


def causal_linear_forward(x, v, starts, cos, sin):
    """See ``_numpy.causal_linear_forward``: x [B, T, N], v [B, T, D] -> [B, T, D] float32."""
    out = _backend.empty(v.shape, np.float32)
    with _backend.single_threaded_blas():
        _kernels()[0](*_backend.read_only(np.ascontiguousarray(x), np.ascontiguousarray(v),
                                          starts, cos, sin), out, False, *_no_keep())
    return out


def causal_linear_recompute(x, v, starts, cos, sin):
    """``causal_linear_forward``'s output (the same bits) and what ``causal_linear_backward``
    reuses of it (``cache``): the rotated queries [B, T, N], the chunks' masked scores
    [B, T, CHUNK] and the states entering chunks [B, S, N, D] float32 (S: chunks past each
    segment's first), so that a backward which recomputes the output pays only its products
    with ``v``."""
    B, T, N = x.shape
    D = v.shape[2]
    bounds = np.asarray(starts)
    chunks = (np.diff(bounds) + CHUNK - 1) // CHUNK
    keep = (_backend.empty((B, T, N), np.float32), np.zeros((B, T, CHUNK), np.float32),
            _backend.empty((B, int(np.sum(np.maximum(chunks - 1, 0))), N, D), np.float32))
    out = _backend.empty(v.shape, np.float32)
    with _backend.single_threaded_blas():
        _kernels()[0](*_backend.read_only(np.ascontiguousarray(x), np.ascontiguousarray(v),
                                          starts, cos, sin), out, True, *keep)
    return out, keep


def causal_linear_backward(da, x, v, starts, cos, sin, cache=None):
    """See ``_numpy.causal_linear_backward``: returns ``(dx, dv)`` float32; ``cache`` the one
    ``causal_linear_recompute`` returned for these ``x``, ``v`` (or None)."""
    dx = _backend.empty(x.shape, np.float32)
    dv = _backend.empty(v.shape, np.float32)
    with _backend.single_threaded_blas():
        _kernels()[1](*_backend.read_only(np.ascontiguousarray(da), np.ascontiguousarray(x),
                                          np.ascontiguousarray(v), starts, cos, sin), dx, dv,
                      cache is not None, *(cache if cache is not None else _no_keep()))
    return dx, dv
