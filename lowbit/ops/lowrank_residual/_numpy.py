"""Vectorized pieces of the low-rank residual layer (array-generic: numpy or cupy).

The causal-linear attention in chunked form (intra-chunk strictly-lower scores, an ``[N, D]``
state across chunks; nothing of size ``T x T``). The layer norms are the ``layer_norm`` op's.
Siblings: ``__init__.py`` (the layer), ``_numba.py``, ``_cuda.py``
(``cuda/lowrank_residual.cu``); reference ``reference/lowrank_residual.py``.
"""

import numpy as np

from ... import _backend

#: Tokens per chunk: the intra-chunk scores are CHUNK x CHUNK; larger chunks trade those for
#: fewer state updates.
CHUNK = 64


def rope(x, cos, sin, inverse=False):
    """Rotate pairs (2j, 2j+1) of the last axis by the angle of each token's row index.

    Args:
        x: [B, T, N] float32; cos, sin: [T, N // 2] float32 tables; ``inverse`` rotates back
            (the transpose, for gradients).
    """
    xp = _backend.array_module(x)
    half = cos.shape[1]
    out = _backend.empty(x.shape, np.float32, xp)
    even, odd = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    s = -sin if inverse else sin
    out[..., 0:2 * half:2] = even * cos - odd * s
    out[..., 1:2 * half:2] = odd * cos + even * s
    if x.shape[-1] % 2:
        out[..., -1] = x[..., -1]
    return out


def _strict_lower(n, xp):
    return xp.tril(xp.ones((n, n), dtype=np.float32), -1)


def _segments(starts):
    bounds = [int(s) for s in (starts.get() if hasattr(starts, "get") else starts)]
    return zip(bounds[:-1], bounds[1:])


def causal_linear_forward(x, v, starts, cos, sin):
    """``a[t] = sum_{s < t, same segment} (Q_t . Q_s) v[s]`` with ``Q = rope(x)``.

    Args:
        x: [B, T, N] float32; v: [B, T, D] float32; starts: [S + 1] int64 segment bounds;
        cos, sin: [T, N // 2] float32.

    Returns:
        [B, T, D] float32.
    """
    xp = _backend.array_module(x)
    B, T, N = x.shape
    q = rope(x, cos, sin)
    out = _backend.empty(v.shape, np.float32, xp)
    for s0, s1 in _segments(starts):
        state = None
        for c0 in range(s0, s1, CHUNK):
            c1 = min(c0 + CHUNK, s1)
            qc, vc = q[:, c0:c1], v[:, c0:c1]
            scores = qc @ qc.transpose(0, 2, 1)
            scores *= _strict_lower(c1 - c0, xp)
            out[:, c0:c1] = scores @ vc
            if state is not None:
                out[:, c0:c1] += qc @ state
            if c1 < s1:
                update = qc.transpose(0, 2, 1) @ vc
                state = update if state is None else state + update
    return out


def causal_linear_recompute(x, v, starts, cos, sin):
    """``(causal_linear_forward(...), cache)`` for a backward that recomputes the output; this
    backend keeps nothing for ``causal_linear_backward`` (``cache`` None: numba's keeps its
    queries, scores and states)."""
    return causal_linear_forward(x, v, starts, cos, sin), None


def causal_linear_backward(da, x, v, starts, cos, sin, cache=None):
    """Gradients ``(dx, dv)`` of ``causal_linear_forward`` for the output gradient ``da``
    (``cache``: ``causal_linear_recompute``'s, unused here).

    With ``P = strict_lower(Q Q^T)`` and ``dP = strict_lower(da v^T)``: ``dQ = dP Q + dP^T Q``,
    ``dv = P^T da``; across chunks through the states ``S = sum Q^T v`` (earlier chunks) and
    ``R = sum Q^T da`` (later chunks); ``dx = rope^T(dQ)``.
    """
    xp = _backend.array_module(x)
    B, T, N = x.shape
    q = rope(x, cos, sin)
    dq = _backend.empty(x.shape, np.float32, xp)
    dv = _backend.empty(v.shape, np.float32, xp)
    for s0, s1 in _segments(starts):
        chunks = [(c0, min(c0 + CHUNK, s1)) for c0 in range(s0, s1, CHUNK)]
        state = None
        for c0, c1 in chunks:
            qc, vc, dac = q[:, c0:c1], v[:, c0:c1], da[:, c0:c1]
            mask = _strict_lower(c1 - c0, xp)
            dp = (dac @ vc.transpose(0, 2, 1)) * mask
            p = (qc @ qc.transpose(0, 2, 1)) * mask
            dq[:, c0:c1] = dp @ qc + dp.transpose(0, 2, 1) @ qc
            dv[:, c0:c1] = p.transpose(0, 2, 1) @ dac
            if state is not None:
                dq[:, c0:c1] += dac @ state.transpose(0, 2, 1)
            if c1 < s1:
                update = qc.transpose(0, 2, 1) @ vc
                state = update if state is None else state + update
        rstate = None
        for c0, c1 in reversed(chunks):
            qc, vc, dac = q[:, c0:c1], v[:, c0:c1], da[:, c0:c1]
            if rstate is not None:
                dq[:, c0:c1] += vc @ rstate.transpose(0, 2, 1)
                dv[:, c0:c1] += qc @ rstate
            if c0 > s0:
                update = qc.transpose(0, 2, 1) @ dac
                rstate = update if rstate is None else rstate + update
    return rope(dq, cos, sin, inverse=True), dv

