"""The BDH low-rank residual layer: forward, hand-written backward, low-bit plan, saved policy.

Backends (only the causal-linear attention and the layer norms are backend kernels; the
projections go through the matmul ops): ``_numpy.py``, ``_numba.py``, ``_cuda.py``
(``cuda/lowrank_residual.cu``). Reference: ``reference/lowrank_residual.py``; tests:
``tests/test_lowrank_residual.py``; benchmark: ``bench/lowrank_residual.py`` (the default run of
``python -m bench``).

Forward, head by head (``LN`` normalizes the last axis, no affine parameters, eps 1e-5)::

    x_neuron = relu(current @ encoder[h] - relu_threshold)             [B, T, N] per head
    a        = attention(x_neuron, current)                            [B, T, D]
    y_gate   = relu(LN(a) @ encoder_v[h] - relu_threshold)             [B, T, N]
    y_neuron = dropout(x_neuron * y_gate)
    mlp     += y_neuron @ decoder[h * N:(h + 1) * N]                   [B, T, D]
    next     = LN(current + LN(mlp))

What the ctx saves, each tensor once, through ``lowbit._ctx.save``: ``current``; per head
``x_neuron`` and ``y_gate`` (``kind="nonneg"``: the ReLU masks stay exact) and the pre-norm
attention output ``a`` with its mean and reciprocal standard deviation; ``mlp`` with its
statistics, and the statistics of ``current + LN(mlp)``. Recomputed in the backward: the product
``y_neuron`` (and the dropout mask, a hash of the element index), the rotated queries, every
normalized output (from the saved input and statistics), and, for ``attention="segmented"``, the
attention forward (so its ctx does not save ``x_neuron`` and ``current`` a second time).
Statistics (``[B, T]``, per head for ``a``) are kept exact; ``ctx.nbytes`` counts them.

Memory: the forward goes head by head (temporaries ``[B, T, N]``; with a quantized decoder
projection one ``[B, T, H * N]`` buffer, multiplied in row blocks), the backward head by head
and batch row by batch row, and ``lowrank_residual_backward(..., accumulate=grads)`` adds the
weight gradients into caller-held buffers (BDH applies one layer several times with shared
weights). Per-stage time and bytes: ``lowbit.profile()`` (``lowbit/_profile.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from ... import _backend, _dispatch, _profile, _validate
from ..._ctx import Ctx, save
from ..packed_matmul import packed_matmul
from ..quantize import fake_quantize_activation, quantize_weight
from ..segmented_attention import (segmented_attention, segmented_attention_backward,
                                   segmented_attention_forward)

OP = "lowrank_residual"
ATTENTIONS = ("causal_linear", "segmented")
WEIGHT_FORMATS = (None, "ternary", "sign", "int8")
ACT_FORMATS = (None, "int8", "int4")
SAVED_FORMATS = ("fp32", "int8", "int4", "int2", "sparse")
#: Token rows per call of the residual (decoder) product when its activations are quantized.
RESIDUAL_ROW_BLOCK = 128
#: Base of the rotary angles (BDH's): phi = t * ROPE_THETA ** (-2j / N).
ROPE_THETA = 2.0**16
#: Multipliers of the dropout hash (see reference/lowrank_residual.py, dropout_keep_ref).
HASH_SEED_MUL = 0x9E3779B9
HASH_HIGH_MUL = 0x85EBCA6B
HASH_MUL_1 = 0x7FEB352D
HASH_MUL_2 = 0x846CA68B


@dataclasses.dataclass(frozen=True)
class LowBitPlan:
    """Weight and activation formats of the three projections of the layer.

    Each field is a pair ``(weight_format, act_format)``: weight format ``None``, ``"ternary"``,
    ``"sign"`` or ``"int8"``; activation format ``None``, ``"int8"`` or ``"int4"``.

    Attributes:
        x: the encoder projection (``current @ encoder[h]``; activation rows: the D features of
            each token).
        y: the encoder_v projection (activation rows: the D features of the normalized
            attention output per head and token).
        residual: the decoder projection (activation rows: the H * N features of ``y_neuron``
            per token).
    """

    x: tuple = (None, None)
    y: tuple = (None, None)
    residual: tuple = (None, None)

    def __post_init__(self):
        for name in ("x", "y", "residual"):
            pair = getattr(self, name)
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(
                    f"plan.{name} must be a pair (weight_format, act_format), got {pair!r}")
            weight, act = pair
            if weight not in WEIGHT_FORMATS:
                raise ValueError(
                    f"plan.{name} weight format must be one of {WEIGHT_FORMATS}, got {weight!r}")
            if act not in ACT_FORMATS:
                raise ValueError(
                    f"plan.{name} activation format must be one of {ACT_FORMATS}, got {act!r}")
            object.__setattr__(self, name, (weight, act))

    @classmethod
    def uniform(cls, weight=None, act=None) -> "LowBitPlan":
        """The same formats on every projection, e.g. ``LowBitPlan.uniform("ternary", "int8")``."""
        return cls(x=(weight, act), y=(weight, act), residual=(weight, act))

    @property
    def quantized(self) -> bool:
        return any(f is not None for pair in (self.x, self.y, self.residual) for f in pair)


@dataclasses.dataclass(frozen=True)
class LowrankResidualCtx(Ctx):
    """What ``lowrank_residual_backward`` needs. Saved tensors are ``lowbit._ctx.Saved``.

    Weights are plain fields (the caller holds them; not counted in ``nbytes``); ``packed`` holds
    their quantized forms per projection.
    """

    shape: tuple  # (B, T, D, H, N)
    attention: str
    lengths: tuple
    plan: LowBitPlan
    relu_threshold: float
    dropout: float
    seed: int
    encoder: object
    encoder_v: object
    decoder: object
    packed: dict
    current: object
    x_neuron: list
    y_gate: list
    attn: list
    attn_mean: list
    attn_rstd: list
    mlp: object
    mlp_mean: object
    mlp_rstd: object
    out_mean: object
    out_rstd: object


# -- validation ----------------------------------------------------------------------------------

def _weight(w, name):
    w = _validate.floating(_validate.as_array(w, name), name)
    if w.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(w.shape)}")
    return _validate.all_finite(w, name)


def _lengths(lengths, T):
    if lengths is None:
        return (T,)
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise TypeError(f"lengths must be a sequence of integers, got {type(lengths).__name__}")
    host = lengths.get() if _backend.is_cupy_array(lengths) else lengths
    values = tuple(_validate.integer(v, f"lengths[{i}]", minimum=1)
                   for i, v in enumerate(np.asarray(host).reshape(-1).tolist()
                                         if isinstance(host, np.ndarray) else host))
    if not values:
        raise ValueError("lengths must not be empty")
    total = sum(values)  # Python ints: no overflow
    if total != T:
        raise ValueError(f"lengths must sum to T={T} (current.shape[1]), got {total}")
    return values


def _saved(saved):
    if saved is None:
        return None
    if isinstance(saved, str):
        if saved not in SAVED_FORMATS:
            raise ValueError(
                f"saved must be one of {SAVED_FORMATS} or a SavedConfig, got {saved!r}")
        return saved
    fmt = getattr(saved, "format", None)
    if fmt not in SAVED_FORMATS:
        raise ValueError(f"saved must be one of {SAVED_FORMATS} or a SavedConfig, got {saved!r}")
    return saved


def _check(current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
           relu_threshold, dropout, seed):
    current = _validate.as_array(current, "current")
    _validate.floating(current, "current")
    if current.ndim != 3 or 0 in current.shape:
        raise ValueError(f"current must have shape [B, T, D] with positive sizes, got "
                         f"{tuple(current.shape)}")
    _validate.all_finite(current, "current")
    B, T, D = current.shape
    encoder = _weight(encoder, "encoder")
    if encoder.ndim != 3 or encoder.shape[1] != D:
        raise ValueError(f"encoder must have shape [H, D={D}, N] (D from current), got "
                         f"{tuple(encoder.shape)}")
    H, _, N = encoder.shape
    encoder_v = _weight(encoder_v, "encoder_v")
    if tuple(encoder_v.shape) != (H, D, N):
        raise ValueError(f"encoder_v must have shape {(H, D, N)} like encoder, got "
                         f"{tuple(encoder_v.shape)}")
    decoder = _weight(decoder, "decoder")
    if tuple(decoder.shape) != (H * N, D):
        raise ValueError(f"decoder must have shape {(H * N, D)} (H * N, D), got "
                         f"{tuple(decoder.shape)}")
    _backend.array_kind(current, encoder, encoder_v, decoder)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    lengths = _lengths(lengths, T)
    if plan is None:
        plan = LowBitPlan()
    elif not isinstance(plan, LowBitPlan):
        raise TypeError(f"plan must be a lowbit.LowBitPlan or None, got {type(plan).__name__}")
    saved = _saved(saved)
    relu_threshold = _validate.finite_scalar(relu_threshold, "relu_threshold")
    dropout = _validate.finite_scalar(dropout, "dropout")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
    seed = _validate.integer(seed, "seed", minimum=0)
    if seed >= 2**32:
        raise ValueError(f"seed must be below 2**32, got {seed}")
    return (current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
            relu_threshold, dropout, seed)


# -- array helpers (array-generic: numpy or cupy) -----------------------------------------------

@functools.lru_cache(maxsize=16)
def _rope_tables_host(T, N):
    """cos/sin of the rotary angles, [T, N // 2] float32 each (angles in float64)."""
    j = np.arange(N // 2, dtype=np.float64)
    phi = np.arange(T, dtype=np.float64)[:, None] * ROPE_THETA ** (-2.0 * j / N)[None, :]
    return np.cos(phi).astype(np.float32), np.sin(phi).astype(np.float32)


def _rope_tables(T, N, xp):
    cos, sin = _rope_tables_host(T, N)
    return xp.asarray(cos), xp.asarray(sin)


def _starts(lengths, xp):
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
    """``Qa(x) @ Qw(w)`` in float32: the packed kernels when the weight is quantized.

    Args:
        x: [..., K] float32; w: [K, N] float32 master weight; pw: its PackedWeight or None;
        act: activation format or None.
    """
    if pw is not None:
        return packed_matmul(x, pw, act_format=act)
    if act is not None:
        x = fake_quantize_activation(x, act)
    return x @ w


def _project_backward(dy, x, w, pw, act):
    """Straight-through backward of ``_project``: ``(dx, dw)`` in float32.

    ``dx = dy @ Qw(w).T`` and ``dw = Qa(x).T @ dy`` (leading axes flattened), with ``x`` the
    input as recovered from the ctx.
    """
    wq = pw.dequantize() if pw is not None else w
    xq = fake_quantize_activation(x, act) if act is not None else x
    K, N = wq.shape
    dw = xq.reshape(-1, K).T @ dy.reshape(-1, N)
    return dy @ wq.T, dw


# -- the op ---------------------------------------------------------------------------------------

def lowrank_residual_forward(current, encoder, encoder_v, decoder, *, attention="causal_linear",
                             lengths=None, plan=None, saved=None, relu_threshold=0.0, dropout=0.0,
                             seed=0):
    """Forward of the BDH low-rank residual layer, keeping what the backward needs.

    Args:
        current: [B, T, D] float32 (float64 is computed in float32).
        encoder, encoder_v: [H, D, N] float32.
        decoder: [H * N, D] float32.
        attention: ``"causal_linear"`` (BDH's: rotary positions, strictly causal, no softmax) or
            ``"segmented"`` (causal softmax through ``lowbit.segmented_attention``, scale
            ``1 / sqrt(N)``).
        lengths: segment lengths summing to T, applied to every batch row (None: one segment).
        plan: a ``LowBitPlan`` (None: full precision).
        saved: saved-activation policy (``"fp32"``, ``"int8"``, ``"int4"``, ``"int2"``,
            ``"sparse"`` or a ``SavedConfig``); None keeps every saved tensor exact.
        relu_threshold: subtracted before both ReLUs (sets the neuron density).
        dropout: inverted-dropout probability on ``y_neuron``, in [0, 1).
        seed: dropout seed (the mask is a hash of (seed, element index); nothing is saved).

    Returns:
        ``(next, ctx)``: next [B, T, D] float32 and a ``LowrankResidualCtx``.

    Raises:
        TypeError, ValueError: bad arguments (the message names the argument).
    """
    return _forward(current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
                    relu_threshold, dropout, seed, keep=True)


def lowrank_residual(current, encoder, encoder_v, decoder, *, attention="causal_linear",
                     lengths=None, plan=None, relu_threshold=0.0, dropout=0.0, seed=0):
    """Inference form of ``lowrank_residual_forward``: returns ``next`` and saves nothing."""
    return _forward(current, encoder, encoder_v, decoder, attention, lengths, plan, None,
                    relu_threshold, dropout, seed, keep=False)[0]


def _forward(current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
             relu_threshold, dropout, seed, keep):
    (current, encoder, encoder_v, decoder, attention, lengths, plan, saved, relu_threshold,
     dropout, seed) = _check(current, encoder, encoder_v, decoder, attention, lengths, plan,
                             saved, relu_threshold, dropout, seed)
    _, impl = _dispatch.resolve(OP, current, encoder, encoder_v, decoder)
    xp = _backend.array_module(current)
    f32 = lambda a: a.astype(np.float32, copy=False)  # noqa: E731
    current, encoder, encoder_v, decoder = map(f32, (current, encoder, encoder_v, decoder))
    B, T, D = current.shape
    H, _, N = encoder.shape
    thr = np.float32(relu_threshold)
    stage = functools.partial(_profile.stage, "forward", like=current)
    packed = _quantize_weights(plan, encoder, encoder_v, decoder)
    starts = _starts(lengths, xp)
    cos, sin = _rope_tables(T, N, xp)
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
                a = impl.causal_linear_forward(x_neuron, current, starts, cos, sin)
            else:
                a = _softmax_attention(x_neuron, current, lengths)
        with stage("norms"):
            a_hat, a_mean, a_rstd = impl.layer_norm_forward(a)
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
        m_hat, m_mean, m_rstd = impl.layer_norm_forward(mlp)
        m_hat += current
        out, o_mean, o_rstd = impl.layer_norm_forward(m_hat)
        del m_hat
    if not keep:
        return out, None
    ctx = LowrankResidualCtx(
        shape=(B, T, D, H, N), attention=attention, lengths=lengths, plan=plan,
        relu_threshold=relu_threshold, dropout=dropout, seed=seed, encoder=encoder,
        encoder_v=encoder_v, decoder=decoder, packed=packed, current=save(current, saved),
        x_neuron=saved_x, y_gate=saved_y, attn=saved_a, attn_mean=saved_am, attn_rstd=saved_ar,
        mlp=save(mlp, saved), mlp_mean=save(m_mean, None), mlp_rstd=save(m_rstd, None),
        out_mean=save(o_mean, None), out_rstd=save(o_rstd, None))
    return out, ctx


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


def _normalized(saved_x, mean, rstd):
    """Recompute ``(x - mean) * rstd`` from a saved pre-norm tensor and its statistics."""
    x = saved_x.unpack()
    return (x - mean.unpack()[..., None]) * rstd.unpack()[..., None]


def lowrank_residual_backward(dnext, ctx, *, accumulate=None):
    """Backward of ``lowrank_residual_forward``.

    Args:
        dnext: [B, T, D] gradient of ``next``.
        ctx: the ``LowrankResidualCtx`` of the forward (read, never changed).
        accumulate: optional ``(dencoder, dencoder_v, ddecoder)`` float32 arrays shaped like the
            weights; the weight gradients are added into them in place and they are returned
            (BDH applies one layer several times with shared weights: this sums the gradients
            of every application without a second set of gradient buffers). None (default):
            fresh arrays.

    Returns:
        ``(dcurrent, dencoder, dencoder_v, ddecoder)``: float32, shaped like the inputs.
        Quantizers pass gradients straight through (``dx = dy @ Qw(w).T``,
        ``dw = Qa(x).T @ dy``).
    """
    if not isinstance(ctx, LowrankResidualCtx):
        raise TypeError(f"ctx must be the LowrankResidualCtx of lowrank_residual_forward, got "
                        f"{type(ctx).__name__}")
    dnext = _validate.floating(_validate.as_array(dnext, "dnext"), "dnext")
    B, T, D, H, N = ctx.shape
    if tuple(dnext.shape) != (B, T, D):
        raise ValueError(f"dnext must have shape {(B, T, D)} like next, got {tuple(dnext.shape)}")
    _validate.all_finite(dnext, "dnext")
    _, impl = _dispatch.resolve(OP, dnext, ctx.encoder)
    xp = _backend.array_module(dnext)
    grads = _accumulators(accumulate, (H, D, N), (H * N, D), xp)
    dencoder, dencoder_v, ddecoder = grads
    dnext = dnext.astype(np.float32, copy=False)
    plan = ctx.plan
    stage = functools.partial(_profile.stage, "backward", like=dnext)
    starts = _starts(ctx.lengths, xp)
    cos, sin = _rope_tables(T, N, xp)
    current = ctx.current.unpack()
    with stage("residual"):
        m_hat = _normalized(ctx.mlp, ctx.mlp_mean, ctx.mlp_rstd)
        r_hat = (current + m_hat - ctx.out_mean.unpack()[..., None]) * ctx.out_rstd.unpack()[
            ..., None]
        dcurrent = impl.layer_norm_backward(dnext, r_hat, ctx.out_rstd.unpack())
        del r_hat
        dmlp = impl.layer_norm_backward(dcurrent, m_hat, ctx.mlp_rstd.unpack())
        del m_hat
    with stage("decoder tail"):
        # Qw(decoder) as codes (dequantized head by head), and the per-token scale of
        # Qa(y_neuron) over all H * N features.
        pw = ctx.packed.get("decoder")
        dec_codes = pw.codes() if pw is not None else None
        act = plan.residual[1]
        row_scale = _residual_row_scale(ctx, act, xp) if act is not None else None
    for h in range(H):
        x_all = ctx.x_neuron[h].unpack()
        y_all = ctx.y_gate[h].unpack()
        a_all = ctx.attn[h].unpack()
        with stage("decoder tail"):
            if dec_codes is None:
                dec_h = ctx.decoder[h * N:(h + 1) * N]
            else:
                dec_h = dec_codes[h * N:(h + 1) * N].astype(np.float32)
                dec_h *= pw.scale.astype(np.float32)
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
                if act is not None:
                    y_neuron = _fake_quantize_rows(y_neuron, row_scale[rows], ACT_QMAX[act], xp)
                ddecoder[h * N:(h + 1) * N] += y_neuron[0].T @ dmlp_b[0]
                del y_neuron
                dy_neuron = dmlp_b @ dec_h.T
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
                da_hat, dw = _project_backward(dy_pre, a_hat, ctx.encoder_v[h], pwv, plan.y[1])
                dencoder_v[h] += dw
                del dy_pre, dw
            with stage("norms"):
                da = impl.layer_norm_backward(da_hat, a_hat, ctx.attn_rstd[h].unpack()[rows])
                del a_hat, da_hat
            with stage("attention"):
                if ctx.attention == "causal_linear":
                    dxa, dva = impl.causal_linear_backward(da, x_neuron, current[rows], starts,
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
                                               plan.x[1])
                dencoder[h] += dw
                dcurrent[rows] += dcur_b
                del dcur_b, dx_neuron, dw, x_neuron, y_gate
        del x_all, y_all, a_all, dec_h
    return dcurrent, dencoder, dencoder_v, ddecoder


#: Largest code of each activation format (lowbit.quantize_activation's qmax).
ACT_QMAX = {"int8": 127, "int4": 7}
#: Scale floor of the activation quantizer (BitNet b1.58's eps).
ACT_SCALE_EPS = 1e-5


def _accumulators(accumulate, enc_shape, dec_shape, xp):
    """Zeroed gradient buffers, or the caller's ``accumulate`` arrays after checking them."""
    if accumulate is None:
        return (xp.zeros(enc_shape, np.float32), xp.zeros(enc_shape, np.float32),
                xp.zeros(dec_shape, np.float32))
    if not isinstance(accumulate, (tuple, list)) or len(accumulate) != 3:
        raise TypeError("accumulate must be a tuple (dencoder, dencoder_v, ddecoder) or None")
    for name, a, shape in zip(("dencoder", "dencoder_v", "ddecoder"), accumulate,
                              (enc_shape, enc_shape, dec_shape)):
        _validate.as_array(a, f"accumulate {name}")
        if tuple(a.shape) != shape or a.dtype != np.float32:
            raise ValueError(f"accumulate {name} must be float32 of shape {shape}, got "
                             f"{a.dtype} {tuple(a.shape)}")
    return tuple(accumulate)


def _residual_row_scale(ctx, act, xp):
    """Per-token scale of ``Qa(y_neuron)`` over all H * N features: [B, T] float32.

    The same formula as ``lowbit.quantize_activation`` (``max(max|row|, eps) / qmax``; the rows
    are non-negative), computed head by head so the backward never holds all of ``y_neuron``.
    """
    B, T, D, H, N = ctx.shape
    top = xp.zeros((B, T), np.float32)
    for h in range(H):
        xp.maximum(top, _product(ctx, h, xp).max(axis=-1), out=top)
    return xp.maximum(top, np.float32(ACT_SCALE_EPS)) / np.float32(ACT_QMAX[act])


def _fake_quantize_rows(x, scale, qmax, xp):
    """``clip(rint(x / scale), -qmax, qmax) * scale`` with a given row scale [...] (float32)."""
    q = x / scale[..., None]
    xp.rint(q, out=q)
    xp.clip(q, -qmax, qmax, out=q)
    q *= scale[..., None]
    return q


def _product(ctx, h, xp):
    """Recompute ``y_neuron`` of head ``h`` from the saved x_neuron and y_gate."""
    B, T, D, H, N = ctx.shape
    y_neuron = ctx.x_neuron[h].unpack() * ctx.y_gate[h].unpack()
    if ctx.dropout > 0:
        y_neuron *= _dropout_scale((B, T, N), h, H, ctx.dropout, ctx.seed, xp)
    return y_neuron


def _softmax_attention_backward(da, x_neuron, current, lengths):
    """Gradients (dx_neuron, dcurrent) of ``_softmax_attention``; recomputes its forward."""
    q, v, tiled, scale = _seg_args(x_neuron, current, lengths)
    _, actx = segmented_attention_forward(q, q, v, tiled, scale=scale, causal=True)
    dq, dk, dv = segmented_attention_backward(da.reshape(v.shape[0], 1, -1), actx)
    dq += dk
    return dq.reshape(x_neuron.shape), dv.reshape(current.shape)

