"""Vectorized segmented attention (array-generic: numpy or cupy), chunked over query rows.

Per segment the heads are batched matmuls in the grouped order (``[Hkv, group, rows, keys]``), so
key/value heads are never copied per query head; queries go in chunks so that at most
``SCORE_ELEMENTS`` scores are alive, never a whole ``L x L`` matrix of a long segment.
Siblings: ``_numba.py``, ``_cuda.py``; reference ``reference/segmented_attention.py``.
"""

from ... import _backend

#: Scores held at once per chunk (all heads): bounds memory for long segments.
SCORE_ELEMENTS = 1 << 22


def _chunk_rows(heads, keys):
    return max(1, SCORE_ELEMENTS // (heads * keys))


def _grouped(x, s0, s1, kv_heads):
    """x[s0:s1] : [L, H, D] -> [Hkv, group, L, D] (a view)."""
    length, heads, dim = x[s0:s1].shape
    return x[s0:s1].reshape(length, kv_heads, heads // kv_heads, dim).transpose(1, 2, 0, 3)


def _scores(xp, qc, kt, scale, causal, r0, r1):
    """Scaled scores of query rows r0:r1 against keys 0:kt.shape[-1], causal entries at -inf."""
    s = xp.matmul(qc, kt) * qc.dtype.type(scale)
    if causal:
        rows = xp.arange(r0, r1)[:, None]
        cols = xp.arange(kt.shape[-1])[None, :]
        s = xp.where(cols > rows, -xp.inf, s)
    return s


def forward(q, k, v, offsets, scale, causal):
    """q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] -> (out [T, H, Dv], lse [H, T])."""
    xp = _backend.array_module(q)
    tokens, heads, _ = q.shape
    kv_heads, dv = k.shape[1], v.shape[2]
    group = heads // kv_heads
    out = _backend.empty((tokens, heads, dv), q.dtype, xp)
    lse = _backend.empty((heads, tokens), q.dtype, xp)
    out_g = out.reshape(tokens, kv_heads, group, dv)
    lse_g = lse.reshape(kv_heads, group, tokens)
    for s0, s1 in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        qs, ks, vs = (_grouped(x, s0, s1, kv_heads) for x in (q, k, v))
        kt = ks.transpose(0, 1, 3, 2)
        step = _chunk_rows(heads, s1 - s0)
        for r0 in range(0, s1 - s0, step):
            r1 = min(r0 + step, s1 - s0)
            keys = r1 if causal else s1 - s0
            s = _scores(xp, qs[:, :, r0:r1], kt[..., :keys], scale, causal, r0, r1)
            m = s.max(axis=-1, keepdims=True)
            p = xp.exp(s - m)
            total = p.sum(axis=-1, keepdims=True)
            o = xp.matmul(p, vs[:, :, :keys]) / total
            out_g[s0 + r0:s0 + r1] = o.transpose(2, 0, 1, 3)
            lse_g[:, :, s0 + r0:s0 + r1] = (m + xp.log(total))[..., 0]
    return out, lse


def backward(dout, q, k, v, out, lse, offsets, scale, causal):
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
    lse_g = lse.reshape(kv_heads, group, tokens)
    # D_i = rowsum(dout_i * out_i): the softmax Jacobian's correction term, [Hkv, group, T].
    delta_g = (dout * out).sum(axis=-1).reshape(tokens, kv_heads, group).transpose(1, 2, 0)
    for s0, s1 in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        length = s1 - s0
        qs, ks, vs, dos = (_grouped(x, s0, s1, kv_heads) for x in (q, k, v, dout))
        kt, vt = ks.transpose(0, 1, 3, 2), vs.transpose(0, 1, 3, 2)
        dk_acc = xp.zeros((kv_heads, length, dim), q.dtype)
        dv_acc = xp.zeros((kv_heads, length, dv_dim), q.dtype)
        step = _chunk_rows(heads, length)
        for r0 in range(0, length, step):
            r1 = min(r0 + step, length)
            keys = r1 if causal else length
            s = _scores(xp, qs[:, :, r0:r1], kt[..., :keys], scale, causal, r0, r1)
            p = xp.exp(s - lse_g[:, :, s0 + r0:s0 + r1, None])
            dp = xp.matmul(dos[:, :, r0:r1], vt[..., :keys])
            ds = p * (dp - delta_g[:, :, s0 + r0:s0 + r1, None])
            dq_g[s0 + r0:s0 + r1] = (xp.matmul(ds, ks[:, :, :keys]) * scale_t).transpose(
                2, 0, 1, 3)
            dk_acc[:, :keys] += xp.matmul(ds.transpose(0, 1, 3, 2), qs[:, :, r0:r1]).sum(
                axis=1) * scale_t
            dv_acc[:, :keys] += xp.matmul(p.transpose(0, 1, 3, 2), dos[:, :, r0:r1]).sum(axis=1)
        dk[s0:s1] = dk_acc.transpose(1, 0, 2)
        dv[s0:s1] = dv_acc.transpose(1, 0, 2)
    return dq, dk, dv
