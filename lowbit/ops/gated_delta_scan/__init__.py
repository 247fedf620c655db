"""The gated delta rule: ``gated_delta_scan`` and its training pair with a hand-written backward.

Backends: ``_numpy.py`` (loop over T, vectorized over batch and head), ``_numba.py`` (parallel
over batch x head x slices of V), ``_cuda.py`` (launchers for ``cuda/gated_delta_scan.cu``).
The chunked (WY / UT) form of the same function, matrix products within blocks of 64 tokens,
is chosen by each backend's rule: the numpy backend runs it for one decay per head and T >= 4
(``_numpy.use_chunked``; forward 1.7-1.9x, backward 2.2-4.9x its token loop); the numba backend
for float32 with K = V = 64 on AVX-512, one decay per head and T >= 128 (``_numba.use_chunked``:
``_numba_chunked.py``, its products on the register tiles; forward 1.5-2.1x, backward 1.2-1.4x
the token-by-token kernels at B = 4, T = 2048, H = 8 on a 2-core AMD EPYC; ``_numba.py`` has the
figures at other shapes); elsewhere the token-by-token kernels run.
Reference: ``reference/gated_delta_scan.py``; tests: ``tests/test_gated_delta_scan.py`` and
``tests/test_gated_delta_scan_chunked.py``; benchmark: ``bench/scan.py``.

For every batch, head and token t, with the state S of shape [K, V] (always carried in the
input dtype, float32 or float64):
    S[i, :] *= exp(log_decay_t[i]);  memory = S.T @ k_t;  delta = beta_t * (v_t - memory);
    S += outer(k_t, delta);  out_t = S.T @ q_t.

Memory: the forward keeps the state entering every chunk of ``chunk_size`` tokens; the backward
sweeps the chunks in reverse and recomputes the states inside each chunk from its checkpoint, so
the saved state bytes grow as ``T / chunk_size``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ... import _backend, _ctx, _dispatch, _validate
from ..._typing import Array
from ..saved_activation import SavedConfig, save, saved_policy

_OP = "gated_delta_scan"


@dataclasses.dataclass(frozen=True)
class GatedDeltaScanCtx(_ctx.Ctx):
    """What ``gated_delta_scan_backward`` needs.

    Attributes:
        q, k, v, log_decay, beta: the saved inputs (``log_decay`` as [B, T, H, 1] or
            [B, T, H, K]).
        checkpoints: [B, H, ceil(T / chunk_size), K, V], the state entering each chunk (exact).
        chunk_size: tokens per checkpoint.
        per_key_decay: ``log_decay`` was given as [B, T, H, K].
        has_initial_state: an ``initial_state`` was given (its gradient is returned).
        dtype: the forward's dtype (of ``out`` and the state; ``dout`` and ``dstate`` must
            have it).
    """

    q: _ctx.Saved
    k: _ctx.Saved
    v: _ctx.Saved
    log_decay: _ctx.Saved
    beta: _ctx.Saved
    checkpoints: _ctx.Saved
    chunk_size: int
    per_key_decay: bool
    has_initial_state: bool
    dtype: np.dtype


def _prepare(q, k, v, log_decay, beta, initial_state, chunk_size):
    """Validate every argument (before any kernel runs); return contiguous working arrays."""
    q = _validate.floating(_validate.as_array(q, "q"), "q")
    arrays = {"q": q}
    for name, a in (("k", k), ("v", v), ("log_decay", log_decay), ("beta", beta)):
        arrays[name] = _validate.floating(_validate.as_array(a, name), name)
    if initial_state is not None:
        arrays["initial_state"] = _validate.floating(
            _validate.as_array(initial_state, "initial_state"), "initial_state")
    _backend.array_kind(*arrays.values())
    chunk_size = _validate.integer(chunk_size, "chunk_size", minimum=1)
    for name, a in arrays.items():
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {a.dtype}")
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 [B, T, H, K], got shape {q.shape}")
    nb, nt, nh, nk = q.shape
    if k.shape != q.shape:
        raise _validate.shape_error("k", (nb, nt, nh, nk), k.shape)
    if v.ndim != 4 or v.shape[:3] != (nb, nt, nh):
        raise _validate.shape_error("v", (nb, nt, nh, "V"), v.shape)
    nv = v.shape[3]
    if log_decay.shape not in ((nb, nt, nh), (nb, nt, nh, nk)):
        raise ValueError(f"log_decay must have shape {(nb, nt, nh)} or {(nb, nt, nh, nk)}, "
                         f"got {tuple(log_decay.shape)}")
    _validate.shape(beta, (nb, nt, nh), "beta")
    if initial_state is not None:
        _validate.shape(initial_state, (nb, nh, nk, nv), "initial_state")
        _validate.all_finite(initial_state, "initial_state")
    xp = _backend.array_module(q)
    per_key = log_decay.ndim == 4
    work = [xp.ascontiguousarray(a) for a in (q, k, v)]
    work.append(xp.ascontiguousarray(log_decay if per_key else log_decay[..., None]))
    work.append(xp.ascontiguousarray(beta))
    state = (xp.zeros((nb, nh, nk, nv), q.dtype) if initial_state is None
             else xp.ascontiguousarray(initial_state))
    return work, state, chunk_size, per_key


def gated_delta_scan(q: Array, k: Array, v: Array, log_decay: Array, beta: Array, *,
                     initial_state: Array | None = None) -> tuple[Array, Array]:
    """Run the gated delta rule over T tokens (inference: nothing is saved).

    Computed in the inputs' dtype (float32 or float64).

    Args:
        q, k: [B, T, H, K] float32 or float64 (every input shares the dtype of ``q``).
        v: [B, T, H, V].
        log_decay: [B, T, H] (one decay per head and token) or [B, T, H, K] (one per key row).
        beta: [B, T, H] write strength.
        initial_state: [B, H, K, V], finite, or None (zeros).

    Returns:
        out: [B, T, H, V]; state: [B, H, K, V], the state after the last token; both of the
        inputs' dtype.

    Raises:
        TypeError: a non-array, a non-float dtype or dtypes that differ from ``q``'s.
        ValueError: a rank or shape that disagrees, a non-finite ``initial_state``.
    """
    work, state, _, _ = _prepare(q, k, v, log_decay, beta, initial_state, 1)
    _, impl = _dispatch.resolve(_OP, *work)
    out, final, _ = impl.forward(*work, state, 1, False)
    return out, final


def gated_delta_scan_forward(q: Array, k: Array, v: Array, log_decay: Array, beta: Array, *,
                             initial_state: Array | None = None, chunk_size: int = 64,
                             saved: str | SavedConfig | None = None
                             ) -> tuple[Array, Array, GatedDeltaScanCtx]:
    """``gated_delta_scan`` that also returns the ctx of ``gated_delta_scan_backward``.

    Args:
        q, k, v, log_decay, beta, initial_state: as ``gated_delta_scan``.
        chunk_size: tokens between state checkpoints (positive int).
        saved: saved-activation policy for the inputs (``None`` keeps them exact; a packed
            policy is unpacked to the inputs' dtype in the backward).

    Returns:
        out [B, T, H, V], state [B, H, K, V], ctx (``GatedDeltaScanCtx``).
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    work, state, chunk_size, per_key = _prepare(q, k, v, log_decay, beta, initial_state,
                                                chunk_size)
    _, impl = _dispatch.resolve(_OP, *work)
    out, final, checkpoints = impl.forward(*work, state, chunk_size, True)
    q_s, k_s, v_s, decay_s, beta_s = (save(a, saved) for a in work)
    ctx = GatedDeltaScanCtx(
        q=q_s, k=k_s, v=v_s, log_decay=decay_s, beta=beta_s,
        checkpoints=save(checkpoints, None),
        chunk_size=chunk_size,
        per_key_decay=per_key,
        has_initial_state=initial_state is not None,
        dtype=out.dtype,
    )
    return out, final, ctx


def gated_delta_scan_backward(dout: Array, dstate: Array | None, ctx: GatedDeltaScanCtx
                              ) -> tuple[Array, Array, Array, Array, Array, Array | None]:
    """Gradients of ``gated_delta_scan_forward``'s outputs with respect to its inputs.

    Args:
        dout: [B, T, H, V] gradient of ``out``, of the forward's dtype.
        dstate: [B, H, K, V] gradient of the final state, of the forward's dtype, or None
            (zero).
        ctx: the ``GatedDeltaScanCtx`` of the forward.

    Returns:
        dq, dk [B, T, H, K]; dv [B, T, H, V]; dlog_decay (the shape ``log_decay`` had);
        dbeta [B, T, H]; dinitial_state [B, H, K, V] or None when no initial state was given;
        all of the forward's dtype (computed in it).

    Raises:
        TypeError: ``ctx`` not a ``GatedDeltaScanCtx``; ``dout`` or ``dstate`` not an array of
            the forward's dtype and array kind.
        ValueError: ``dout`` or ``dstate`` of the wrong shape.
    """
    if not isinstance(ctx, GatedDeltaScanCtx):
        raise TypeError(f"ctx must be a GatedDeltaScanCtx, got {type(ctx).__name__}")
    checkpoints = ctx.checkpoints.unpack()
    nb, nh, _, nk, nv = checkpoints.shape
    nt = ctx.q.shape[1]
    dout = _validate.as_array(dout, "dout")
    _validate.grad_dtype(dout, ctx.dtype, "dout")
    _validate.shape(dout, (nb, nt, nh, nv), "dout")
    if dstate is not None:
        dstate = _validate.as_array(dstate, "dstate")
        _validate.grad_dtype(dstate, ctx.dtype, "dstate")
        _validate.shape(dstate, (nb, nh, nk, nv), "dstate")
    _backend.array_kind(checkpoints, dout, dstate)
    xp = _backend.array_module(checkpoints)
    # A packed policy unpacks float32; the gradients are computed in the forward's dtype.
    q, k, v, log_decay, beta = (xp.ascontiguousarray(s.unpack(), dtype=ctx.dtype) for s in
                                (ctx.q, ctx.k, ctx.v, ctx.log_decay, ctx.beta))
    dout = xp.ascontiguousarray(dout)
    dstate = (xp.zeros((nb, nh, nk, nv), ctx.dtype) if dstate is None
              else xp.ascontiguousarray(dstate))
    _, impl = _dispatch.resolve(_OP, q, dout)
    dq, dk, dv, dlog, dbeta, dinit = impl.backward(
        dout, dstate, q, k, v, log_decay, beta, checkpoints, ctx.chunk_size)
    if not ctx.per_key_decay:
        dlog = dlog[..., 0]
    return dq, dk, dv, dlog, dbeta, (dinit if ctx.has_initial_state else None)
