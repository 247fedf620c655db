"""Reference BDH low-rank residual layer: float64, explicit loops, self-contained.

Checked against: ``lowbit/ops/lowrank_residual/`` (every backend) in
``tests/test_lowrank_residual.py``; this file's backward is checked there against central finite
differences. It holds its own copies of the formulas the layer composes (weight and activation
quantization, rotary positions, strictly causal linear attention, causal softmax attention over
segments, layer normalization, the hashed dropout mask) so that it depends on no lowbit op.

Forward, per batch row ``b`` and head ``h`` (see ``lowbit.lowrank_residual_forward``)::

    x_neuron = relu(Qa(current) @ Qw(encoder[h]) - relu_threshold)
    a        = attention(x_neuron, current)
    y_gate   = relu(Qa(LN(a)) @ Qw(encoder_v[h]) - relu_threshold)
    y_neuron = dropout(x_neuron * y_gate)
    mlp      = sum_h Qa(y_neuron)[:, h] @ Qw(decoder)[h * N:(h + 1) * N]
    next     = LN(current + LN(mlp))

``Qa``/``Qw`` are quantize-then-dequantize (identity when the plan leaves that side in full
precision); their backward is the identity (straight-through estimator).
"""

from __future__ import annotations

import math

import numpy as np

#: Scale floor of every quantizer (BitNet b1.58's eps).
SCALE_EPS = 1e-5
#: Layer-norm epsilon (added to the biased variance).
LN_EPS = 1e-5
#: Base of the rotary angles: phi = t * ROPE_THETA ** (-2j / N).
ROPE_THETA = 2.0**16
#: Multipliers that spread (seed, index) over 32 bits before the integer hash.
HASH_SEED_MUL = 0x9E3779B9
HASH_HIGH_MUL = 0x85EBCA6B
_ACT_QMAX = {"int8": 127, "int4": 7}


# -- quantization (quantize then dequantize) -----------------------------------------------------

def quantize_weight_ref(w, fmt):
    """Qw(w) of a ``(K, N)`` weight as float64; codes from float32 quotients, half to even."""
    if fmt is None:
        return np.asarray(w, dtype=np.float64)
    w32 = np.asarray(w, dtype=np.float32)
    K, N = w32.shape
    out = np.zeros((K, N))
    if fmt in ("ternary", "sign"):
        total = 0.0
        for k in range(K):
            for n in range(N):
                total += abs(float(w32[k, n]))
        scale = np.float32(max(total / (K * N), SCALE_EPS))
        for k in range(K):
            for n in range(N):
                if fmt == "ternary":
                    code = min(1.0, max(-1.0, float(np.rint(w32[k, n] / scale))))
                else:
                    code = 1.0 if w32[k, n] >= 0 else -1.0
                out[k, n] = code * float(scale)
        return out
    if fmt == "int8":
        for n in range(N):
            top = max(abs(float(w32[k, n])) for k in range(K))
            scale = np.float32(max(top, SCALE_EPS)) / np.float32(127)
            for k in range(K):
                code = min(127.0, max(-127.0, float(np.rint(w32[k, n] / scale))))
                out[k, n] = code * float(scale)
        return out
    raise ValueError(f"unknown weight format {fmt!r}")


def quantize_activation_ref(x, fmt):
    """Qa(x): per row over the last axis, symmetric, ``scale = max(max|row|, eps) / qmax``."""
    if fmt is None:
        return np.asarray(x, dtype=np.float64)
    qmax = _ACT_QMAX[fmt]
    x32 = np.asarray(x, dtype=np.float32)
    out = np.zeros(x32.shape)
    for index in np.ndindex(*x32.shape[:-1]):
        row = x32[index]
        scale = np.float32(max(float(np.max(np.abs(row))), SCALE_EPS)) / np.float32(qmax)
        for i in range(row.shape[0]):
            code = min(qmax, max(-qmax, float(np.rint(row[i] / scale))))
            out[index + (i,)] = code * float(scale)
    return out


# -- small pieces with their backward -------------------------------------------------------------

def rope_ref(u, inverse=False):
    """Rotary positions over the last axis of ``u: [T, N]`` on pairs (2j, 2j+1), t = row index.

    ``inverse=True`` rotates by ``-phi`` (the transpose, used by the backward).
    """
    T, N = u.shape
    out = np.array(u, dtype=np.float64)
    for t in range(T):
        for j in range(N // 2):
            phi = t * ROPE_THETA ** (-2.0 * j / N)
            c, s = math.cos(phi), math.sin(phi)
            if inverse:
                s = -s
            e, o = u[t, 2 * j], u[t, 2 * j + 1]
            out[t, 2 * j] = e * c - o * s
            out[t, 2 * j + 1] = o * c + e * s
    return out


def segment_ids_ref(T, lengths):
    """Segment index of every token of a row (lengths None: one segment)."""
    lengths = [T] if lengths is None else list(lengths)
    return np.repeat(np.arange(len(lengths)), lengths)


def causal_linear_ref(x, v, lengths):
    """a[t] = sum over s < t in t's segment of (Q_t . Q_s) v[s], Q = rope(x).

    x: [T, N], v: [T, D].
    """
    q = rope_ref(x)
    seg = segment_ids_ref(x.shape[0], lengths)
    T = x.shape[0]
    a = np.zeros((T, v.shape[1]))
    for t in range(T):
        for s in range(t):
            if seg[s] == seg[t]:
                a[t] += float(q[t] @ q[s]) * v[s]
    return a


def causal_linear_bwd_ref(da, x, v, lengths):
    """Gradients (dx, dv) of ``causal_linear_ref`` for the output gradient ``da``."""
    q = rope_ref(x)
    seg = segment_ids_ref(x.shape[0], lengths)
    T = x.shape[0]
    dq = np.zeros_like(q)
    dv = np.zeros_like(v, dtype=np.float64)
    for t in range(T):
        for s in range(t):
            if seg[s] == seg[t]:
                g = float(da[t] @ v[s])  # d loss / d scores[t, s]
                dq[t] += g * q[s]
                dq[s] += g * q[t]
                dv[s] += float(q[t] @ q[s]) * da[t]
    return rope_ref(dq, inverse=True), dv


def softmax_attention_ref(x, v, lengths):
    """Causal softmax attention per segment: q = k = x [T, N], values v [T, D], scale 1/sqrt(N)."""
    seg = segment_ids_ref(x.shape[0], lengths)
    T, N = x.shape
    a = np.zeros((T, v.shape[1]))
    for t in range(T):
        keys = [s for s in range(t + 1) if seg[s] == seg[t]]
        logits = np.array([x[t] @ x[s] for s in keys]) / math.sqrt(N)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        for w, s in zip(p, keys):
            a[t] += w * v[s]
    return a


def softmax_attention_bwd_ref(da, x, v, lengths):
    """Gradients (dx, dv) of ``softmax_attention_ref`` (q and k are the same tensor)."""
    seg = segment_ids_ref(x.shape[0], lengths)
    T, N = x.shape
    scale = 1.0 / math.sqrt(N)
    dx = np.zeros_like(x, dtype=np.float64)
    dv = np.zeros_like(v, dtype=np.float64)
    for t in range(T):
        keys = [s for s in range(t + 1) if seg[s] == seg[t]]
        logits = np.array([x[t] @ x[s] for s in keys]) * scale
        p = np.exp(logits - logits.max())
        p /= p.sum()
        dp = np.array([da[t] @ v[s] for s in keys])
        dlogit = p * (dp - float(p @ dp))
        for w, g, s in zip(p, dlogit, keys):
            dv[s] += w * da[t]
            dx[t] += g * scale * x[s]
            dx[s] += g * scale * x[t]
    return dx, dv


def layer_norm_ref(x):
    """LN over the last axis, no affine parameters, biased variance."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + LN_EPS)


def layer_norm_bwd_ref(dy, x):
    """Gradient of ``layer_norm_ref`` at ``x`` for the output gradient ``dy``."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    xhat = (x - mean) * rstd
    return rstd * (dy - dy.mean(axis=-1, keepdims=True)
                   - xhat * (dy * xhat).mean(axis=-1, keepdims=True))


def dropout_keep_ref(shape, p, seed, row_offset=0):
    """Keep mask of inverted dropout: a pure function of (seed, flat element index).

    The flat index is that of the element in a batch whose first ``row_offset`` rows (of
    ``shape[1:]`` each) come before this one.

    The hash is Wellons' "lowbias32" over ``lo + seed * HASH_SEED_MUL + hi * HASH_HIGH_MUL``
    (mod 2**32) of the 64-bit flat index split into halves; an element is kept when the hash is
    at least ``round(p * 2**32)``.
    """
    size = math.prod(shape)
    threshold = min(int(round(p * 2.0**32)), 2**32)
    keep = np.zeros(size, dtype=bool)
    first = row_offset * math.prod(shape[1:])
    for j in range(size):
        i = first + j
        x = ((i & 0xFFFFFFFF) + seed * HASH_SEED_MUL + (i >> 32) * HASH_HIGH_MUL) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        x ^= x >> 16
        keep[j] = x >= threshold
    return keep.reshape(shape)


def block_mask_ref(block_size, active, H, N):
    """[H, N] bool latent mask of a block pattern: neuron n of head h is active when block
    ``n // block_size`` is (``active`` [blocks] shared by the heads, or [H, blocks])."""
    act = np.asarray(active, dtype=bool)
    if act.ndim == 1:
        act = np.broadcast_to(act, (H, act.size))
    mask = np.zeros((H, N), dtype=bool)
    for h in range(H):
        for n in range(N):
            mask[h, n] = act[h, n // block_size]
    return mask


# -- the layer ------------------------------------------------------------------------------------

def _formats(plan, which):
    """(weight_format, act_format) of projection ``which`` ("x", "y", "residual")."""
    if plan is None:
        return None, None
    return getattr(plan, which)


def lowrank_residual_ref(current, encoder, encoder_v, decoder, *, attention="causal_linear",
                         lengths=None, plan=None, relu_threshold=0.0, dropout=0.0, seed=0,
                         row_offset=0, latent_mask=None, return_cache=False):
    """Float64 forward of the layer.

    Shapes: current [B, T, D], encoders [H, D, N], decoder [H * N, D]; ``latent_mask`` [H, N]
    bool (None: every latent neuron active): inactive neurons are exactly zero in ``x_neuron``
    and ``y_gate`` (so in ``y_neuron``), whatever the threshold (see ``block_mask_ref``).

    Returns ``next`` [B, T, D] (and the intermediates when ``return_cache``).
    """
    cur = np.asarray(current, dtype=np.float64)
    B, T, D = cur.shape
    H, _, N = encoder.shape
    wx, ax_ = _formats(plan, "x")
    wy, ay = _formats(plan, "y")
    wr, ar = _formats(plan, "residual")
    enc_q = [quantize_weight_ref(encoder[h], wx) for h in range(H)]
    encv_q = [quantize_weight_ref(encoder_v[h], wy) for h in range(H)]
    dec_q = quantize_weight_ref(decoder, wr)
    keep = dropout_keep_ref((B, H, T, N), dropout, seed, row_offset) if dropout > 0 else np.ones(
        (B, H, T, N), dtype=bool)
    drop_scale = 1.0 / (1.0 - dropout)
    cur_q = quantize_activation_ref(cur, ax_)
    on = (np.ones((H, N), dtype=bool) if latent_mask is None else
          np.asarray(latent_mask, dtype=bool))[None, :, None, :]
    x_pre = np.zeros((B, H, T, N))
    a = np.zeros((B, H, T, D))
    y_pre = np.zeros((B, H, T, N))
    a_hat_q = np.zeros((B, H, T, D))
    for b in range(B):
        for h in range(H):
            x_pre[b, h] = cur_q[b] @ enc_q[h] - relu_threshold
            xn = np.maximum(x_pre[b, h], 0.0) * on[0, h]
            if attention == "causal_linear":
                a[b, h] = causal_linear_ref(xn, cur[b], lengths)
            else:
                a[b, h] = softmax_attention_ref(xn, cur[b], lengths)
            a_hat_q[b, h] = quantize_activation_ref(layer_norm_ref(a[b, h]), ay)
            y_pre[b, h] = a_hat_q[b, h] @ encv_q[h] - relu_threshold
    x_neuron = np.maximum(x_pre, 0.0) * on
    y_gate = np.maximum(y_pre, 0.0) * on
    y_neuron = x_neuron * y_gate * np.where(keep, drop_scale, 0.0)
    flat = y_neuron.transpose(0, 2, 1, 3).reshape(B, T, H * N)
    flat_q = quantize_activation_ref(flat, ar)
    mlp = flat_q @ dec_q
    r = cur + layer_norm_ref(mlp)
    out = layer_norm_ref(r)
    if not return_cache:
        return out
    cache = dict(cur_q=cur_q, enc_q=enc_q, encv_q=encv_q, dec_q=dec_q, keep=keep,
                 drop_scale=drop_scale, x_pre=x_pre, x_neuron=x_neuron, a=a, a_hat_q=a_hat_q,
                 y_pre=y_pre, y_gate=y_gate, y_neuron=y_neuron, flat_q=flat_q, mlp=mlp, r=r)
    return out, cache


def lowrank_residual_bwd_ref(dnext, current, encoder, encoder_v, decoder, **kwargs):
    """Float64 gradients ``(dcurrent, dencoder, dencoder_v, ddecoder)`` of the layer.

    ``kwargs`` are those of ``lowrank_residual_ref``; the forward is recomputed here. Quantizers
    pass gradients straight through; the relu derivative is 1 where the output is positive.
    """
    cur = np.asarray(current, dtype=np.float64)
    _, c = lowrank_residual_ref(current, encoder, encoder_v, decoder, return_cache=True, **kwargs)
    lengths = kwargs.get("lengths")
    attention = kwargs.get("attention", "causal_linear")
    B, T, D = cur.shape
    H, _, N = encoder.shape
    dnext = np.asarray(dnext, dtype=np.float64)
    dr = layer_norm_bwd_ref(dnext, c["r"])
    dcur = dr.copy()
    dmlp = layer_norm_bwd_ref(dr, c["mlp"])
    ddec = c["flat_q"].reshape(B * T, H * N).T @ dmlp.reshape(B * T, D)
    dflat = dmlp @ c["dec_q"].T
    dy_neuron = dflat.reshape(B, T, H, N).transpose(0, 2, 1, 3)
    dmix = dy_neuron * np.where(c["keep"], c["drop_scale"], 0.0)
    dx_neuron = dmix * c["y_gate"]
    dy_gate = dmix * c["x_neuron"]
    dy_pre = dy_gate * (c["y_gate"] > 0)
    denc = np.zeros(encoder.shape)
    dencv = np.zeros(encoder_v.shape)
    for b in range(B):
        for h in range(H):
            dencv[h] += c["a_hat_q"][b, h].T @ dy_pre[b, h]
            da_hat = dy_pre[b, h] @ c["encv_q"][h].T
            da = layer_norm_bwd_ref(da_hat, c["a"][b, h])
            xn = c["x_neuron"][b, h]
            if attention == "causal_linear":
                dxa, dva = causal_linear_bwd_ref(da, xn, cur[b], lengths)
            else:
                dxa, dva = softmax_attention_bwd_ref(da, xn, cur[b], lengths)
            dcur[b] += dva
            dx_pre = (dx_neuron[b, h] + dxa) * (xn > 0)
            denc[h] += c["cur_q"][b].T @ dx_pre
            dcur[b] += dx_pre @ c["enc_q"][h].T
    return dcur, denc, dencv, ddec
