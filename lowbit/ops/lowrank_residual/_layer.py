"""The BDH low-rank residual layer's math: the forward head by head (its hand-written backward is
``_layer_backward.py``).

Siblings: ``__init__.py`` (API, ``LowBitPlan``, the ctx, validation), ``_pattern.py`` (block
patterns: each head runs on its active latent neurons only), the backend kernels
``_numpy.py``, ``_numba.py``, ``_cuda.py`` (causal-linear attention); reference
``reference/lowrank_residual.py``. The layer norms are the ``layer_norm`` op's (``normalize``,
``normalize_backward``). Every projection is ``packed_matmul``'s straight-through pair
(``straight_through_forward`` / ``straight_through_backward``), the one that ``linear_forward``
runs, so the layer's backward uses the packed dx kernels too. Array-generic (numpy or cupy).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from ... import _backend, _kernels, _profile
from ..layer_norm import normalize
from ..packed_matmul import activation_codes, straight_through_codes, straight_through_forward
from ..quantize import ACT_FORMATS, quantize_weight
from ..rotary import rotary_tables
from ..saved_activation import save
from ._pattern import gather_columns, gather_rows
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
def _rope_tables_host(T, N, pairs=None):
    """cos/sin of the rotary angles, [T, N // 2] float32 each (angles in float64); ``pairs``
    the bytes of host int64 pair indices (a block pattern's): their columns only."""
    if pairs is not None:
        idx = np.frombuffer(pairs, np.int64)
        return tuple(np.ascontiguousarray(t[:, idx]) for t in _rope_tables_host(T, N))
    # The rotary op's tables: BDH's rotation is its interleaved style at positions 0 .. T - 1.
    return rotary_tables(np.arange(T, dtype=np.int64), N, ROPE_THETA, np.float32)


def rope_tables(T, N, xp, pairs=None):
    """cos/sin of ``_rope_tables_host`` on the array module ``xp``, of every pair or of the
    pairs ``pairs`` (host int64 indices), made and uploaded once per shape, pairs and device (a
    pattern's columns gathered for every head of every call cost more than its projections)."""
    key = None if pairs is None else np.ascontiguousarray(pairs, np.int64).tobytes()
    if xp is np:
        return _rope_tables_host(T, N, key)
    return _rope_tables_device(T, N, key, xp.cuda.Device().id)


@functools.lru_cache(maxsize=16)
def _rope_tables_device(T, N, pairs, device):
    like = _backend.cupy_module().empty(0, np.float32)
    return tuple(_kernels.device_copy(t, like) for t in _rope_tables_host(T, N, pairs))


def starts(lengths, xp):
    """Segment boundaries [S + 1] int64: starts of every segment, then T (a cached table)."""
    like = np.empty(0) if xp is np else xp.empty(0)
    return _kernels.device_constant(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                                    like)


def _dropout_scale(shape, h, H, p, seed, row_offset, xp, rows=slice(None), latent=None):
    """Inverted-dropout multiplier of head ``h``: [B, T, N] float32 of 0 or 1 / (1 - p).

    The keep decision hashes (seed, flat index into [row_offset + B, H, T, N]); identical on
    every backend. ``rows`` selects batch rows (a slice), for a backward that goes a few rows at
    a time; ``latent`` (host int64) the latent neurons of a block pattern (the result is then
    [B, T, len(latent)], each neuron hashed at its own index).
    """
    B, T, N = shape
    # Indices below 2**32 have no high half: the whole hash then runs in uint32.
    small = (row_offset + B) * H * T * N <= 2**32
    dt = np.uint32 if small else np.uint64
    b = xp.arange(row_offset, row_offset + B, dtype=dt)[rows, None, None]
    n = (xp.arange(N, dtype=dt) if latent is None else
         _kernels.device_constant(latent.astype(dt), b))
    rest = (xp.arange(T, dtype=dt)[:, None] * dt(N) + n[None, :])[None]
    index = (b * dt(H) + dt(h)) * dt(T * N) + rest
    if small:
        x = index
    else:
        x = (index & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        x += (index >> np.uint64(32)).astype(np.uint32) * np.uint32(HASH_HIGH_MUL)
    x += np.uint32((seed * HASH_SEED_MUL) & 0xFFFFFFFF)
    x ^= x >> np.uint32(16)
    x *= np.uint32(HASH_MUL_1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(HASH_MUL_2)
    x ^= x >> np.uint32(16)
    threshold = min(int(round(p * 2.0**32)), 2**32)
    keep = x >= np.uint32(threshold) if threshold < 2**32 else xp.zeros(x.shape, dtype=bool)
    return keep.astype(np.float32) * np.float32(1.0 / (1.0 - p))


def quantize_weights(plan, encoder, encoder_v, decoder):
    """Quantized forms of the weights the plan asks for: {name: PackedWeight or list}."""
    packed: dict[str, Any] = {}
    wx, wy, wr = plan.x[0], plan.y[0], plan.residual[0]
    if wx is not None:
        packed["encoder"] = [quantize_weight(encoder[h], wx) for h in range(encoder.shape[0])]
    if wy is not None:
        packed["encoder_v"] = [quantize_weight(encoder_v[h], wy) for h in range(encoder_v.shape[0])]
    if wr is not None:
        packed["decoder"] = quantize_weight(decoder, wr)
    return packed


def _codes(x, act):
    """``(codes [M, K] int8, scale [M] float32)`` of the rows of ``x`` [..., K], or None."""
    return None if act is None else activation_codes(x, act)


def _project(x, q, w, pw):
    """``Qa(x) @ Qw(w)``: [..., K] -> [..., N] float32; ``q`` the activation codes of ``x``'s
    rows (``_codes``) or None (float activations); the packed kernels when ``pw`` is set."""
    if q is None:
        y, _, _ = straight_through_forward(x, w, pw, None)
    else:
        y = straight_through_codes(q[0], q[1], w, pw)
    return y.reshape(x.shape[:-1] + ((w if pw is None else pw).shape[1],))


def _relu(y, thr, xp):
    y -= thr
    return xp.maximum(y, 0, out=y)


def _rows(x, xp):
    return xp.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)


def _save_codes(q):
    return None if q is None else (save(q[0], None), save(q[1], None))


def _unpack_codes(q):
    return None if q is None else (q[0].unpack(), q[1].unpack())


def _apply_dropout(y_neuron, h, H, N, p, seed, row_offset, xp, latent=None):
    """``y_neuron *= mask`` batch row by batch row (the hash's temporaries stay a row's size)."""
    B, T, _ = y_neuron.shape
    for b in range(B):
        y_neuron[b:b + 1] *= _dropout_scale((B, T, N), h, H, p, seed, row_offset, xp,
                                            slice(b, b + 1), latent)


@dataclasses.dataclass(frozen=True)
class HeadWeights:
    """Head ``h``'s weights on its active latent neurons (all N without a pattern): float32
    encoder columns (None under a pattern where the packed form stands in for them: the
    projections then never read them), their packed forms (or None), the rotary tables of the
    active pairs, the decoder rows (a slice, or host int64 indices), the latent indices (None:
    all) and their count."""

    encoder: object
    encoder_v: object
    pwx: object
    pwy: object
    cos: object
    sin: object
    dec_rows: object
    latent: object
    width: int


def head_weights(h, encoder, encoder_v, packed, cos, sin, latent):
    """``HeadWeights`` of head ``h``; ``latent`` the pattern's indices per head or None."""
    N = encoder.shape[2]
    pwx = packed["encoder"][h] if "encoder" in packed else None
    pwy = packed["encoder_v"][h] if "encoder_v" in packed else None
    idx = None if latent is None else latent[h]
    if idx is None:
        return HeadWeights(encoder[h], encoder_v[h], pwx, pwy, cos, sin,
                           slice(h * N, (h + 1) * N), None, N)
    xp = _backend.array_module(encoder)
    cols = _kernels.device_constant(idx, encoder)
    cos, sin = rope_tables(cos.shape[0], N, xp, idx[0:2 * (len(idx) // 2):2] // 2)

    def active(w, pw):  # the float32 columns only where no packed form stands in for them
        return xp.ascontiguousarray(w[h][:, cols]) if pw is None or not len(idx) else None

    return HeadWeights(
        active(encoder, pwx), active(encoder_v, pwy),
        None if pwx is None or not len(idx) else gather_columns(pwx, idx),
        None if pwy is None or not len(idx) else gather_columns(pwy, idx),
        cos, sin, h * N + idx, idx, len(idx))


def decoder_rows(decoder, pw, heads):
    """The decoder's rows of every head's active neurons, in head order: ``(float32, packed)``
    (the very arrays without a pattern; under one the float32 rows only without ``pw``)."""
    if all(w.latent is None for w in heads):
        return decoder, pw
    rows = np.concatenate([np.arange(w.dec_rows.start, w.dec_rows.stop) if w.latent is None
                           else w.dec_rows for w in heads])
    return active_rows(decoder, pw, rows)


def active_rows(decoder, pw, rows):
    """``(float32, packed)`` rows ``rows`` (host int64, sorted) of the decoder: the packed rows
    when ``pw`` is given (the float32 ones are then None: no product reads them), else the
    float32 rows."""
    if pw is not None and len(rows):
        return None, gather_rows(pw, rows)
    xp = _backend.array_module(decoder)
    return xp.ascontiguousarray(decoder[_kernels.device_constant(rows, decoder)]), None


def keeps_attention(attention, latent, width, D):
    """Whether the ctx keeps a head's attention output ``a`` [B, T, D] (else the backward
    recomputes it, the same bits), ``width`` the head's active latent neurons: not where the
    recompute is cheap for the bytes it spares. The segmented attention's backward recomputes
    its forward anyway. Under a block pattern that leaves a head at most D active neurons, ``a``
    is at least as large as each of its saved latent tensors, and the causal-linear backward
    reuses what the recompute found (``causal_linear_recompute``: queries, scores, states), so
    it pays only the products with ``current`` (at a quarter of the blocks of the BDH bench's
    layer, 2 of 7 MiB saved per application, for about a fifth of the attention's backward)."""
    return attention == "causal_linear" and (latent is None or width > D)


def forward(impl, current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
            relu_threshold, dropout, seed, row_offset, keep, packed=None, latent=None):
    """The layer on validated float32 inputs: ``(next, fields)``, ``fields`` the ctx's saved
    tensors and quantized weights (None when ``keep`` is False). ``packed``: the weights'
    quantized forms (``quantize_weights``), made here when None; ``latent``: the active latent
    indices per head of a block pattern (``_pattern.latent_pattern``), or None.

    With a lossy saved-activation policy (any format but ``"fp32"``) and quantized activations,
    a projection keeps its int8 input codes (exact: what its straight-through weight gradient
    multiplies) and the backward recomputes its ReLU output from them with the same kernel (the
    same bits) instead of storing a lossy copy: ``x_neuron`` from the codes of ``current``, and
    ``y_gate`` from those of ``LN(a)`` (which also stand for ``LN(a)`` in the norm's backward).
    """
    xp = _backend.array_module(current)
    B, T, D = current.shape
    H, _, N = encoder.shape
    thr = np.float32(relu_threshold)
    stage = functools.partial(_profile.stage, "forward", like=current)
    if packed is None:
        packed = quantize_weights(plan, encoder, encoder_v, decoder)
    lossy = keep and saved is not None and saved.format != "fp32"
    recompute_x, recompute_y = lossy and plan.x[1] is not None, lossy and plan.y[1] is not None
    bounds = starts(lengths, xp)
    cos, sin = rope_tables(T, N, xp)
    heads = [head_weights(h, encoder, encoder_v, packed, cos, sin, latent) for h in range(H)]
    offsets = np.concatenate([[0], np.cumsum([w.width for w in heads])])
    flat_residual = plan.residual != (None, None)
    # Recomputing every head's y_neuron from the kept codes spares the [B, T, H * N] float32
    # buffer of the decoder's input: pass one takes each token's max over the heads (the scale
    # of Qa(y_neuron)), pass two quantizes each head's share with it.
    two_pass = recompute_x and recompute_y and plan.residual[1] is not None
    mlp: Any = xp.zeros((B, T, D), np.float32) if not flat_residual else None
    flat: Any = (_backend.empty((B, T, int(offsets[-1])), np.float32, xp)
            if flat_residual and not two_pass else None)
    tops: Any = xp.zeros((B * T, H), np.float32) if two_pass else None
    per_head: list[list[Any]] = [[None] * H for _ in range(6)]
    saved_x, saved_y, saved_a, saved_am, saved_ar, saved_ac = per_head
    with stage("x projection"):
        qx = _codes(current, plan.x[1])  # once for every head
    for h, w in enumerate(heads):
        if not w.width:  # no active block: the head contributes nothing
            continue
        with stage("x projection"):
            x_neuron = _relu(_project(current, qx, w.encoder, w.pwx), thr, xp)
        with stage("attention"):
            if attention == "causal_linear":
                a = impl.causal_linear_forward(x_neuron, current, bounds, w.cos, w.sin)
            else:
                a = _softmax_attention(x_neuron, current, lengths, N)
        with stage("norms"):
            a_hat, a_mean, a_rstd = normalize(a)
        with stage("y projection"):
            qa = _codes(a_hat, plan.y[1])
            y_gate = _relu(_project(a_hat, qa, w.encoder_v, w.pwy), thr, xp)
            del a_hat
        with stage("product"):
            y_neuron = x_neuron * y_gate
            if dropout > 0:
                _apply_dropout(y_neuron, h, H, N, dropout, seed, row_offset, xp, w.latent)
        if keep:
            if not recompute_x:
                saved_x[h] = save(x_neuron, saved, kind="nonneg")
            if recompute_y:
                saved_ac[h] = _save_codes(qa)
            else:
                saved_y[h] = save(y_gate, saved, kind="nonneg")
                if keeps_attention(attention, latent, w.width, D):
                    saved_a[h] = save(a, saved)
                saved_am[h] = save(a_mean, None)
            saved_ar[h] = save(a_rstd, None)
        del x_neuron, y_gate, a, qa
        with stage("decoder tail"):
            if two_pass:
                tops[:, h] = y_neuron.reshape(B * T, -1).max(axis=-1)
            elif flat_residual:
                flat[:, :, offsets[h]:offsets[h + 1]] = y_neuron
            else:
                mlp += y_neuron @ decoder[w.dec_rows]
            del y_neuron
    resid_scale = None
    with stage("decoder tail"):
        if flat_residual:
            dec32, pw_dec = decoder_rows(decoder, packed.get("decoder"), heads)
        if two_pass:
            codes = [_unpack_codes(q) for q in saved_ac]
            mlp, resid_scale = _decoder_recomputed(current, qx, heads, codes, offsets, dec32,
                                                   pw_dec, tops, plan.residual[1], thr,
                                                   dropout, seed, row_offset, N, xp)
        elif flat_residual:
            mlp, resid_scale = _decoder_flat(flat, dec32, pw_dec, plan.residual[1], D, xp)
            del flat
    with stage("residual"):
        m_hat, m_mean, m_rstd = normalize(mlp)
        m_hat += current
        out, o_mean, o_rstd = normalize(m_hat)
        del m_hat
    if not keep:
        return out, None
    return out, dict(
        packed=packed, latent=latent, current=save(current, saved),
        x_codes=_save_codes(qx) if plan.x[1] is not None else None,
        x_neuron=None if recompute_x else saved_x, y_gate=None if recompute_y else saved_y,
        attn=None if recompute_y else saved_a, attn_mean=None if recompute_y else saved_am,
        attn_rstd=saved_ar, attn_codes=saved_ac if recompute_y else None,
        mlp=save(mlp, saved), mlp_mean=save(m_mean, None), mlp_rstd=save(m_rstd, None),
        out_mean=save(o_mean, None), out_rstd=save(o_rstd, None),
        resid_scale=None if resid_scale is None else save(resid_scale, None))


def _decoder_flat(flat, decoder, pw, act, D, xp):
    """``Qa(flat) @ Qw(decoder)`` over [B, T, F]: ``(mlp [B, T, D], row scales or None)``.

    Row blocks: activations are quantized per row, so this is the one product, and the
    quantizer's float temporaries stay a block's size.
    """
    B, T, F = flat.shape
    mlp = _backend.empty((B, T, D), np.float32, xp)
    if not F:
        mlp.fill(0)
    rows, out_rows = flat.reshape(B * T, F), mlp.reshape(B * T, D)
    scale: Any = _backend.empty((B * T,), np.float32, xp) if act is not None else None
    for r0 in range(0, B * T, RESIDUAL_ROW_BLOCK if F else B * T):
        r = slice(r0, r0 + RESIDUAL_ROW_BLOCK)
        q = _codes(rows[r], act)
        if F:
            out_rows[r] = _project(rows[r], q, decoder, pw)
        if q is not None:
            scale[r] = q[1]
    return mlp, scale


def _decoder_recomputed(current, qx, heads, head_codes, offsets, decoder, pw, tops, act, thr,
                        dropout, seed, row_offset, N, xp):
    """The decoder product of ``_decoder_flat`` from recomputed heads, with the same bits.

    ``tops`` [B * T, H]: each head's row max of ``y_neuron`` (>= 0), so quantizing it per row
    gives the scale that quantizing the whole decoder input row gives (same absmax, same
    kernel); ``head_codes``: per head the codes of LN(a). Each head's ``y_neuron`` is rebuilt
    exactly as the first pass made it and quantized with that scale into one int8 buffer.
    """
    B, T, D = current.shape
    H = len(heads)
    _, scale = activation_codes(tops, act)
    codes = xp.zeros((B * T, int(offsets[-1])), np.int8)
    mlp = xp.zeros((B, T, D), np.float32)
    for h, (w, qa) in enumerate(zip(heads, head_codes)):
        if not w.width:
            continue
        y_neuron = _relu(_project(current, qx, w.encoder, w.pwx), thr, xp)
        y_gate = straight_through_codes(qa[0], qa[1], w.encoder_v, w.pwy)
        y_neuron *= _relu(y_gate, thr, xp).reshape(y_neuron.shape)
        if dropout > 0:
            _apply_dropout(y_neuron, h, H, N, dropout, seed, row_offset, xp, w.latent)
        codes[:, offsets[h]:offsets[h + 1]] = row_codes(y_neuron.reshape(B * T, -1), scale,
                                                         ACT_FORMATS[act], xp)
        del y_neuron
    if codes.shape[1]:
        out_rows = mlp.reshape(B * T, D)
        for r0 in range(0, B * T, RESIDUAL_ROW_BLOCK):
            r = slice(r0, r0 + RESIDUAL_ROW_BLOCK)
            out_rows[r] = straight_through_codes(codes[r], scale[r], decoder, pw)
    return mlp, scale


def _seg_args(x_neuron, current, lengths, N):
    B, T, n = x_neuron.shape
    q = x_neuron.reshape(B * T, 1, n)
    v = current.reshape(B * T, 1, current.shape[2])
    return q, v, list(lengths) * B, 1.0 / math.sqrt(N)


def _softmax_attention(x_neuron, current, lengths, N):
    """Causal softmax attention with q = k = x_neuron through lowbit.segmented_attention (scale
    ``1 / sqrt(N)``, N the head's full latent width whatever its block pattern)."""
    q, v, tiled, scale = _seg_args(x_neuron, current, lengths, N)
    out = segmented_attention(q, q, v, tiled, scale=scale, causal=True)
    return out.reshape(current.shape)


def softmax_attention_recompute(x_neuron, current, lengths, N):
    """``_softmax_attention``'s output (the same kernel, the same bits) and the ctx of
    ``softmax_attention_backward``."""
    q, v, tiled, scale = _seg_args(x_neuron, current, lengths, N)
    out, actx = segmented_attention_forward(q, q, v, tiled, scale=scale, causal=True)
    return out.reshape(current.shape), actx


def softmax_attention_backward(da, actx, x_shape):
    """Gradients ``(dx_neuron [x_shape], dcurrent)`` of ``_softmax_attention`` from the ctx of
    ``softmax_attention_recompute``."""
    dq, dk, dv = segmented_attention_backward(da.reshape(-1, 1, da.shape[-1]), actx)
    dq += dk
    return dq.reshape(x_shape), dv.reshape(da.shape)


def _normalized(saved_x, mean, rstd):
    """Recompute ``(x - mean) * rstd`` from a saved pre-norm tensor and its statistics."""
    x = saved_x.unpack()
    return (x - mean.unpack()[..., None]) * rstd.unpack()[..., None]


def row_codes(x, scale, qmax, xp):
    """``clip(rint(x / scale), -qmax, qmax)`` as int8 codes with a given row scale [M]: the
    quantizer's own arithmetic (``lowbit.quantize_activation``), for a scale found elsewhere."""
    q = x / scale[:, None]
    xp.rint(q, out=q)
    xp.clip(q, -qmax, qmax, out=q)
    return q.astype(np.int8)
