"""The BDH low-rank residual layer's math: the forward head by head and its hand-written backward.

Siblings: ``__init__.py`` (API, ``LowBitPlan``, the ctx, validation), the backend kernels
``_numpy.py``, ``_numba.py``, ``_cuda.py`` (causal-linear attention); reference
``reference/lowrank_residual.py``. The layer norms are the ``layer_norm`` op's (``normalize``,
``normalize_backward``). Every projection is ``packed_matmul``'s straight-through pair
(``straight_through_forward`` / ``straight_through_backward``), the one that ``linear_forward``
runs, so the layer's backward uses the packed dx kernels too. Array-generic (numpy or cupy).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ... import _backend, _profile
from ..layer_norm import normalize, normalize_backward
from ..packed_matmul import activation_codes, straight_through_backward, straight_through_forward
from ..quantize import ACT_FORMATS, EPS, quantize_weight, weight_rows
from ..saved_activation import save
from ..segmented_attention import (segmented_attention, segmented_attention_backward,
                                   segmented_attention_forward)

#: Token rows per call of the residual (decoder) product when its activations are quantized.
RESIDUAL_ROW_BLOCK = 128
#: Base of the rotary angles (BDH's): phi = t * ROPE_THETA ** (-2j / N).
ROPE_THETA = 2.0**16
#: Multipliers of the dropout hash (see reference/lowrank_residual.py, dropout_keep_ref).
HASH_SEED_MUL = 0x9E3779B9
HASH_HIGH_MUL = 0x85EBCA6B
HASH_MUL_1 = 0x7FEB352D
HASH_MUL_2 = 0x846CA68B


@functools.lru_cache(maxsize=16)
def _rope_tables_host(T, N):
    """cos/sin of the rotary angles, [T, N // 2] float32 each (angles in float64)."""
    j = np.arange(N // 2, dtype=np.float64)
    phi = np.arange(T, dtype=np.float64)[:, None] * ROPE_THETA ** (-2.0 * j / N)[None, :]
    return np.cos(phi).astype(np.float32), np.sin(phi).astype(np.float32)


def rope_tables(T, N, xp):
    cos, sin = _rope_tables_host(T, N)
    return xp.asarray(cos), xp.asarray(sin)


def starts(lengths, xp):
    """Segment boundaries [S + 1] int64: starts of every segment, then T."""
    return xp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def _dropout_scale(shape, h, H, p, seed, xp, rows=slice(None)):
    """Inverted-dropout multiplier of head ``h``: [B, T, N] float32 of 0 or 1 / (1 - p).

    The keep decision hashes (seed, flat index into [B, H, T, N]); identical on every backend.
    ``rows`` selects batch rows (a slice), for a backward that goes row by row.
    """
    B, T, N = shape
    b = xp.arange(B, dtype=np.uint64)[rows, None, None]
    rest = xp.arange(T * N, dtype=np.uint64).reshape(1, T, N)
    index = (b * np.uint64(H) + np.uint64(h)) * np.uint64(T * N) + rest
    x = (index & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    x += np.uint32((seed * HASH_SEED_MUL) & 0xFFFFFFFF)
    x += (index >> np.uint64(32)).astype(np.uint32) * np.uint32(HASH_HIGH_MUL)
    x ^= x >> np.uint32(16)
    x *= np.uint32(HASH_MUL_1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(HASH_MUL_2)
    x ^= x >> np.uint32(16)
    threshold = min(int(round(p * 2.0**32)), 2**32)
    keep = x >= np.uint64(threshold) if threshold < 2**32 else xp.zeros(x.shape, dtype=bool)
    return keep.astype(np.float32) * np.float32(1.0 / (1.0 - p))


def _quantize_weights(plan, encoder, encoder_v, decoder):
    """Quantized forms of the weights the plan asks for: {name: PackedWeight or list}."""
    packed = {}
    wx, wy, wr = plan.x[0], plan.y[0], plan.residual[0]
    if wx is not None:
        packed["encoder"] = [quantize_weight(encoder[h], wx) for h in range(encoder.shape[0])]
    if wy is not None:
        packed["encoder_v"] = [quantize_weight(encoder_v[h], wy) for h in range(encoder_v.shape[0])]
    if wr is not None:
        packed["decoder"] = quantize_weight(decoder, wr)
    return packed


def _project(x, w, pw, act):
    """``Qa(x) @ Qw(w)``: [..., K] -> [..., N] float32 (the packed kernels when ``pw`` is set)."""
    y, _, _ = straight_through_forward(x, w, pw, act)
    return y.reshape(x.shape[:-1] + (w.shape[1],))


def _rows(x, xp):
    return xp.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)


def _project_backward(dy, x, w, pw, act, xp):
    """Straight-through ``(dx, dw)`` of ``_project`` from the input ``x`` recovered from the ctx."""
    a, scale_a = activation_codes(x, act) if act is not None else (_rows(x, xp), None)
    dx, dw = straight_through_backward(_rows(dy, xp), w, pw, a, scale_a)
    return dx.reshape(x.shape), dw


def forward(impl, current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
            relu_threshold, dropout, seed, keep):
    """The layer on validated float32 inputs: ``(next, fields)``, ``fields`` the ctx's saved
    tensors and quantized weights (None when ``keep`` is False)."""
    xp = _backend.array_module(current)
    B, T, D = current.shape
    H, _, N = encoder.shape
    thr = np.float32(relu_threshold)
    stage = functools.partial(_profile.stage, "forward", like=current)
    packed = _quantize_weights(plan, encoder, encoder_v, decoder)
    bounds = starts(lengths, xp)
    cos, sin = rope_tables(T, N, xp)
    flat_residual = plan.residual != (None, None)
    mlp = _backend.empty((B, T, D), np.float32, xp) if not flat_residual else None
    flat = _backend.empty((B, T, H * N), np.float32, xp) if flat_residual else None
    saved_x, saved_y, saved_a, saved_am, saved_ar = [], [], [], [], []
    for h in range(H):
        with stage("x projection"):
            x_neuron = _project(current, encoder[h], packed.get("encoder", [None] * H)[h],
                                plan.x[1])
            x_neuron -= thr
            xp.maximum(x_neuron, 0, out=x_neuron)
        with stage("attention"):
            if attention == "causal_linear":
                a = impl.causal_linear_forward(x_neuron, current, bounds, cos, sin)
            else:
                a = _softmax_attention(x_neuron, current, lengths)
        with stage("norms"):
            a_hat, a_mean, a_rstd = normalize(a)
        with stage("y projection"):
            y_gate = _project(a_hat, encoder_v[h], packed.get("encoder_v", [None] * H)[h],
                              plan.y[1])
            y_gate -= thr
            xp.maximum(y_gate, 0, out=y_gate)
            del a_hat
        with stage("product"):
            y_neuron = x_neuron * y_gate
            if dropout > 0:
                y_neuron *= _dropout_scale((B, T, N), h, H, dropout, seed, xp)
        if keep:
            saved_x.append(save(x_neuron, saved, kind="nonneg"))
            saved_y.append(save(y_gate, saved, kind="nonneg"))
            saved_a.append(save(a, saved))
            saved_am.append(save(a_mean, None))
            saved_ar.append(save(a_rstd, None))
        del x_neuron, y_gate, a
        with stage("decoder tail"):
            if flat_residual:
                flat[:, :, h * N:(h + 1) * N] = y_neuron
            elif h == 0:
                xp.matmul(y_neuron, decoder[:N], out=mlp)
            else:
                mlp += y_neuron @ decoder[h * N:(h + 1) * N]
            del y_neuron
    with stage("decoder tail"):
        if flat_residual:
            # Row blocks: activations are quantized per row, so this is the one product, and
            # the matmul's own temporaries stay a block's size.
            mlp = _backend.empty((B, T, D), np.float32, xp)
            rows, out_rows = flat.reshape(B * T, H * N), mlp.reshape(B * T, D)
            for r0 in range(0, B * T, RESIDUAL_ROW_BLOCK):
                out_rows[r0:r0 + RESIDUAL_ROW_BLOCK] = _project(
                    rows[r0:r0 + RESIDUAL_ROW_BLOCK], decoder, packed.get("decoder"),
                    plan.residual[1])
            del flat, rows
    with stage("residual"):
        m_hat, m_mean, m_rstd = normalize(mlp)
        m_hat += current
        out, o_mean, o_rstd = normalize(m_hat)
        del m_hat
    if not keep:
        return out, None
    return out, dict(
        packed=packed, current=save(current, saved), x_neuron=saved_x, y_gate=saved_y,
        attn=saved_a, attn_mean=saved_am, attn_rstd=saved_ar, mlp=save(mlp, saved),
        mlp_mean=save(m_mean, None), mlp_rstd=save(m_rstd, None), out_mean=save(o_mean, None),
        out_rstd=save(o_rstd, None))


def _seg_args(x_neuron, current, lengths):
    B, T, N = x_neuron.shape
    q = x_neuron.reshape(B * T, 1, N)
    v = current.reshape(B * T, 1, current.shape[2])
    return q, v, list(lengths) * B, 1.0 / math.sqrt(N)


def _softmax_attention(x_neuron, current, lengths):
    """Causal softmax attention with q = k = x_neuron through lowbit.segmented_attention."""
    q, v, tiled, scale = _seg_args(x_neuron, current, lengths)
    out = segmented_attention(q, q, v, tiled, scale=scale, causal=True)
    return out.reshape(current.shape)


def _softmax_attention_backward(da, x_neuron, current, lengths):
    """Gradients (dx_neuron, dcurrent) of ``_softmax_attention``; recomputes its forward."""
    q, v, tiled, scale = _seg_args(x_neuron, current, lengths)
    _, actx = segmented_attention_forward(q, q, v, tiled, scale=scale, causal=True)
    dq, dk, dv = segmented_attention_backward(da.reshape(v.shape[0], 1, -1), actx)
    dq += dk
    return dq.reshape(x_neuron.shape), dv.reshape(current.shape)


def _normalized(saved_x, mean, rstd):
    """Recompute ``(x - mean) * rstd`` from a saved pre-norm tensor and its statistics."""
    x = saved_x.unpack()
    return (x - mean.unpack()[..., None]) * rstd.unpack()[..., None]


def backward(impl, dnext, ctx, grads):
    """Gradients of the layer into ``grads = (dencoder, dencoder_v, ddecoder)`` (added in
    place); returns ``(dcurrent, dencoder, dencoder_v, ddecoder)``. ``dnext`` float32."""
    xp = _backend.array_module(dnext)
    dencoder, dencoder_v, ddecoder = grads
    B, T, D, H, N = ctx.shape
    plan = ctx.plan
    stage = functools.partial(_profile.stage, "backward", like=dnext)
    bounds = starts(ctx.lengths, xp)
    cos, sin = rope_tables(T, N, xp)
    current = ctx.current.unpack()
    with stage("residual"):
        m_hat = _normalized(ctx.mlp, ctx.mlp_mean, ctx.mlp_rstd)
        r_hat = (current + m_hat - ctx.out_mean.unpack()[..., None]) * ctx.out_rstd.unpack()[
            ..., None]
        dcurrent = normalize_backward(dnext, r_hat, ctx.out_rstd.unpack())
        del r_hat
        dmlp = normalize_backward(dcurrent, m_hat, ctx.mlp_rstd.unpack())
        del m_hat
    with stage("decoder tail"):
        # The decoder's rows of each head as a packed weight of its own, and the per-token scale
        # of Qa(y_neuron) over all H * N features.
        pw = ctx.packed.get("decoder")
        dec_heads = [None if pw is None else weight_rows(pw, h * N, (h + 1) * N)
                     for h in range(H)]
        act = plan.residual[1]
        row_scale = _residual_row_scale(ctx, act, xp) if act is not None else None
    for h in range(H):
        x_all = ctx.x_neuron[h].unpack()
        y_all = ctx.y_gate[h].unpack()
        a_all = ctx.attn[h].unpack()
        heads = slice(h * N, (h + 1) * N)
        # One batch row at a time: the per-row temporaries are 1 / B of a head's.
        for b in range(B):
            rows = slice(b, b + 1)
            x_neuron, y_gate, dmlp_b = x_all[rows], y_all[rows], dmlp[rows]
            keep = (_dropout_scale((B, T, N), h, H, ctx.dropout, ctx.seed, xp, rows)
                    if ctx.dropout > 0 else None)
            with stage("decoder tail"):
                y_neuron = x_neuron * y_gate
                if keep is not None:
                    y_neuron *= keep
                if act is None:
                    a, scale_a = _rows(y_neuron, xp), None
                else:
                    scale_a = row_scale[rows].reshape(-1)
                    a = _row_codes(y_neuron.reshape(-1, N), scale_a, ACT_FORMATS[act], xp)
                del y_neuron
                dy_neuron, dw = straight_through_backward(dmlp_b.reshape(T, D),
                                                          ctx.decoder[heads], dec_heads[h], a,
                                                          scale_a)
                ddecoder[heads] += dw
                dy_neuron = dy_neuron.reshape(1, T, N)
                del a, dw
            with stage("product"):
                if keep is not None:
                    dy_neuron *= keep
                del keep
                dx_neuron = dy_neuron * y_gate
                dy_pre = dy_neuron
                dy_pre *= x_neuron
                dy_pre *= y_gate > 0
                del dy_neuron
            with stage("norms"):
                a_hat = ((a_all[rows] - ctx.attn_mean[h].unpack()[rows][..., None])
                         * ctx.attn_rstd[h].unpack()[rows][..., None])
            with stage("y projection"):
                pwv = ctx.packed["encoder_v"][h] if "encoder_v" in ctx.packed else None
                da_hat, dw = _project_backward(dy_pre, a_hat, ctx.encoder_v[h], pwv, plan.y[1],
                                               xp)
                dencoder_v[h] += dw
                del dy_pre, dw
            with stage("norms"):
                da = normalize_backward(da_hat, a_hat, ctx.attn_rstd[h].unpack()[rows])
                del a_hat, da_hat
            with stage("attention"):
                if ctx.attention == "causal_linear":
                    dxa, dva = impl.causal_linear_backward(da, x_neuron, current[rows], bounds,
                                                           cos, sin)
                else:
                    dxa, dva = _softmax_attention_backward(da, x_neuron, current[rows],
                                                           ctx.lengths)
                del da
                dcurrent[rows] += dva
                dx_neuron += dxa
                del dxa, dva
            with stage("x projection"):
                dx_neuron *= x_neuron > 0
                pwx = ctx.packed["encoder"][h] if "encoder" in ctx.packed else None
                dcur_b, dw = _project_backward(dx_neuron, current[rows], ctx.encoder[h], pwx,
                                               plan.x[1], xp)
                dencoder[h] += dw
                dcurrent[rows] += dcur_b
                del dcur_b, dx_neuron, dw, x_neuron, y_gate
        del x_all, y_all, a_all
    return dcurrent, dencoder, dencoder_v, ddecoder


def _residual_row_scale(ctx, act, xp):
    """Per-token scale of ``Qa(y_neuron)`` over all H * N features: [B, T] float32.

    The formula of ``lowbit.quantize_activation`` (``max(max|row|, eps) / qmax``; the rows are
    non-negative), computed head by head so the backward never holds all of ``y_neuron``.
    """
    B, T, D, H, N = ctx.shape
    top = xp.zeros((B, T), np.float32)
    for h in range(H):
        xp.maximum(top, _product(ctx, h, xp).max(axis=-1), out=top)
    return xp.maximum(top, np.float32(EPS)) / np.float32(ACT_FORMATS[act])


def _row_codes(x, scale, qmax, xp):
    """``clip(rint(x / scale), -qmax, qmax)`` as int8 codes, with a given row scale [M]."""
    q = x / scale[:, None]
    xp.rint(q, out=q)
    xp.clip(q, -qmax, qmax, out=q)
    return q.astype(np.int8)


def _product(ctx, h, xp):
    """Recompute ``y_neuron`` of head ``h`` from the saved x_neuron and y_gate."""
    B, T, D, H, N = ctx.shape
    y_neuron = ctx.x_neuron[h].unpack() * ctx.y_gate[h].unpack()
    if ctx.dropout > 0:
        y_neuron *= _dropout_scale((B, T, N), h, H, ctx.dropout, ctx.seed, xp)
    return y_neuron
