"""The selective state-space scan: ``selective_scan`` and its training pair with a hand-written
backward.

Backends: ``_numpy.py`` (loop over T, vectorized over batch and head), ``_numba.py`` (parallel
over batch x head), ``_cuda.py`` (launchers for ``cuda/selective_scan.cu``). Reference:
``reference/selective_scan.py``; tests: ``tests/test_selective_scan.py``; benchmark:
``bench/scan.py``.

For every batch, head and token, with the state S of shape [P, N] (carried in the input dtype):
    delta = max(softplus(dt + dt_bias[h]), dt_floor);  a = exp(-exp(A_log[h]) * delta);
    S[p, n] = a * S[p, n] + delta * B[n] * x[p];  out[p] = sum_n S[p, n] * C[n] + D[h] * x[p].
The gradient through ``max(., dt_floor)`` is zero where the floor is active (softplus below it).

Memory: the forward keeps the state entering every chunk of ``chunk_size`` tokens; the backward
sweeps the chunks in reverse and recomputes the states inside each chunk from its checkpoint.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ... import _backend, _ctx, _dispatch, _validate
from ..._typing import Array
from ..saved_activation import SavedConfig, save, saved_policy

_OP = "selective_scan"


@dataclasses.dataclass(frozen=True)
class SelectiveScanCtx(_ctx.Ctx):
    """What ``selective_scan_backward`` needs.

    Attributes:
        x, B, C, dt: the saved activations.
        dt_bias, A_log, D: the parameters (held by the caller; not counted).
        checkpoints: [Bt, H, ceil(T / chunk_size), P, N], the state entering each chunk (exact).
        dt_floor, chunk_size: as given to the forward.
        has_initial_state: an ``initial_state`` was given (its gradient is returned).
        dtype: the forward's dtype (of ``out`` and the state; ``dout`` and ``dstate`` must
            have it).
    """

    x: _ctx.Saved
    B: _ctx.Saved
    C: _ctx.Saved
    dt: _ctx.Saved
    dt_bias: object
    A_log: object
    D: object
    checkpoints: _ctx.Saved
    dt_floor: float
    chunk_size: int
    has_initial_state: bool
    dtype: np.dtype


def _prepare(x, B, C, dt, dt_bias, A_log, D, initial_state, dt_floor, chunk_size):
    """Validate every argument (before any kernel runs); return contiguous working arrays."""
    x = _validate.floating(_validate.as_array(x, "x"), "x")
    arrays = {"x": x}
    for name, a in (("B", B), ("C", C), ("dt", dt), ("dt_bias", dt_bias), ("A_log", A_log),
                    ("D", D)):
        arrays[name] = _validate.floating(_validate.as_array(a, name), name)
    if initial_state is not None:
        arrays["initial_state"] = _validate.floating(
            _validate.as_array(initial_state, "initial_state"), "initial_state")
    _backend.array_kind(*arrays.values())
    dt_floor = _validate.finite_scalar(dt_floor, "dt_floor")
    if dt_floor < 0:
        raise ValueError(f"dt_floor must be >= 0, got {dt_floor}")
    chunk_size = _validate.integer(chunk_size, "chunk_size", minimum=1)
    for name, a in arrays.items():
        if a.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of x ({x.dtype}), got {a.dtype}")
    if x.ndim != 4:
        raise ValueError(f"x must have rank 4 [Bt, T, H, P], got shape {x.shape}")
    nb, nt, nh, npp = x.shape
    if B.ndim != 4 or B.shape[:3] != (nb, nt, nh):
        raise _validate.shape_error("B", (nb, nt, nh, "N"), B.shape)
    nn = B.shape[3]
    if C.shape != B.shape:
        raise _validate.shape_error("C", (nb, nt, nh, nn), C.shape)
    _validate.shape(dt, (nb, nt, nh), "dt")
    for name in ("dt_bias", "A_log", "D"):
        _validate.shape(arrays[name], (nh,), name)
    if initial_state is not None:
        _validate.shape(initial_state, (nb, nh, npp, nn), "initial_state")
        _validate.all_finite(initial_state, "initial_state")
    xp = _backend.array_module(x)
    work = [xp.ascontiguousarray(arrays[name])
            for name in ("x", "B", "C", "dt", "dt_bias", "A_log", "D")]
    state = (xp.zeros((nb, nh, npp, nn), x.dtype) if initial_state is None
             else xp.ascontiguousarray(initial_state))
    return work, state, dt_floor, chunk_size


def selective_scan(x: Array, B: Array, C: Array, dt: Array, dt_bias: Array, A_log: Array,
                   D: Array, *, initial_state: Array | None = None,
                   dt_floor: float = 0.0) -> tuple[Array, Array]:
    """Run the selective scan over T tokens (inference: nothing is saved).

    Computed in the inputs' dtype (float32 or float64).

    Args:
        x: [Bt, T, H, P] float32 or float64 (every input shares the dtype of ``x``).
        B, C: [Bt, T, H, N] input and output projections of the state.
        dt: [Bt, T, H] step before the bias and softplus.
        dt_bias, A_log, D: [H] per-head bias of dt, log of the decay rate, skip weight.
        initial_state: [Bt, H, P, N], finite, or None (zeros).
        dt_floor: finite float >= 0, the smallest step.

    Returns:
        out: [Bt, T, H, P]; state: [Bt, H, P, N], the state after the last token; both of the
        inputs' dtype.

    Raises:
        TypeError: a non-array, a non-float dtype or dtypes that differ from ``x``'s.
        ValueError: a rank or shape that disagrees, a bad ``dt_floor``, a non-finite
            ``initial_state``.
    """
    work, state, dt_floor, _ = _prepare(x, B, C, dt, dt_bias, A_log, D, initial_state, dt_floor,
                                        1)
    _, impl = _dispatch.resolve(_OP, *work)
    out, final, _ = impl.forward(*work, state, dt_floor, 1, False)
    return out, final


def selective_scan_forward(x: Array, B: Array, C: Array, dt: Array, dt_bias: Array,
                           A_log: Array, D: Array, *, initial_state: Array | None = None,
                           dt_floor: float = 0.0, chunk_size: int = 64,
                           saved: str | SavedConfig | None = None
                           ) -> tuple[Array, Array, SelectiveScanCtx]:
    """``selective_scan`` that also returns the ctx of ``selective_scan_backward``.

    Args:
        x, B, C, dt, dt_bias, A_log, D, initial_state, dt_floor: as ``selective_scan``.
        chunk_size: tokens between state checkpoints (positive int).
        saved: saved-activation policy for x, B, C and dt (``None`` keeps them exact; a packed
            policy is unpacked to the inputs' dtype in the backward).

    Returns:
        out [Bt, T, H, P], state [Bt, H, P, N], ctx (``SelectiveScanCtx``).
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    work, state, dt_floor, chunk_size = _prepare(x, B, C, dt, dt_bias, A_log, D, initial_state,
                                                 dt_floor, chunk_size)
    _, impl = _dispatch.resolve(_OP, *work)
    out, final, checkpoints = impl.forward(*work, state, dt_floor, chunk_size, True)
    x_s, B_s, C_s, dt_s = (save(a, saved) for a in work[:4])
    ctx = SelectiveScanCtx(
        x=x_s, B=B_s, C=C_s, dt=dt_s, dt_bias=work[4], A_log=work[5], D=work[6],
        checkpoints=save(checkpoints, None),
        dt_floor=dt_floor,
        chunk_size=chunk_size,
        has_initial_state=initial_state is not None,
        dtype=out.dtype,
    )
    return out, final, ctx


def selective_scan_backward(dout: Array, dstate: Array | None, ctx: SelectiveScanCtx
                            ) -> tuple[Array, ...]:
    """Gradients of ``selective_scan_forward``'s outputs with respect to its inputs.

    Args:
        dout: [Bt, T, H, P] gradient of ``out``, of the forward's dtype.
        dstate: [Bt, H, P, N] gradient of the final state, of the forward's dtype, or None
            (zero).
        ctx: the ``SelectiveScanCtx`` of the forward.

    Returns:
        dx [Bt, T, H, P]; dB, dC [Bt, T, H, N]; ddt [Bt, T, H]; ddt_bias, dA_log, dD [H];
        dinitial_state [Bt, H, P, N] or None when no initial state was given; all of the
        forward's dtype (computed in it).

    Raises:
        TypeError: ``ctx`` not a ``SelectiveScanCtx``; ``dout`` or ``dstate`` not an array of
            the forward's dtype and array kind.
        ValueError: ``dout`` or ``dstate`` of the wrong shape.
    """
    if not isinstance(ctx, SelectiveScanCtx):
        raise TypeError(f"ctx must be a SelectiveScanCtx, got {type(ctx).__name__}")
    checkpoints = ctx.checkpoints.unpack()
    nb, nh, _, npp, nn = checkpoints.shape
    nt = ctx.x.shape[1]
    dout = _validate.as_array(dout, "dout")
    _validate.grad_dtype(dout, ctx.dtype, "dout")
    _validate.shape(dout, (nb, nt, nh, npp), "dout")
    if dstate is not None:
        dstate = _validate.as_array(dstate, "dstate")
        _validate.grad_dtype(dstate, ctx.dtype, "dstate")
        _validate.shape(dstate, (nb, nh, npp, nn), "dstate")
    _backend.array_kind(checkpoints, dout, dstate)
    xp = _backend.array_module(checkpoints)
    # A packed policy unpacks float32; the gradients are computed in the forward's dtype.
    x, B, C, dt = (xp.ascontiguousarray(s.unpack(), dtype=ctx.dtype)
                   for s in (ctx.x, ctx.B, ctx.C, ctx.dt))
    dout = xp.ascontiguousarray(dout)
    dstate = (xp.zeros((nb, nh, npp, nn), ctx.dtype) if dstate is None
              else xp.ascontiguousarray(dstate))
    _, impl = _dispatch.resolve(_OP, x, dout)
    grads = impl.backward(dout, dstate, x, B, C, dt, ctx.dt_bias, ctx.A_log, ctx.D, checkpoints,
                          ctx.dt_floor, ctx.chunk_size)
    return (*grads[:7], grads[7] if ctx.has_initial_state else None)
