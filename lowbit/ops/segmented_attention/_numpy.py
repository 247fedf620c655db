"""Vectorized segmented attention (array-generic: numpy or cupy), chunked over query rows.

Per segment the heads are batched matmuls in the grouped order (``[Hkv, group, rows, keys]``), so
key/value heads are never copied per query head; queries go in chunks so that at most
``SCORE_ELEMENTS`` scores are alive, never a whole ``L x L`` matrix of a long segment.
Keys may have segments of their own (``k_offsets``; causal masks aligned bottom-right), and a
row that sees no key gets out 0, lse -inf and no gradient.
Siblings: ``_numba.py``, ``_cuda.py``; reference ``reference/segmented_attention.py``.
"""

import numpy as np

from ... import _backend

#: Scores held at once per chunk (all heads): bounds memory for long segments.
SCORE_ELEMENTS = 1 << 22


def _chunk_rows(heads, keys):
    return max(1, SCORE_ELEMENTS // (heads * keys))


def _grouped(x, s0, s1, kv_heads):
    """x[s0:s1] : [L, H, D] -> [Hkv, group, L, D] (a view)."""
    length, heads, dim = x[s0:s1].shape
    return x[s0:s1].reshape(length, kv_heads, heads // kv_heads, dim).transpose(1, 2, 0, 3)


def _keys_seen(causal, r1, shift, keys):
    """Keys 0:n that query rows before r1 see: all, or causally up to row r1 - 1 + shift."""
    return max(0, min(keys, r1 + shift)) if causal else keys


def _scores(xp, qc, kt, scale, causal, r0, r1, shift):
    """Scaled scores of query rows r0:r1 against keys 0:kt.shape[-1], causally hidden ones (key
    j of row i when j > i + shift, shift = Lk - Lq: aligned bottom-right) at -inf."""
    s = xp.matmul(qc, kt) * qc.dtype.type(scale)
    if causal:
        rows = xp.arange(r0, r1)[:, None]
        cols = xp.arange(kt.shape[-1])[None, :]
        s = xp.where(cols > rows + shift, -xp.inf, s)
    return s


def _segments(offsets, k_offsets):
    """(query start, stop, key start, stop) per segment, as host integers."""
    return zip(offsets[:-1].tolist(), offsets[1:].tolist(), k_offsets[:-1].tolist(),
               k_offsets[1:].tolist())


def forward(q, k, v, offsets, k_offsets, scale, causal):
    """q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> (out [Tq, H, Dv], lse [H, Tq]); a row
    that sees no key gets out 0 and lse -inf."""
    xp = _backend.array_module(q)
    tokens, heads, _ = q.shape
    kv_heads, dv = k.shape[1], v.shape[2]
    group = heads // kv_heads
    out = _backend.empty((tokens, heads, dv), q.dtype, xp)
    lse = _backend.empty((heads, tokens), q.dtype, xp)
    out_g = out.reshape(tokens, kv_heads, group, dv)
    lse_g = lse.reshape(kv_heads, group, tokens)
    for s0, s1, k0, k1 in _segments(offsets, k_offsets):
        qs = _grouped(q, s0, s1, kv_heads)
        ks, vs = _grouped(k, k0, k1, kv_heads), _grouped(v, k0, k1, kv_heads)
        kt = ks.transpose(0, 1, 3, 2)
        shift = (k1 - k0) - (s1 - s0)
        step = _chunk_rows(heads, max(1, k1 - k0))
        for r0 in range(0, s1 - s0, step):
            r1 = min(r0 + step, s1 - s0)
            keys = _keys_seen(causal, r1, shift, k1 - k0)
            if keys == 0:  # no row of the chunk sees a key
                out_g[s0 + r0:s0 + r1] = 0
                lse_g[:, :, s0 + r0:s0 + r1] = -xp.inf
                continue
            s = _scores(xp, qs[:, :, r0:r1], kt[..., :keys], scale, causal, r0, r1, shift)
            m = s.max(axis=-1, keepdims=True)
            # A row that sees no key has m = -inf: shifted by 0 its probabilities are exact
            # zeros (total 0, out 0, lse -inf) instead of NaN; other rows are unchanged.
            m = xp.where(m == -xp.inf, m.dtype.type(0), m)
            p = xp.exp(s - m)
            total = p.sum(axis=-1, keepdims=True)
            empty = total == 0
            o = xp.matmul(p, vs[:, :, :keys]) / xp.where(empty, total.dtype.type(1), total)
            out_g[s0 + r0:s0 + r1] = o.transpose(2, 0, 1, 3)
            with np.errstate(divide="ignore"):  # log(0) = -inf: the rows without keys
                lse_g[:, :, s0 + r0:s0 + r1] = (m + xp.log(total))[..., 0]
    return out, lse


def backward(dout, q, k, v, out, lse, offsets, k_offsets, scale, causal):
    """Recompute probabilities from ``lse`` chunk by chunk -> (dq, dk, dv) like q, k, v."""
    xp = _backend.array_module(q)
    tokens, heads, dim = q.shape
    kv_heads, dv_dim = k.shape[1], v.shape[2]
    group = heads // kv_heads
    scale_t = q.dtype.type(scale)
    dq = _backend.empty(q.shape, q.dtype, xp)
    dk = _backend.empty(k.shape, k.dtype, xp)
    dv = _backend.empty(v.shape, v.dtype, xp)
    dq_g = dq.reshape(tokens, kv_heads, group, dim)
    # A row that saw no key (lse -inf) gets probabilities exp(-inf - inf) = 0 against +inf.
    lse_g = xp.where(lse == -xp.inf, xp.inf, lse).reshape(kv_heads, group, tokens)
    # D_i = rowsum(dout_i * out_i): the softmax Jacobian's correction term, [Hkv, group, T].
    delta_g = (dout * out).sum(axis=-1).reshape(tokens, kv_heads, group).transpose(1, 2, 0)
    for s0, s1, k0, k1 in _segments(offsets, k_offsets):
        length, keys_all = s1 - s0, k1 - k0
        shift = keys_all - length
        qs, dos = _grouped(q, s0, s1, kv_heads), _grouped(dout, s0, s1, kv_heads)
        ks, vs = _grouped(k, k0, k1, kv_heads), _grouped(v, k0, k1, kv_heads)
        kt, vt = ks.transpose(0, 1, 3, 2), vs.transpose(0, 1, 3, 2)
        dk_acc = xp.zeros((kv_heads, keys_all, dim), q.dtype)
        dv_acc = xp.zeros((kv_heads, keys_all, dv_dim), q.dtype)
        step = _chunk_rows(heads, max(1, keys_all))
        for r0 in range(0, length, step):
            r1 = min(r0 + step, length)
            keys = _keys_seen(causal, r1, shift, keys_all)
            if keys == 0:
                dq_g[s0 + r0:s0 + r1] = 0
                continue
            s = _scores(xp, qs[:, :, r0:r1], kt[..., :keys], scale, causal, r0, r1, shift)
            p = xp.exp(s - lse_g[:, :, s0 + r0:s0 + r1, None])
            dp = xp.matmul(dos[:, :, r0:r1], vt[..., :keys])
            ds = p * (dp - delta_g[:, :, s0 + r0:s0 + r1, None])
            dq_g[s0 + r0:s0 + r1] = (xp.matmul(ds, ks[:, :, :keys]) * scale_t).transpose(
                2, 0, 1, 3)
            dk_acc[:, :keys] += xp.matmul(ds.transpose(0, 1, 3, 2), qs[:, :, r0:r1]).sum(
                axis=1) * scale_t
            dv_acc[:, :keys] += xp.matmul(p.transpose(0, 1, 3, 2), dos[:, :, r0:r1]).sum(axis=1)
        dk[k0:k1] = dk_acc.transpose(1, 0, 2)
        dv[k0:k1] = dv_acc.transpose(1, 0, 2)
    return dq, dk, dv
