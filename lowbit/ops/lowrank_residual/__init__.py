"""The BDH low-rank residual layer: forward, hand-written backward, low-bit plan, saved policy.

This file holds the API, ``LowBitPlan``, the ctx and validation; the layer's math is in
``_layer.py``. Backends (only the causal-linear attention is a kernel of this op; the layer
norms are ``lowbit.layer_norm``'s, the projections ``packed_matmul``'s straight-through pair):
``_numpy.py``, ``_numba.py``, ``_cuda.py`` (``cuda/lowrank_residual.cu``). Reference:
``reference/lowrank_residual.py``; tests: ``tests/test_lowrank_residual.py``; benchmark:
``bench/lowrank_residual.py`` (``python -m bench lowrank_residual``).

Forward, head by head (``LN`` normalizes the last axis, no affine parameters, eps 1e-5)::

    x_neuron = relu(current @ encoder[h] - relu_threshold)             [B, T, N] per head
    a        = attention(x_neuron, current)                            [B, T, D]
    y_gate   = relu(LN(a) @ encoder_v[h] - relu_threshold)             [B, T, N]
    y_neuron = dropout(x_neuron * y_gate)
    mlp     += y_neuron @ decoder[h * N:(h + 1) * N]                   [B, T, D]
    next     = LN(current + LN(mlp))

What the ctx saves, each tensor once, through the saved-activation op's ``save``: ``current``;
per head ``x_neuron`` and ``y_gate`` (``kind="nonneg"``: the ReLU masks stay exact) and the
pre-norm attention output ``a`` with its mean and reciprocal standard deviation; ``mlp`` with its
statistics, and the statistics of ``current + LN(mlp)``. With quantized activations, the int8
codes and row scales each projection multiplied are kept exactly (the straight-through weight
gradients multiply the same codes). Under a lossy saved-activation policy (any format but
``"fp32"``), a projection with quantized activations saves its codes instead of its ReLU
output, which the backward recomputes from them with the same kernel (the same bits, fewer
bytes than any lossy copy): ``x_neuron`` from the codes of ``current``, ``y_gate`` from those
of ``LN(a)`` (the codes times their scales then stand for ``LN(a)`` in the norm's backward, and
``a`` itself is not kept). Recomputed in the backward: the product ``y_neuron`` (and the
dropout mask, a hash of the element index), the rotated queries, every normalized output (from
the saved input and statistics), and, for ``attention="segmented"``, the attention forward (so
its ctx does not save ``x_neuron`` and ``current`` a second time, nor ``a``, which that
recompute gives). Under a block pattern that leaves a head at most D active neurons, its
causal-linear attention output ``a`` is recomputed too (``_layer.keeps_attention``), sharing
the queries, scores and states with the attention's backward. Statistics (``[B, T]``, per head for
``a``) are kept exact; ``ctx.nbytes`` counts them.

Memory: the forward goes head by head (temporaries ``[B, T, N]``; with a quantized decoder
projection one ``[B, T, H * N]`` buffer, multiplied in row blocks, or, when the policy is lossy
and every projection's activations are quantized, an int8 one from a second pass), the backward
(``_layer_backward.py``) head by head and a few batch rows at a time
(``BACKWARD_ROW_TOKENS``), and ``lowrank_residual_backward(..., accumulate=grads)`` adds the
weight gradients into caller-held buffers (BDH applies one layer several times with shared
weights). Per-stage time and bytes: ``lowbit.profile()`` (``lowbit/_profile.py``).

Block patterns (``lowbit.BlockPattern``, ``latent_pattern=``; ``_pattern.py``): each head runs on
its active latent neurons only (gathered encoder columns, decoder rows and rotary pairs, the
packed ones by whole bytes where the blocks start on byte boundaries), so the products, the
attention, the saved latent tensors and the gradients shrink with the active fraction (the
saved ``[B, T, D]`` tensors ``current`` and ``mlp`` do not, nor ``a`` where it is kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ... import _backend, _dispatch, _validate
from ..._ctx import Ctx
from ..._typing import Array
from ..quantize import ACT_FORMATS as _ACT_QMAX, WEIGHT_FORMATS as _WEIGHT_BITS, PackedWeight
from ..saved_activation import SavedConfig, saved_policy
from . import _layer, _layer_backward
from ._pattern import BlockPattern, latent_pattern as _latent_pattern  # noqa: F401 (public)

OP = "lowrank_residual"
ATTENTIONS = ("causal_linear", "segmented")
WEIGHT_FORMATS = (None, *_WEIGHT_BITS)
ACT_FORMATS = (None, *_ACT_QMAX)


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
    def uniform(cls, weight: str | None = None, act: str | None = None) -> LowBitPlan:
        """The same formats on every projection, e.g. ``LowBitPlan.uniform("ternary", "int8")``."""
        return cls(x=(weight, act), y=(weight, act), residual=(weight, act))

    @property
    def quantized(self) -> bool:
        return any(f is not None for pair in (self.x, self.y, self.residual) for f in pair)


@dataclasses.dataclass(frozen=True)
class LowrankResidualCtx(Ctx):
    """What ``lowrank_residual_backward`` needs. Saved tensors are ``lowbit._ctx.Saved``.

    Weights are plain fields (the caller holds them; not counted in ``nbytes``); ``packed`` holds
    their quantized forms per projection. ``dtype`` is that of ``next`` (``dnext`` must have
    it), ``dtypes`` those of ``current`` and the three weights (those of their gradients).
    """

    shape: tuple  # (B, T, D, H, N)
    attention: str
    lengths: tuple
    plan: LowBitPlan
    relu_threshold: float
    dropout: float
    seed: int
    row_offset: int
    encoder: object
    encoder_v: object
    decoder: object
    packed: dict
    latent: tuple  # active latent indices per head (latent_pattern), or None: all
    current: object
    x_codes: object  # (codes, scales) of current's rows, or None
    x_neuron: list  # None: recomputed from x_codes
    y_gate: list  # None: recomputed from attn_codes
    attn: list  # None: recomputed from attn_codes; a head's None: recomputed in the backward
    attn_mean: list
    attn_rstd: list
    attn_codes: list  # per head (codes, scales) of LN(a)'s rows, or None
    mlp: object
    mlp_mean: object
    mlp_rstd: object
    out_mean: object
    out_rstd: object
    resid_scale: object  # [B * T] row scales of Qa(y_neuron), or None
    dtype: np.dtype
    dtypes: tuple  # of current, encoder, encoder_v, decoder


# -- validation ----------------------------------------------------------------------------------

def _weight(w, name, finite=True):
    w = _validate.floating(_validate.as_array(w, name), name)
    if w.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(w.shape)}")
    return _validate.all_finite(w, name) if finite else w


def _lengths(lengths, T):
    """Segment lengths as a tuple (None: one segment of all T tokens), by the one rule of
    ``lowbit._validate.offsets``."""
    if lengths is None:
        return (T,)
    return tuple(np.diff(_validate.offsets(lengths, T)).tolist())


def _check(current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
           relu_threshold, dropout, seed, row_offset):
    """The arguments validated, the weights' finiteness excepted (``_finite_weights``)."""
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    current = _validate.as_array(current, "current")
    _validate.floating(current, "current")
    if current.ndim != 3 or 0 in current.shape:
        raise ValueError(f"current must have shape [B, T, D] with positive sizes, got "
                         f"{tuple(current.shape)}")
    _validate.all_finite(current, "current")
    B, T, D = current.shape
    encoder = _weight(encoder, "encoder", finite=False)
    if encoder.ndim != 3 or encoder.shape[1] != D:
        raise ValueError(f"encoder must have shape [H, D={D}, N] (D from current), got "
                         f"{tuple(encoder.shape)}")
    H, _, N = encoder.shape
    encoder_v = _weight(encoder_v, "encoder_v", finite=False)
    if tuple(encoder_v.shape) != (H, D, N):
        raise ValueError(f"encoder_v must have shape {(H, D, N)} like encoder, got "
                         f"{tuple(encoder_v.shape)}")
    decoder = _weight(decoder, "decoder", finite=False)
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
    relu_threshold = _validate.finite_scalar(relu_threshold, "relu_threshold")
    dropout = _validate.finite_scalar(dropout, "dropout")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
    seed = _validate.integer(seed, "seed", minimum=0)
    if seed >= 2**32:
        raise ValueError(f"seed must be below 2**32, got {seed}")
    row_offset = _validate.integer(row_offset, "row_offset", minimum=0)
    if dropout == 0.0:  # seed and row_offset only place the dropout masks
        for name, value in (("seed", seed), ("row_offset", row_offset)):
            if value:
                raise ValueError(f"{name}={value} has no effect with dropout=0 (it only places "
                                 f"the dropout masks); leave {name} at 0")
    return (current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
            relu_threshold, dropout, seed, row_offset)


def quantize_layer_weights(encoder: Array, encoder_v: Array, decoder: Array,
                           plan: LowBitPlan) -> dict:
    """The quantized forms of the layer's weights under ``plan``, for ``packed=``.

    Returns:
        a dict: ``"encoder"`` and ``"encoder_v"`` a list of one ``PackedWeight`` per head (each
        head its own scale), ``"decoder"`` one ``PackedWeight``; only the projections whose
        weight format the plan sets.
    """
    if not isinstance(plan, LowBitPlan):
        raise TypeError(f"plan must be a lowbit.LowBitPlan, got {type(plan).__name__}")
    encoder, encoder_v, decoder = (_weight(w, n).astype(np.float32, copy=False) for w, n in
                                   ((encoder, "encoder"), (encoder_v, "encoder_v"),
                                    (decoder, "decoder")))
    return _layer.quantize_weights(plan, encoder, encoder_v, decoder)


def _packed(packed, plan, encoder, decoder):
    """``packed=`` checked against the plan and the weights' shapes: a PackedWeight of the
    plan's format for each quantized projection, one a head for the encoders."""
    if packed is None:
        return None
    H, D, N = encoder.shape
    want = {name: (pair[0], shape, many) for name, pair, shape, many in (
        ("encoder", plan.x, (D, N), True), ("encoder_v", plan.y, (D, N), True),
        ("decoder", plan.residual, tuple(decoder.shape), False)) if pair[0] is not None}
    if not isinstance(packed, dict) or set(packed) != set(want):
        got = sorted(packed) if isinstance(packed, dict) else type(packed).__name__
        raise ValueError(f"packed must be quantize_layer_weights' dict for this plan (keys "
                         f"{sorted(want)}), got {got}")
    for name, (fmt, shape, many) in want.items():
        items = packed[name] if many else [packed[name]]
        if many and (not isinstance(items, list) or len(items) != H):
            raise ValueError(f"packed[{name!r}] must be a list of {H} PackedWeights (one a head)")
        for pw in items:
            if (not isinstance(pw, PackedWeight) or pw.format != fmt
                    or tuple(pw.shape) != shape):
                raise ValueError(f"packed[{name!r}] must hold {fmt} PackedWeights of shape "
                                 f"{shape}, got {pw!r:.80}")
    return packed


def _finite_weights(packed, encoder, encoder_v, decoder):
    """Require finite weights, except those whose given packed form stands in for them: no
    product reads those (``quantize_layer_weights`` checked them when it made the packed form,
    and a full pass over the master weights cost 3 ms of a 70 ms BDH bench step)."""
    for w, name in ((encoder, "encoder"), (encoder_v, "encoder_v"), (decoder, "decoder")):
        if packed is None or name not in packed:
            _validate.all_finite(w, name)


# -- the op ---------------------------------------------------------------------------------------

def lowrank_residual_forward(current: Array, encoder: Array, encoder_v: Array, decoder: Array, *,
                             attention: str = "causal_linear", lengths: Sequence[int] | None = None,
                             plan: LowBitPlan | None = None,
                             saved: str | SavedConfig | None = None, relu_threshold: float = 0.0,
                             dropout: float = 0.0, seed: int = 0, row_offset: int = 0,
                             packed: dict | None = None, latent_pattern: BlockPattern | None = None
                             ) -> tuple[Array, LowrankResidualCtx]:
    """Forward of the BDH low-rank residual layer, keeping what the backward needs.

    Precision: computed in float32 whatever the inputs' dtype (float64 inputs are rounded to
    float32); ``next`` is returned in the dtype NumPy would give (float64 if any input is).

    Args:
        current: [B, T, D] float32 or float64.
        encoder, encoder_v: [H, D, N] float32 or float64.
        decoder: [H * N, D] float32 or float64.
        attention: ``"causal_linear"`` (BDH's: rotary positions, strictly causal, no softmax) or
            ``"segmented"`` (causal softmax through ``lowbit.segmented_attention``, scale
            ``1 / sqrt(N)``).
        lengths: segment lengths summing to T, applied to every batch row (None: one segment).
        plan: a ``LowBitPlan`` (None: full precision).
        saved: saved-activation policy (``"fp32"``, ``"int8"``, ``"int4"``, ``"int2"``,
            ``"sparse"`` or a ``SavedConfig``); None keeps every saved tensor exact.
        relu_threshold: subtracted before both ReLUs (sets the neuron density).
        dropout: inverted-dropout probability on ``y_neuron``, in [0, 1).
        seed: dropout seed (the mask is a hash of (seed, element index); nothing is saved);
            must be 0 with ``dropout=0``.
        row_offset: global index of batch row 0: row ``b`` hashes its dropout mask as row
            ``row_offset + b`` of a larger batch (data-parallel ranks holding a slice of one
            global batch draw the masks of the one-process run); must be 0 with ``dropout=0``.
        packed: the weights' quantized forms under ``plan``, from ``quantize_layer_weights``
            (None: quantized here). A caller that applies one set of weights several times
            (BDH's levels) quantizes them once; they must be those of these very weights.
        latent_pattern: a ``lowbit.BlockPattern`` (None: every latent neuron): the neurons of
            inactive blocks are exactly zero in ``x_neuron``, ``y_gate`` and ``y_neuron``
            whatever the threshold, and get no gradient (their ``encoder``/``encoder_v``
            columns and ``decoder`` rows stay zero); they are neither computed nor saved.

    Returns:
        ``(next, ctx)``: next [B, T, D] of ``result_type`` of the inputs and a
        ``LowrankResidualCtx``.

    Raises:
        TypeError, ValueError: bad arguments (the message names the argument).
    """
    return _forward(current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
                    relu_threshold, dropout, seed, row_offset, packed, latent_pattern, keep=True)


def lowrank_residual(current: Array, encoder: Array, encoder_v: Array, decoder: Array, *,
                     attention: str = "causal_linear", lengths: Sequence[int] | None = None,
                     plan: LowBitPlan | None = None, relu_threshold: float = 0.0,
                     dropout: float = 0.0, seed: int = 0, row_offset: int = 0,
                     packed: dict | None = None,
                     latent_pattern: BlockPattern | None = None) -> Array:
    """Inference form of ``lowrank_residual_forward``: returns ``next`` and saves nothing."""
    return _forward(current, encoder, encoder_v, decoder, attention, lengths, plan, None,
                    relu_threshold, dropout, seed, row_offset, packed, latent_pattern,
                    keep=False)[0]


def _forward(current, encoder, encoder_v, decoder, attention, lengths, plan, saved,
             relu_threshold, dropout, seed, row_offset, packed, pattern, keep):
    (current, encoder, encoder_v, decoder, attention, lengths, plan, saved, relu_threshold,
     dropout, seed, row_offset) = _check(current, encoder, encoder_v, decoder, attention,
                                         lengths, plan, saved, relu_threshold, dropout, seed,
                                         row_offset)
    packed = _packed(packed, plan, encoder, decoder)
    _finite_weights(packed, encoder, encoder_v, decoder)
    latent = _latent_pattern(pattern, encoder.shape[0], encoder.shape[2], attention)
    name, impl = _dispatch.resolve(OP, current, encoder, encoder_v, decoder)
    dtypes = tuple(a.dtype for a in (current, encoder, encoder_v, decoder))
    dtype = np.result_type(*dtypes)
    f32 = lambda a: a.astype(np.float32, copy=False)  # noqa: E731
    current, encoder, encoder_v, decoder = map(f32, (current, encoder, encoder_v, decoder))
    # Numba's parallel kernels take the cores between the BLAS calls of the projections.
    with _backend.single_threaded_blas(name == "numba"):
        out, fields = _layer.forward(impl, current, encoder, encoder_v, decoder, attention,
                                     lengths, plan, saved, relu_threshold, dropout, seed,
                                     row_offset, keep, packed, latent)
    out = out.astype(dtype, copy=False)
    if not keep:
        return out, None
    ctx = LowrankResidualCtx(
        shape=(*current.shape, encoder.shape[0], encoder.shape[2]), attention=attention,
        lengths=lengths, plan=plan, relu_threshold=relu_threshold, dropout=dropout, seed=seed,
        row_offset=row_offset, encoder=encoder, encoder_v=encoder_v, decoder=decoder, **fields,
        dtype=dtype, dtypes=dtypes)
    return out, ctx


def lowrank_residual_backward(dnext: Array, ctx: LowrankResidualCtx, *,
                              accumulate: tuple[Array, Array, Array] | None = None
                              ) -> tuple[Array, Array, Array, Array]:
    """Backward of ``lowrank_residual_forward``.

    Precision: computed in float32 like the forward; the gradients are returned in the dtypes
    of the inputs they belong to.

    Args:
        dnext: [B, T, D] gradient of ``next``, of its dtype.
        ctx: the ``LowrankResidualCtx`` of the forward (read, never changed).
        accumulate: optional ``(dencoder, dencoder_v, ddecoder)`` arrays shaped like the weights,
            each of its weight's dtype; the weight gradients are added into them in place and
            they are returned (BDH applies one layer several times with shared weights: this
            sums the gradients of every application without a second set of gradient buffers).
            None (default): fresh arrays.

    Returns:
        ``(dcurrent, dencoder, dencoder_v, ddecoder)``: shaped like the inputs, each of its
        input's dtype. Quantizers pass gradients straight through (``dx = dy @ Qw(w).T``,
        ``dw = Qa(x).T @ dy``).

    Raises:
        TypeError: ``ctx`` not a ``LowrankResidualCtx``; ``dnext`` not an array of the forward
            output's dtype; ``accumulate`` not a triple.
        ValueError: a shape that disagrees, a non-finite ``dnext``, ``accumulate`` buffers of
            another shape or dtype.
    """
    if not isinstance(ctx, LowrankResidualCtx):
        raise TypeError(f"ctx must be the LowrankResidualCtx of lowrank_residual_forward, got "
                        f"{type(ctx).__name__}")
    dnext = _validate.as_array(dnext, "dnext")
    _validate.grad_dtype(dnext, ctx.dtype, "dnext")
    B, T, D, H, N = ctx.shape
    _validate.shape(dnext, (B, T, D), "dnext", "the forward output's")
    _validate.all_finite(dnext, "dnext")
    name, impl = _dispatch.resolve(OP, dnext, ctx.encoder)
    xp = _backend.array_module(dnext)
    held = _accumulators(accumulate, (H, D, N), (H * N, D), ctx.dtypes[1:], xp)
    # The kernels add float32 gradients: into the caller's buffers when those are float32.
    grads = tuple(g if g.dtype == np.float32 else xp.zeros(g.shape, np.float32) for g in held)
    with _backend.single_threaded_blas(name == "numba"):
        dcurrent, *dweights = _layer_backward.backward(impl, dnext.astype(np.float32, copy=False),
                                                       ctx, grads)
    for buffer, g in zip(held, dweights):
        if buffer is not g:
            buffer += g
    return (dcurrent.astype(ctx.dtypes[0], copy=False), *held)


def _accumulators(accumulate, enc_shape, dec_shape, dtypes, xp):
    """Zeroed gradient buffers of the weights' dtypes, or the caller's ``accumulate`` arrays
    after checking them."""
    shapes = (enc_shape, enc_shape, dec_shape)
    if accumulate is None:
        return tuple(xp.zeros(shape, dtype) for shape, dtype in zip(shapes, dtypes))
    if not isinstance(accumulate, (tuple, list)) or len(accumulate) != 3:
        raise TypeError("accumulate must be a tuple (dencoder, dencoder_v, ddecoder) or None")
    for name, a, shape, dtype in zip(("dencoder", "dencoder_v", "ddecoder"), accumulate, shapes,
                                     dtypes):
        _validate.as_array(a, f"accumulate {name}")
        if tuple(a.shape) != shape or a.dtype != dtype:
            raise ValueError(f"accumulate {name} must be {np.dtype(dtype).name} of shape "
                             f"{shape} (its weight's dtype), got {a.dtype} {tuple(a.shape)}")
    return tuple(accumulate)
