"""Reference segmented (variable-length) attention and head expansion, float64, explicit loops.

Checked against: ``lowbit/ops/segmented_attention/`` and ``lowbit/ops/expand_heads/`` (every
backend), in ``tests/test_segmented_attention.py`` and ``tests/test_expand_heads.py``.
"""

import math

import numpy as np


def expand_heads_ref(x, axis, target_heads):
    """Repeat each head of ``x`` along ``axis`` ``target_heads // heads`` times, contiguously."""
    x = np.moveaxis(np.asarray(x), axis, 0)
    repeat = target_heads // x.shape[0]
    out = np.empty((target_heads,) + x.shape[1:], dtype=x.dtype)
    for h in range(target_heads):
        out[h] = x[h // repeat]
    return np.moveaxis(out, 0, axis)


def expand_heads_bwd_ref(dy, axis, source_heads):
    """Sum the copies of each source head made by ``expand_heads_ref`` (float64)."""
    dy = np.moveaxis(np.asarray(dy, dtype=np.float64), axis, 0)
    repeat = dy.shape[0] // source_heads
    out = np.zeros((source_heads,) + dy.shape[1:])
    for h in range(dy.shape[0]):
        out[h // repeat] += dy[h]
    return np.moveaxis(out, 0, axis)


def _segments(lengths):
    start = 0
    for length in lengths:
        yield start, start + int(length)
        start += int(length)


def segmented_attention_ref(q, k, v, lengths, scale=None, causal=False):
    """Attention inside each segment, one query row at a time.

    Args:
        q: [T, H, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv]; lengths: segment lengths summing to T.

    Returns:
        (out [T, H, Dv] float64, lse [H, T] float64): the output and each row's logsumexp of the
        scaled scores.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, H, D = q.shape
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = np.zeros((T, H, v.shape[2]))
    lse = np.zeros((H, T))
    for s0, s1 in _segments(lengths):
        for h in range(H):
            g = h // group
            for i in range(s0, s1):
                stop = i + 1 if causal else s1  # the keys query i sees
                scores = scale * (k[s0:stop, g] @ q[i, h])
                m = scores.max()
                lse[h, i] = m + math.log(np.exp(scores - m).sum())
                p = np.exp(scores - lse[h, i])
                out[i, h] = p @ v[s0:stop, g]
    return out, lse


def segmented_attention_bwd_ref(dout, q, k, v, lengths, scale=None, causal=False):
    """Gradients of ``sum(dout * out)`` with respect to q, k, v (float64), one query row at a time.

    Returns:
        (dq [T, H, D], dk [T, Hkv, D], dv [T, Hkv, Dv]); dk and dv sum over the query heads of
        each key/value head.
    """
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    T, H, D = q.shape
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for s0, s1 in _segments(lengths):
        for h in range(H):
            g = h // group
            for i in range(s0, s1):
                stop = i + 1 if causal else s1
                scores = scale * (k[s0:stop, g] @ q[i, h])
                p = np.exp(scores - scores.max())
                p /= p.sum()
                # out_i = sum_j p_j v_j, so d out_i / d p_j = v_j; the softmax Jacobian gives
                # ds_j = p_j (dp_j - sum_l p_l dp_l) for the scaled scores s_j.
                dp = v[s0:stop, g] @ dout[i, h]
                ds = p * (dp - p @ dp)
                dv[s0:stop, g] += np.outer(p, dout[i, h])
                dq[i, h] += scale * (ds @ k[s0:stop, g])
                dk[s0:stop, g] += scale * np.outer(ds, q[i, h])
    return dq, dk, dv
