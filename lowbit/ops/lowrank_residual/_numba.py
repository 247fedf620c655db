"""Numba pieces of the low-rank residual layer: the chunked causal-linear attention.

The attention runs its (batch row, segment) pairs in parallel (``prange``, each pair's work on
one core: the layer holds BLAS at one thread, ``lowbit._backend.single_threaded_blas``, and so
do these functions) and, inside a segment, walks chunks of CHUNK tokens with BLAS products
(``np.dot``) and an ``[N, D]`` state, so nothing of size ``T x T`` is ever allocated. Each pair
is computed the same way whatever the thread that runs it: results are deterministic.
``causal_linear_recompute`` (for a backward that recomputes the forward's output) also keeps the
rotated queries, the masked chunk scores and the states entering chunks, which
``causal_linear_backward`` then reads instead of recomputing them. The layer norms are the
``layer_norm`` op's. Siblings: ``__init__.py``, ``_numpy.py``, ``_cuda.py``; reference
``reference/lowrank_residual.py``.
"""

import numba
import numpy as np

from ... import _backend

#: Tokens per chunk (intra-chunk scores are CHUNK x CHUNK). 128 against 64: the BDH bench's
#: attention (T = 256, N = 1024, D = 256) 1.3x faster forward and backward, T = 1024 1.1x (the
#: [N, D] state products take fewer, larger BLAS calls; measured).
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
        half = cos.shape[1]
        for t in range(s0, s1):
            for j in range(half):
                c = cos[t, j]
                s = sin[t, j]
                e = dq[t - s0, 2 * j]
                o = dq[t - s0, 2 * j + 1]
                dx[b, t, 2 * j] = e * c + o * s
                dx[b, t, 2 * j + 1] = o * c - e * s
            if N % 2:
                dx[b, t, N - 1] = dq[t - s0, N - 1]


def _no_keep():
    return (np.empty((0, 0, 0), np.float32), np.empty((0, 0, 0), np.float32),
            np.empty((0, 0, 0, 0), np.float32))


def causal_linear_forward(x, v, starts, cos, sin):
    """See ``_numpy.causal_linear_forward``: x [B, T, N], v [B, T, D] -> [B, T, D] float32."""
    out = _backend.empty(v.shape, np.float32)
    with _backend.single_threaded_blas():
        _forward(np.ascontiguousarray(x), np.ascontiguousarray(v), starts, cos, sin, out, False,
                 *_no_keep())
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
        _forward(np.ascontiguousarray(x), np.ascontiguousarray(v), starts, cos, sin, out, True,
                 *keep)
    return out, keep


def causal_linear_backward(da, x, v, starts, cos, sin, cache=None):
    """See ``_numpy.causal_linear_backward``: returns ``(dx, dv)`` float32; ``cache`` the one
    ``causal_linear_recompute`` returned for these ``x``, ``v`` (or None)."""
    dx = _backend.empty(x.shape, np.float32)
    dv = _backend.empty(v.shape, np.float32)
    with _backend.single_threaded_blas():
        _backward(np.ascontiguousarray(da), np.ascontiguousarray(x), np.ascontiguousarray(v),
                  starts, cos, sin, dx, dv, cache is not None,
                  *(cache if cache is not None else _no_keep()))
    return dx, dv
