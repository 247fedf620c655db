"""Segmented (variable-length) attention over packed tokens, with grouped key/value heads.

Each contiguous segment of the token axis is an independent attention problem (FlashAttention's
varlen layout); the forward keeps the logsumexp per query row so the backward recomputes the
probabilities block by block and never holds a ``T x T`` matrix. Keys may be cut into segments
of their own (``k_lengths``, FlashAttention's ``cu_seqlens_k``: decoding against a KV cache,
chunked prefill), the causal mask then aligned bottom-right.

Backends: ``_numpy.py`` (vectorized, query-chunked), ``_numba.py`` (flash-style blocks with BLAS),
``_cuda.py`` (launchers for ``cuda/segmented_attention.cu``, backends cuda and cudasim).
Reference: ``reference/segmented_attention.py``; tests: ``tests/test_segmented_attention.py`` and
``tests/test_segmented_attention_klen.py`` (``k_lengths``); benchmark: ``bench/attention.py``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

from ... import _backend, _ctx, _dispatch, _validate
from ..._typing import Array
from ..saved_activation import SavedConfig, save, saved_policy


@dataclasses.dataclass(frozen=True)
class SegmentedAttentionCtx(_ctx.Ctx):
    """What ``segmented_attention_backward`` needs.

    Attributes:
        q, k, v, out: saved ``[Tq, H, D]``, ``[Tk, Hkv, D]``, ``[Tk, Hkv, Dv]``, ``[Tq, H, Dv]``.
        lse: saved ``[H, Tq]`` logsumexp of each query row's scaled scores (input dtype; -inf
            for a row that sees no key).
        offsets: ``[S + 1]`` int64 host array, segment ``s`` covers queries
            ``offsets[s]:offsets[s + 1]``.
        k_offsets: ``[S + 1]`` int64 host array, segment ``s`` covers keys
            ``k_offsets[s]:k_offsets[s + 1]`` (equal to ``offsets`` without ``k_lengths``).
        scale: the score scale used by the forward.
        causal: whether the forward was causal.
    """

    q: _ctx.Saved
    k: _ctx.Saved
    v: _ctx.Saved
    out: _ctx.Saved
    lse: _ctx.Saved
    offsets: np.ndarray
    k_offsets: np.ndarray
    scale: float
    causal: bool


def _segment_offsets(lengths, tokens, name, what):
    """The int64 prefix table of ``lengths`` as ``_validate.offsets`` builds it, with empty
    segments allowed; ``what`` names the count they must sum to."""
    if _backend.is_cupy_array(lengths) or isinstance(lengths, (str, bytes)) or not hasattr(
            lengths, "__len__"):
        return _validate.offsets(lengths, tokens, name)  # raises its TypeError
    try:
        arr = lengths if isinstance(lengths, np.ndarray) else np.asarray(lengths, dtype=object)
    except (TypeError, ValueError):
        return _validate.offsets(lengths, tokens, name)
    values = arr.tolist() if arr.ndim == 1 and arr.dtype.kind in "iuO" else None
    if not values or not all(isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))
                             for x in values):
        return _validate.offsets(lengths, tokens, name)  # raises its rank or type error
    # Python integers: the running total cannot wrap, whatever the caller's integer width.
    total, table = 0, [0]
    for i, length in enumerate(values):
        if length < 0:
            raise ValueError(f"{name} must all be non-negative, got {name}[{i}] = {length}")
        total += int(length)
        if total > tokens:
            raise ValueError(f"{name} must sum to {what} {tokens}; the running total passes it "
                             f"at {name}[{i}] ({total})")
        table.append(total)
    if total != tokens:
        raise ValueError(f"{name} must sum to {what} {tokens}, got {total}")
    return np.asarray(table, dtype=np.int64)


def _check_inputs(q, k, v, lengths, k_lengths, scale, causal):
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
    if k_lengths is None and (k.shape[0] != tokens or v.shape[0] != tokens):
        raise ValueError(f"k and v must have the token count of q ({tokens}), got k {k.shape[0]}, "
                         f"v {v.shape[0]}; pass k_lengths for keys of their own segments")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must share their token count, got k {k.shape[0]}, "
                         f"v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have equal head counts, got k {k.shape[1]}, "
                         f"v {v.shape[1]}")
    if heads % k.shape[1]:
        raise ValueError(f"k head count {k.shape[1]} must divide the q head count {heads}")
    if k.shape[2] != dim:
        raise ValueError(f"k must have the key dimension of q ({dim}), got {k.shape[2]}")
    if k_lengths is None:
        offsets = k_offsets = _validate.offsets(lengths, tokens)
    else:
        offsets = _segment_offsets(lengths, tokens, "lengths", "the token count of q")
        k_offsets = _segment_offsets(k_lengths, k.shape[0], "k_lengths",
                                     "the token count of k and v")
        if k_offsets.size != offsets.size:
            raise ValueError(f"k_lengths must have one entry per segment of lengths "
                             f"({offsets.size - 1}), got {k_offsets.size - 1}")
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    else:
        scale = _validate.finite_scalar(scale, "scale")
        if scale <= 0:
            raise ValueError(f"scale must be positive, got {scale}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return q, k, v, offsets, k_offsets, scale, bool(causal)


def _contiguous(xp, *arrays):
    return tuple(xp.ascontiguousarray(a) for a in arrays)


def segmented_attention_forward(q: Array, k: Array, v: Array, lengths: Sequence[int] | Array, *,
                                k_lengths: Sequence[int] | Array | None = None,
                                scale: float | None = None, causal: bool = False,
                                saved: str | SavedConfig | None = None
                                ) -> tuple[Array, SegmentedAttentionCtx]:
    """Attention inside each segment of packed tokens, keeping what the backward needs.

    Computed in the inputs' dtype (float32 or float64). Segment ``s``'s queries attend only to
    segment ``s``'s keys. With ``k_lengths`` (FlashAttention's ``cu_seqlens_k``) the keys have
    segments of their own, e.g. decoding: one query per sequence against its KV cache.

    Args:
        q: [Tq, H, D] float32 or float64 (numpy or cupy).
        k: [Tk, Hkv, D], same dtype; ``Hkv`` divides ``H``, query head ``h`` reads key/value
            head ``h // (H // Hkv)``. ``Tk = Tq`` unless ``k_lengths`` is given.
        v: [Tk, Hkv, Dv], same dtype.
        lengths: 1-D host sequence or numpy array of integers summing to ``Tq``: the contiguous
            query segments in token order; positive, or non-negative when ``k_lengths`` is
            given (an empty segment is allowed then, as FlashAttention allows one).
        k_lengths: ``None`` (the keys' segments are ``lengths``), or 1-D host integers, one per
            segment of ``lengths``, non-negative, summing to ``Tk``: the key segments.
        scale: score scale, finite and positive; default ``1 / sqrt(D)``.
        causal: query ``i`` (0-based in its segment of ``Lq`` queries and ``Lk`` keys) sees only
            keys ``j <= i + Lk - Lq`` (aligned bottom-right, as FlashAttention 2.1+ does; with
            ``Lq = Lk`` a query sees the keys at or before its own position). A query that sees
            no key (``Lq > Lk``, or ``Lk = 0``) outputs zeros, gets ``lse = -inf`` and receives
            and passes on zero gradient.
        saved: saved-activation policy for q, k, v and out (``None``: exact; a packed policy
            is unpacked to the inputs' dtype in the backward); the logsumexp is kept exact.

    Returns:
        ``(out, ctx)``: out [Tq, H, Dv] of the input dtype; ``ctx`` a
        ``SegmentedAttentionCtx`` whose ``lse`` is the [H, Tq] logsumexp (input dtype).

    Raises:
        TypeError: non-arrays, non-float or unequal dtypes, mixed numpy/cupy, bad ``lengths``
            or ``k_lengths`` type, non-bool ``causal``.
        ValueError: bad ranks or shapes, bad ``lengths`` or ``k_lengths`` values (a count of
            segments unlike ``lengths``', a sum other than ``Tk``), non-positive ``scale``.
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    q, k, v, offsets, k_offsets, scale, causal = _check_inputs(q, k, v, lengths, k_lengths, scale,
                                                               causal)
    xp = _backend.array_module(q)
    _, impl = _dispatch.resolve("segmented_attention", q, k, v)
    q, k, v = _contiguous(xp, q, k, v)
    out, lse = impl.forward(q, k, v, offsets, k_offsets, scale, causal)
    ctx = SegmentedAttentionCtx(
        q=save(q, saved), k=save(k, saved), v=save(v, saved),
        # The logsumexp stays exact whatever the policy: the backward exponentiates against it,
        # so a quantization step would scale every recomputed probability.
        out=save(out, saved), lse=save(lse, None), offsets=offsets, k_offsets=k_offsets,
        scale=scale, causal=causal)
    return out, ctx


def segmented_attention(q: Array, k: Array, v: Array, lengths: Sequence[int] | Array, *,
                        k_lengths: Sequence[int] | Array | None = None,
                        scale: float | None = None, causal: bool = False) -> Array:
    """Inference form of ``segmented_attention_forward``: returns ``out`` [Tq, H, Dv] only.

    The arguments and errors are those of ``segmented_attention_forward`` (without ``saved``).
    A decode step is ``segmented_attention(q, k_cache, v_cache, [1] * S, k_lengths=cache_lengths,
    causal=True)``: each sequence's one query sees its whole cache.
    """
    q, k, v, offsets, k_offsets, scale, causal = _check_inputs(q, k, v, lengths, k_lengths, scale,
                                                               causal)
    xp = _backend.array_module(q)
    _, impl = _dispatch.resolve("segmented_attention", q, k, v)
    q, k, v = _contiguous(xp, q, k, v)
    return impl.forward(q, k, v, offsets, k_offsets, scale, causal)[0]


def segmented_attention_backward(dout: Array, ctx: SegmentedAttentionCtx
                                 ) -> tuple[Array, Array, Array]:
    """Gradients of ``sum(dout * out)`` for the forward recorded in ``ctx``.

    Args:
        dout: [Tq, H, Dv], the dtype and array module of the forward's inputs.
        ctx: the ``SegmentedAttentionCtx`` returned by ``segmented_attention_forward``.

    Returns:
        ``(dq, dk, dv)`` shaped like q [Tq, H, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], of the
        forward's dtype (computed in it); ``dk`` and ``dv`` sum over the query heads of each
        group (zero for a key no query sees). Bitwise deterministic.

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
    return impl.backward(dout, q, k, v, out, lse, ctx.offsets, ctx.k_offsets, ctx.scale,
                         ctx.causal)
