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

from ... import _backend, _ctx, _dispatch, _validate
from ..saved_activation import save, saved_policy

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


def selective_scan(x, B, C, dt, dt_bias, A_log, D, initial_state=None, dt_floor=0.0):
    """Run the selective scan over T tokens (inference: nothing is saved).

    Args:
        x: [Bt, T, H, P] float32 or float64 (every input shares the dtype of ``x``).
        B, C: [Bt, T, H, N] input and output projections of the state.
        dt: [Bt, T, H] step before the bias and softplus.
        dt_bias, A_log, D: [H] per-head bias of dt, log of the decay rate, skip weight.
        initial_state: [Bt, H, P, N], finite, or None (zeros).
        dt_floor: finite float >= 0, the smallest step.

    Returns:
        out: [Bt, T, H, P]; state: [Bt, H, P, N], the state after the last token.

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


def selective_scan_forward(x, B, C, dt, dt_bias, A_log, D, initial_state=None, dt_floor=0.0, *,
                           chunk_size=64, saved=None):
    """``selective_scan`` that also returns the ctx of ``selective_scan_backward``.

    Args:
        as ``selective_scan``; chunk_size: tokens between state checkpoints (positive int);
        saved: saved-activation policy for x, B, C and dt (``None`` keeps them exact).

    Returns:
        out [Bt, T, H, P], state [Bt, H, P, N], ctx (``SelectiveScanCtx``).
    """
    saved = saved_policy(saved)  # first: a bad policy raises before any kernel
    work, state, dt_floor, chunk_size = _prepare(x, B, C, dt, dt_bias, A_log, D, initial_state,
                                                 dt_floor, chunk_size)
    _, impl = _dispatch.resolve(_OP, *work)
    out, final, checkpoints = impl.forward(*work, state, dt_floor, chunk_size, True)
    ctx = SelectiveScanCtx(
        *(save(a, saved) for a in work[:4]),
        *work[4:],
        checkpoints=save(checkpoints, None),
        dt_floor=dt_floor,
        chunk_size=chunk_size,
        has_initial_state=initial_state is not None,
    )
    return out, final, ctx


def selective_scan_backward(dout, dstate, ctx):
    """Gradients of ``selective_scan_forward``'s outputs with respect to its inputs.

    Args:
        dout: [Bt, T, H, P] gradient of ``out``.
        dstate: [Bt, H, P, N] gradient of the final state, or None (zero).
        ctx: the ``SelectiveScanCtx`` of the forward.

    Returns:
        dx [Bt, T, H, P]; dB, dC [Bt, T, H, N]; ddt [Bt, T, H]; ddt_bias, dA_log, dD [H];
        dinitial_state [Bt, H, P, N] or None when no initial state was given.
    """
    if not isinstance(ctx, SelectiveScanCtx):
        raise TypeError(f"ctx must be a SelectiveScanCtx, got {type(ctx).__name__}")
    x, B, C, dt = (s.unpack() for s in (ctx.x, ctx.B, ctx.C, ctx.dt))
    checkpoints = ctx.checkpoints.unpack()
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    dout = _validate.floating(_validate.as_array(dout, "dout"), "dout")
    _validate.shape(dout, (nb, nt, nh, npp), "dout")
    if dstate is not None:
        dstate = _validate.floating(_validate.as_array(dstate, "dstate"), "dstate")
        _validate.shape(dstate, (nb, nh, npp, nn), "dstate")
    _backend.array_kind(x, dout, dstate)
    xp = _backend.array_module(x)
    dout = xp.ascontiguousarray(dout, dtype=x.dtype)
    dstate = (xp.zeros((nb, nh, npp, nn), x.dtype) if dstate is None
              else xp.ascontiguousarray(dstate, dtype=x.dtype))
    _, impl = _dispatch.resolve(_OP, x, dout)
    grads = impl.backward(dout, dstate, x, B, C, dt, ctx.dt_bias, ctx.A_log, ctx.D, checkpoints,
                          ctx.dt_floor, ctx.chunk_size)
    return (*grads[:7], grads[7] if ctx.has_initial_state else None)
