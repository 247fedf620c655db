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


def _segments(lengths, k_lengths):
    """(query start, query stop, key start, key stop) of each segment."""
    k_lengths = lengths if k_lengths is None else k_lengths
    q0 = k0 = 0
    for lq, lk in zip(lengths, k_lengths, strict=True):
        yield q0, q0 + int(lq), k0, k0 + int(lk)
        q0 += int(lq)
        k0 += int(lk)


def _visible(i, q0, q1, k0, k1, causal):
    """Stop (exclusive) of the keys k0:stop that query ``i`` of segment q0:q1 sees: every key,
    or causally those with ``j - k0 <= (i - q0) + Lk - Lq`` (aligned bottom-right)."""
    if not causal:
        return k1
    return max(k0, min(k1, k0 + (i - q0) + (k1 - k0) - (q1 - q0) + 1))


def segmented_attention_ref(q, k, v, lengths, scale=None, causal=False, k_lengths=None):
    """Attention inside each segment, one query row at a time.

    Args:
        q: [Tq, H, D]; k: [Tk, Hkv, D]; v: [Tk, Hkv, Dv]; lengths: query segment lengths summing
            to Tq; k_lengths: key segment lengths summing to Tk (default: ``lengths``).

    Returns:
        (out [Tq, H, Dv] float64, lse [H, Tq] float64): the output and each row's logsumexp of
        the scaled scores; a row that sees no key has out 0 and lse -inf.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, H, D = q.shape
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = np.zeros((T, H, v.shape[2]))
    lse = np.full((H, T), -np.inf)
    for q0, q1, k0, k1 in _segments(lengths, k_lengths):
        for h in range(H):
            g = h // group
            for i in range(q0, q1):
                stop = _visible(i, q0, q1, k0, k1, causal)
                if stop == k0:
                    continue  # no key: out stays 0, lse -inf
                scores = scale * (k[k0:stop, g] @ q[i, h])
                m = scores.max()
                lse[h, i] = m + math.log(np.exp(scores - m).sum())
                p = np.exp(scores - lse[h, i])
                out[i, h] = p @ v[k0:stop, g]
    return out, lse


def segmented_attention_bwd_ref(dout, q, k, v, lengths, scale=None, causal=False,
                                k_lengths=None):
    """Gradients of ``sum(dout * out)`` with respect to q, k, v (float64), one query row at a time.

    Returns:
        (dq [Tq, H, D], dk [Tk, Hkv, D], dv [Tk, Hkv, Dv]); dk and dv sum over the query heads of
        each key/value head; a query row that sees no key contributes nothing.
    """
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    T, H, D = q.shape
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for q0, q1, k0, k1 in _segments(lengths, k_lengths):
        for h in range(H):
            g = h // group
            for i in range(q0, q1):
                stop = _visible(i, q0, q1, k0, k1, causal)
                if stop == k0:
                    continue
                scores = scale * (k[k0:stop, g] @ q[i, h])
                p = np.exp(scores - scores.max())
                p /= p.sum()
                # out_i = sum_j p_j v_j, so d out_i / d p_j = v_j; the softmax Jacobian gives
                # ds_j = p_j (dp_j - sum_l p_l dp_l) for the scaled scores s_j.
                dp = v[k0:stop, g] @ dout[i, h]
                ds = p * (dp - p @ dp)
                dv[k0:stop, g] += np.outer(p, dout[i, h])
                dq[i, h] += scale * (ds @ k[k0:stop, g])
                dk[k0:stop, g] += scale * np.outer(ds, q[i, h])
    return dq, dk, dv
