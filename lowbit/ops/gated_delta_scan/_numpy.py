"""Gated delta rule in NumPy (array-generic: numpy or cupy): a loop over T, vectorized over batch
and head, with state checkpoints every ``chunk_size`` tokens and a chunked reverse sweep.

Siblings: ``_numba.py``, ``_cuda.py`` (``cuda/gated_delta_scan.cu``); reference
``reference/gated_delta_scan.py``. Arguments are validated and made contiguous by ``__init__``;
``log_decay`` arrives as [B, T, H, Kd] with Kd = 1 (per head) or K (per key row).
"""

from ... import _backend


def _step(s, k_t, v_t, g_t, beta_t):
    """Advance the states s [B, H, K, V] in place by one token; return delta [B, H, V]."""
    s *= g_t[..., None]
    memory = (k_t[:, :, None, :] @ s)[:, :, 0, :]
    delta = beta_t[..., None] * (v_t - memory)
    s += k_t[..., None] * delta[:, :, None, :]
    return delta


def forward(q, k, v, log_decay, beta, initial_state, chunk_size, keep_checkpoints):
    """Run the recurrence.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; log_decay: [B, T, H, Kd]; beta: [B, T, H];
        initial_state: [B, H, K, V]; all of one float dtype.
        chunk_size: tokens per checkpoint; keep_checkpoints: whether to return them.

    Returns:
        out [B, T, H, V], final state [B, H, K, V], checkpoints [B, H, ceil(T / chunk_size), K, V]
        (the state entering each chunk) or None.
    """
    xp = _backend.array_module(q)
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    out = _backend.empty((nb, nt, nh, nv), q.dtype, xp)
    checkpoints = None
    if keep_checkpoints:
        checkpoints = _backend.empty((nb, nh, -(-nt // chunk_size), nk, nv), q.dtype, xp)
    s = _backend.empty((nb, nh, nk, nv), q.dtype, xp)
    s[...] = initial_state
    decay = xp.exp(log_decay)
    for t in range(nt):
        if keep_checkpoints and t % chunk_size == 0:
            checkpoints[:, :, t // chunk_size] = s
        _step(s, k[:, t], v[:, t], decay[:, t], beta[:, t])
        out[:, t] = (q[:, t, :, None, :] @ s)[:, :, 0, :]
    return out, s, checkpoints


def backward(dout, dstate, q, k, v, log_decay, beta, checkpoints, chunk_size):
    """Gradients, sweeping the chunks in reverse and recomputing states from the checkpoints.

    Args:
        as ``forward``; checkpoints: its [B, H, C, K, V]; dout: [B, T, H, V];
        dstate: [B, H, K, V].

    Returns:
        dq, dk [B, T, H, K]; dv [B, T, H, V]; dlog_decay [B, T, H, Kd]; dbeta [B, T, H];
        dinitial_state [B, H, K, V].
    """
    xp = _backend.array_module(q)
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    dq = _backend.empty(q.shape, q.dtype, xp)
    dk = _backend.empty(k.shape, q.dtype, xp)
    dv = _backend.empty(v.shape, q.dtype, xp)
    dlog = _backend.empty(log_decay.shape, q.dtype, xp)
    dbeta = _backend.empty(beta.shape, q.dtype, xp)
    ds = _backend.empty((nb, nh, nk, nv), q.dtype, xp)
    ds[...] = dstate
    decay = xp.exp(log_decay)
    per_key = log_decay.shape[3] > 1
    for c in reversed(range(checkpoints.shape[2])):
        t0 = c * chunk_size
        t1 = min(nt, t0 + chunk_size)
        # before[i]: the state entering token t0 + i, recomputed from the chunk's checkpoint.
        before = [checkpoints[:, :, c].copy()]
        for t in range(t0, t1 - 1):
            s = before[-1].copy()
            _step(s, k[:, t], v[:, t], decay[:, t], beta[:, t])
            before.append(s)
        for t in reversed(range(t0, t1)):
            g_t = decay[:, t][..., None]
            k_t, q_t, do_t = k[:, t], q[:, t], dout[:, t]
            decayed = before[t - t0] * g_t
            residual = v[:, t] - (k_t[:, :, None, :] @ decayed)[:, :, 0, :]
            delta = beta[:, t][..., None] * residual
            after = decayed + k_t[..., None] * delta[:, :, None, :]
            dq[:, t] = (after @ do_t[..., None])[..., 0]
            ds += q_t[..., None] * do_t[:, :, None, :]
            ddelta = (k_t[:, :, None, :] @ ds)[:, :, 0, :]
            dk_t = (ds @ delta[..., None])[..., 0]
            dv[:, t] = beta[:, t][..., None] * ddelta
            dbeta[:, t] = (residual * ddelta).sum(axis=-1)
            dmemory = -beta[:, t][..., None] * ddelta
            dk_t += (decayed @ dmemory[..., None])[..., 0]
            dk[:, t] = dk_t
            ds += k_t[..., None] * dmemory[:, :, None, :]
            dlog_t = (ds * decayed).sum(axis=-1)
            dlog[:, t] = dlog_t if per_key else dlog_t.sum(axis=-1, keepdims=True)
            ds *= g_t
    return dq, dk, dv, dlog, dbeta, ds
