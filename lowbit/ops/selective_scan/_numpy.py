"""Selective scan in NumPy (array-generic: numpy or cupy): a loop over T, vectorized over batch
and head, with state checkpoints every ``chunk_size`` tokens and a chunked reverse sweep.

Siblings: ``_numba.py``, ``_cuda.py`` (``cuda/selective_scan.cu``); reference
``reference/selective_scan.py``. Arguments are validated and made contiguous by ``__init__``.
"""

from ... import _backend


def _softplus(xp, z):
    """log(1 + exp(z)) without overflow: softplus(100) is 100."""
    return xp.maximum(z, 0) + xp.log1p(xp.exp(-xp.abs(z)))


def _steps(xp, dt, dt_bias, A_log, dt_floor):
    """Per-token step and state decay: (z, softplus(z), delta, a), each [Bt, T, H]."""
    z = dt + dt_bias
    soft = _softplus(xp, z)
    delta = xp.maximum(soft, soft.dtype.type(dt_floor))
    a = xp.exp(-xp.exp(A_log) * delta)
    return z, soft, delta, a


def forward(x, B, C, dt, dt_bias, A_log, D, initial_state, dt_floor, chunk_size,
            keep_checkpoints):
    """Run the recurrence.

    Args:
        x: [Bt, T, H, P]; B, C: [Bt, T, H, N]; dt: [Bt, T, H]; dt_bias, A_log, D: [H];
        initial_state: [Bt, H, P, N]; all of one float dtype. dt_floor: float >= 0.
        chunk_size: tokens per checkpoint; keep_checkpoints: whether to return them.

    Returns:
        out [Bt, T, H, P], final state [Bt, H, P, N], checkpoints
        [Bt, H, ceil(T / chunk_size), P, N] (the state entering each chunk) or None.
    """
    xp = _backend.array_module(x)
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    out = _backend.empty(x.shape, x.dtype, xp)
    checkpoints = None
    if keep_checkpoints:
        checkpoints = _backend.empty((nb, nh, -(-nt // chunk_size), npp, nn), x.dtype, xp)
    s = _backend.empty((nb, nh, npp, nn), x.dtype, xp)
    s[...] = initial_state
    _, _, delta, a = _steps(xp, dt, dt_bias, A_log, dt_floor)
    for t in range(nt):
        if keep_checkpoints and t % chunk_size == 0:
            checkpoints[:, :, t // chunk_size] = s
        s *= a[:, t, :, None, None]
        s += (delta[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out[:, t] = (s @ C[:, t, :, :, None])[..., 0] + D[:, None] * x[:, t]
    return out, s, checkpoints


def backward(dout, dstate, x, B, C, dt, dt_bias, A_log, D, checkpoints, dt_floor, chunk_size):
    """Gradients, sweeping the chunks in reverse and recomputing states from the checkpoints.

    Args:
        as ``forward``; checkpoints: its [Bt, H, C, P, N]; dout: [Bt, T, H, P];
        dstate: [Bt, H, P, N].

    Returns:
        dx [Bt, T, H, P]; dB, dC [Bt, T, H, N]; ddt [Bt, T, H]; ddt_bias, dA_log, dD [H];
        dinitial_state [Bt, H, P, N].
    """
    xp = _backend.array_module(x)
    nt = x.shape[1]
    z, soft, delta, a = _steps(xp, dt, dt_bias, A_log, dt_floor)
    dx = _backend.empty(x.shape, x.dtype, xp)
    dB = _backend.empty(B.shape, x.dtype, xp)
    dC = _backend.empty(C.shape, x.dtype, xp)
    ddelta = _backend.empty(dt.shape, x.dtype, xp)
    da = _backend.empty(dt.shape, x.dtype, xp)
    ds = _backend.empty(dstate.shape, x.dtype, xp)
    ds[...] = dstate
    for c in reversed(range(checkpoints.shape[2])):
        t0 = c * chunk_size
        t1 = min(nt, t0 + chunk_size)
        before = [checkpoints[:, :, c].copy()]
        for t in range(t0, t1 - 1):
            s = before[-1] * a[:, t, :, None, None]
            s += (delta[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
            before.append(s)
        for t in reversed(range(t0, t1)):
            prev, x_t, B_t, do_t = before[t - t0], x[:, t], B[:, t], dout[:, t]
            after = prev * a[:, t, :, None, None]
            after += (delta[:, t, :, None] * x_t)[..., None] * B_t[:, :, None, :]
            dC[:, t] = (do_t[:, :, None, :] @ after)[:, :, 0, :]
            ds += do_t[..., None] * C[:, t, :, None, :]
            da[:, t] = (ds * prev).sum(axis=(-2, -1))
            xs = (x_t[:, :, None, :] @ ds)[:, :, 0, :]  # sum_p ds[p, n] x[p]
            dB[:, t] = delta[:, t, :, None] * xs
            ddelta[:, t] = (xs * B_t).sum(axis=-1)
            dx[:, t] = D[:, None] * do_t + delta[:, t, :, None] * (ds @ B_t[..., None])[..., 0]
            ds *= a[:, t, :, None, None]
    rate = -xp.exp(A_log)
    ddelta += da * a * rate
    dA_log = (da * a * delta).sum(axis=(0, 1)) * rate
    # sigmoid(z) = exp(-softplus(-z)); no gradient where the floor is active.
    ddt = _backend.empty(dt.shape, x.dtype, xp)
    ddt[...] = xp.where(soft >= dt_floor, ddelta * xp.exp(-_softplus(xp, -z)), 0)
    dD = (dout * x).sum(axis=(0, 1, 3))
    return dx, dB, dC, ddt, ddt.sum(axis=(0, 1)), dA_log, dD, ds
