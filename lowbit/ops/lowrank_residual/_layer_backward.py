"""The BDH low-rank residual layer's hand-written backward, head by head, a few batch rows at a
time (the forward is ``_layer.py``; its docstring says what the ctx keeps and what is recomputed).

Siblings: ``__init__.py`` (API, ctx), ``_layer.py`` (forward and the helpers both share),
``_pattern.py`` (block patterns: a head's gradients reach only its active encoder columns and
decoder rows); reference ``reference/lowrank_residual.py``. Array-generic (numpy or cupy).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ... import _backend, _kernels, _profile
from ..layer_norm import normalize_backward
from ..packed_matmul import straight_through_backward, straight_through_codes
from ..quantize import ACT_FORMATS, weight_rows
from ._layer import (_codes, _dropout_scale, _normalized, _relu, _rows, _unpack_codes,
                     active_rows, head_weights, row_codes, rope_tables,
                     softmax_attention_backward, softmax_attention_recompute, starts)
from ._pattern import runs

#: Tokens per step of the backward's loop over batch rows (whole rows; at least one): its
#: temporaries are this many tokens' of one head, and each projection's products this tall.
BACKWARD_ROW_TOKENS = 512
#: Most runs of consecutive indices a scatter adds one slice at a time (beyond: one gather).
MAX_RUNS = 64


def _row_slice(q, rows, T):
    """The activation codes of batch rows ``rows`` (a slice) from codes of every [B * T] row."""
    codes, scale = q
    r = slice(rows.start * T, rows.stop * T)
    return codes[r], scale[r]


def _project_backward(dy, x, q, w, pw, xp):
    """Straight-through ``(dx, dw)`` of ``_layer._project``: ``q`` the activation codes of
    ``x``'s rows (or None: ``x`` itself, float32)."""
    a, scale_a = q if q is not None else (_rows(x, xp), None)
    dx, dw = straight_through_backward(_rows(dy, xp), w, pw, a, scale_a)
    return dx.reshape(x.shape), dw


def _scatter_add(grad, index, dw):
    """``grad[index] += dw`` along axis 0 (a slice, or sorted unique host int64 indices: a
    pattern's blocks, added a run of consecutive indices at a time)."""
    if isinstance(index, slice):
        grad[index] += dw
        return
    spans = runs(index)
    if len(spans) > MAX_RUNS:
        grad[_kernels.device_constant(index, grad)] += dw
        return
    done = 0
    for start, stop in spans:
        grad[start:stop] += dw[done:done + stop - start]
        done += stop - start


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
    qx = _unpack_codes(ctx.x_codes)
    with stage("residual"):
        m_hat = _normalized(ctx.mlp, ctx.mlp_mean, ctx.mlp_rstd)
        r_hat = (current + m_hat - ctx.out_mean.unpack()[..., None]) * ctx.out_rstd.unpack()[
            ..., None]
        dcurrent = normalize_backward(dnext, r_hat, ctx.out_rstd.unpack())
        del r_hat
        dmlp = normalize_backward(dcurrent, m_hat, ctx.mlp_rstd.unpack())
        del m_hat
    act = plan.residual[1]
    row_scale: Any = ctx.resid_scale.unpack() if act is not None else None
    pw_dec = ctx.packed.get("decoder")
    chunk = max(1, BACKWARD_ROW_TOKENS // T)
    for h in range(H):
        w = head_weights(h, ctx.encoder, ctx.encoder_v, ctx.packed, cos, sin, ctx.latent)
        if not w.width:  # no active block: nothing flows through this head
            continue
        with stage("decoder tail"):
            # The decoder's rows of this head (its active ones) as a packed weight of its own;
            # the per-token scale of Qa(y_neuron) over every feature is the forward's.
            if w.latent is None:
                dec32 = ctx.decoder[w.dec_rows]
                pw_h = None if pw_dec is None else weight_rows(pw_dec, h * N, (h + 1) * N)
            else:
                dec32, pw_h = active_rows(ctx.decoder, pw_dec, w.dec_rows)
        head = _HeadInputs(ctx, h, w, current, qx, xp)
        a_rstd = ctx.attn_rstd[h].unpack()
        # A few batch rows at a time: the temporaries are a chunk's, not a head's.
        for b0 in range(0, B, chunk):
            rows = slice(b0, min(B, b0 + chunk))
            with stage("x projection"):
                x_neuron = head.x_neuron(rows)
            with stage("attention"):
                # The attention's forward, where the ctx did not keep a (or, segmented, always:
                # its backward takes the ctx of a forward), and what its backward reuses.
                if ctx.attention != "causal_linear":
                    a, att = softmax_attention_recompute(x_neuron, current[rows], ctx.lengths, N)
                elif head.recompute_a:
                    a, att = impl.causal_linear_recompute(x_neuron, current[rows], bounds, w.cos,
                                                          w.sin)
                else:
                    a, att = None, None
            with stage("y projection"):
                y_gate, a_hat, qa_rows = head.y_gate(rows, a)
                del a
            nb = x_neuron.shape[0]
            keep = (_dropout_scale((B, T, N), h, H, ctx.dropout, ctx.seed, ctx.row_offset, xp,
                                   rows, w.latent) if ctx.dropout > 0 else None)
            with stage("decoder tail"):
                y_neuron = x_neuron * y_gate
                if keep is not None:
                    y_neuron *= keep
                if act is None:
                    a, scale_a = _rows(y_neuron, xp), None
                else:
                    scale_a = row_scale[rows.start * T:rows.stop * T]
                    a = row_codes(y_neuron.reshape(nb * T, -1), scale_a, ACT_FORMATS[act], xp)
                del y_neuron
                dy_neuron, dw = straight_through_backward(dmlp[rows].reshape(nb * T, D), dec32,
                                                          pw_h, a, scale_a)
                _scatter_add(ddecoder, w.dec_rows, dw)
                dy_neuron = dy_neuron.reshape(x_neuron.shape)
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
            with stage("y projection"):
                da_hat, dw = _project_backward(dy_pre, a_hat, qa_rows, w.encoder_v, w.pwy, xp)
                _scatter_add(dencoder_v[h].T, w.latent if w.latent is not None else
                             slice(None), dw.T)
                del dy_pre, dw, qa_rows
            with stage("norms"):
                da = normalize_backward(da_hat, a_hat, a_rstd[rows])
                del a_hat, da_hat
            with stage("attention"):
                if ctx.attention == "causal_linear":
                    dxa, dva = impl.causal_linear_backward(da, x_neuron, current[rows], bounds,
                                                           w.cos, w.sin, att)
                else:
                    dxa, dva = softmax_attention_backward(da, att, x_neuron.shape)
                del da, att
                dcurrent[rows] += dva
                dx_neuron += dxa
                del dxa, dva
            with stage("x projection"):
                dx_neuron *= x_neuron > 0
                qx_rows = None if qx is None else _row_slice(qx, rows, T)
                dcur_b, dw = _project_backward(dx_neuron, current[rows], qx_rows, w.encoder,
                                               w.pwx, xp)
                _scatter_add(dencoder[h].T, w.latent if w.latent is not None else
                             slice(None), dw.T)
                dcurrent[rows] += dcur_b
                del dcur_b, dx_neuron, dw, x_neuron, y_gate
        del head
    return dcurrent, dencoder, dencoder_v, ddecoder


class _HeadInputs:
    """One head's forward tensors for the backward, by batch rows: saved ones unpacked once,
    recomputed ones (from the kept codes, with the forward's kernels and weights) a row slice at
    a time. ``w`` the head's ``_layer.HeadWeights``."""

    def __init__(self, ctx, h, w, current, qx, xp):
        self.ctx, self.w, self.qx, self.xp = ctx, w, qx, xp
        self.thr = np.float32(ctx.relu_threshold)
        self.T = ctx.shape[1]
        self.x_all = ctx.x_neuron[h].unpack() if ctx.x_neuron is not None else None
        #: Whether ``y_gate`` needs a recomputed attention output (the ctx kept neither it nor
        #: the codes of LN(a)).
        self.recompute_a = ctx.attn_codes is None and ctx.attn[h] is None
        if ctx.attn_codes is not None:
            self.qa = _unpack_codes(ctx.attn_codes[h])
        else:
            self.qa = None
            self.y_all = ctx.y_gate[h].unpack()
            if self.recompute_a:
                self.a_stats = ctx.attn_mean[h].unpack(), ctx.attn_rstd[h].unpack()
            else:
                self.a_hat_all = _normalized(ctx.attn[h], ctx.attn_mean[h], ctx.attn_rstd[h])

    def x_neuron(self, rows):
        """[b, T, n] ``x_neuron`` of batch rows ``rows`` (n: the head's active neurons)."""
        if self.x_all is not None:
            return self.x_all[rows]
        codes, scale = _row_slice(self.qx, rows, self.T)
        y = straight_through_codes(codes, scale, self.w.encoder, self.w.pwx)
        return _relu(y, self.thr, self.xp).reshape(-1, self.T, self.w.width)

    def y_gate(self, rows, a):
        """``(y_gate [b, T, n], LN(a) [b, T, D], codes of LN(a)'s rows or None)``; ``a`` the
        recomputed attention output of rows ``rows`` (used where ``recompute_a``)."""
        act = self.ctx.plan.y[1]
        if self.qa is None:
            if self.recompute_a:  # the arithmetic of _normalized on a kept a: the same bits
                mean, rstd = self.a_stats
                a_hat = (a - mean[rows][..., None]) * rstd[rows][..., None]
            else:
                a_hat = self.a_hat_all[rows]
            return self.y_all[rows], a_hat, None if act is None else _codes(a_hat, act)
        codes, scale = q = _row_slice(self.qa, rows, self.T)
        y = _relu(straight_through_codes(codes, scale, self.w.encoder_v, self.w.pwy), self.thr,
                  self.xp).reshape(-1, self.T, self.w.width)
        # LN(a) as the y projection saw it: its codes times their row scales.
        a_hat = (codes.astype(np.float32) * scale[:, None]).reshape(-1, self.T, codes.shape[1])
        return y, a_hat, q
