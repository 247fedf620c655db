"""Segmented (variable-length) attention over packed tokens, with grouped key/value heads.

Each contiguous segment of the token axis is an independent attention problem (FlashAttention's
varlen layout); the forward keeps the logsumexp per query row so the backward recomputes the
probabilities block by block and never holds a ``T x T`` matrix.

Backends: ``_numpy.py`` (vectorized, query-chunked), ``_numba.py`` (flash-style blocks with BLAS),
``_cuda.py`` (launchers for ``cuda/segmented_attention.cu``, backends cuda and cudasim).
Reference: ``reference/segmented_attention.py``; tests: ``tests/test_segmented_attention.py``;
benchmark: ``bench/attention.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ... import _backend, _ctx, _dispatch, _validate
from ..._typing import Array
from ..saved_activation import SavedConfig, save, saved_policy


@dataclasses.dataclass(frozen=True)
class SegmentedAttentionCtx(_ctx.Ctx):
    """What ``segmented_attention_backward`` needs.

    Attributes:
        q, k, v, out: saved ``[T, H, D]``, ``[T, Hkv, D]``, ``[T, Hkv, Dv]``, ``[T, H, Dv]``.
        lse: saved ``[H, T]`` logsumexp of each query row's scaled scores (input dtype).
        offsets: ``[S + 1]`` int64 host array, segment ``s`` covers tokens
            ``offsets[s]:offsets[s + 1]``.
        scale: the score scale used by the forward.
        causal: whether the forward was causal.
    """

    q: _ctx.Saved
    k: _ctx.Saved
    v: _ctx.Saved
    out: _ctx.Saved
    lse: _ctx.Saved
    offsets: np.ndarray
    scale: float
    causal: bool


def _check_inputs(q, k, v, lengths, scale, causal):
    q = _validate.as_array(q, "q")
    k = _validate.as_array(k, "k")
    v = _validate.as_array(v, "v")
    _backend.array_kind(q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have rank 3 [T, heads, dim], got shape {x.shape}")
        if min(x.shape) < 1:
            raise ValueError(f"{name} must have positive dimensions, got shape {x.shape}")
        _validate.floating(x, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    tokens, heads, dim = q.shape
    if k.shape[0] != tokens or v.shape[0] != tokens:
        raise ValueError(f"k and v must have the token count of q ({tokens}), got k {k.shape[0]}, "
                         f"v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have equal head counts, got k {k.shape[1]}, "
                         f"v {v.shape[1]}")
    if heads % k.shape[1]:
        raise ValueError(f"k head count {k.shape[1]} must divide the q head count {heads}")
    if k.shape[2] != dim:
        raise ValueError(f"k must have the key dimension of q ({dim}), got {k.shape[2]}")
    offsets = _validate.offsets(lengths, tokens)
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    else:
        scale = _validate.finite_scalar(scale, "scale")
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return q, k, v, offsets, scale, bool(causal)


def _contiguous(xp, *arrays):
    return tuple(xp.ascontiguousarray(a) for a in arrays)


def segmented_attention_forward(q: Array, k: Array, v: Array, lengths: Sequence[int] | Array, *,
                                scale: float | None = None, causal: bool = False,
                                saved: str | SavedConfig | None = None
                                ) -> tuple[Array, SegmentedAttentionCtx]:
    """Attention inside each segment of packed tokens, keeping what the backward needs.

    Computed in the inputs' dtype (float32 or float64).

    Args:
        q: [T, H, D] float32 or float64 (numpy or cupy).
        k: [T, Hkv, D], same dtype; ``Hkv`` divides ``H``, query head ``h`` reads key/value
            head ``h // (H // Hkv)``.
        v: [T, Hkv, Dv], same dtype.
        lengths: 1-D host sequence or numpy array of positive integers summing to ``T``: the
            contiguous segments in token order.
        scale: score scale, finite and positive; default ``1 / sqrt(D)``.
        causal: a query sees only keys at or before its own position within its segment.
        saved: saved-activation policy for q, k, v and out (``None``: exact; a packed policy
            is unpacked to the inputs' dtype in the backward); the logsumexp is kept exact.

    Returns:
        ``(out, ctx)``: out [T, H, Dv] of the input dtype; ``ctx`` a
        ``SegmentedAttentionCtx`` whose ``lse`` is the [H, T] logsumexp (input dtype).

    Raises:
        TypeError: non-arrays, non-float or unequal dtypes, mixed numpy/cupy, bad ``lengths``
            type, non-bool ``causal``.
        ValueError: bad ranks or shapes, bad ``lengths`` values, non-positive ``scale``.
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    q, k, v, offsets, scale, causal = _check_inputs(q, k, v, lengths, scale, causal)
    xp = _backend.array_module(q)
    _, impl = _dispatch.resolve("segmented_attention", q, k, v)
    q, k, v = _contiguous(xp, q, k, v)
    out, lse = impl.forward(q, k, v, offsets, scale, causal)
    ctx = SegmentedAttentionCtx(
        q=save(q, saved), k=save(k, saved), v=save(v, saved),
        # The logsumexp stays exact whatever the policy: the backward exponentiates against it,
        # so a quantization step would scale every recomputed probability.
        out=save(out, saved), lse=save(lse, None), offsets=offsets, scale=scale,
        causal=causal)
    return out, ctx


def segmented_attention(q: Array, k: Array, v: Array, lengths: Sequence[int] | Array, *,
                        scale: float | None = None, causal: bool = False) -> Array:
    """Inference form of ``segmented_attention_forward``: returns ``out`` [T, H, Dv] only."""
    q, k, v, offsets, scale, causal = _check_inputs(q, k, v, lengths, scale, causal)
    xp = _backend.array_module(q)
    _, impl = _dispatch.resolve("segmented_attention", q, k, v)
    q, k, v = _contiguous(xp, q, k, v)
    return impl.forward(q, k, v, offsets, scale, causal)[0]


def segmented_attention_backward(dout: Array, ctx: SegmentedAttentionCtx
                                 ) -> tuple[Array, Array, Array]:
    """Gradients of ``sum(dout * out)`` for the forward recorded in ``ctx``.

    Args:
        dout: [T, H, Dv], the dtype and array module of the forward's inputs.
        ctx: the ``SegmentedAttentionCtx`` returned by ``segmented_attention_forward``.

    Returns:
        ``(dq, dk, dv)`` shaped like q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv], of the forward's
        dtype (computed in it); ``dk`` and ``dv`` sum over the query heads of each group.
        Bitwise deterministic.

    Raises:
        TypeError: ``ctx`` is not a ``SegmentedAttentionCtx``, ``dout`` not an array or of
            another dtype.
        ValueError: ``dout`` shaped unlike the forward's output.
    """
    if not isinstance(ctx, SegmentedAttentionCtx):
        raise TypeError(f"ctx must be a SegmentedAttentionCtx, got {type(ctx).__name__}")
    dout = _validate.as_array(dout, "dout")
    lse = ctx.lse.unpack()  # exact: of the forward's dtype
    _validate.shape(dout, ctx.out.shape, "dout", "the forward output's")
    _validate.grad_dtype(dout, lse.dtype, "dout")
    xp = _backend.array_module(dout, lse)
    # A packed policy unpacks float32; the gradients are computed in the forward's dtype.
    q, k, v, out = (xp.ascontiguousarray(s.unpack(), dtype=lse.dtype)
                    for s in (ctx.q, ctx.k, ctx.v, ctx.out))
    _, impl = _dispatch.resolve("segmented_attention", dout, q)
    dout, lse = _contiguous(xp, dout, lse)
    return impl.backward(dout, q, k, v, out, lse, ctx.offsets, ctx.scale, ctx.causal)
