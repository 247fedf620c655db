"""Gated delta rule in NumPy (array-generic: numpy or cupy): a loop over T, vectorized over batch
and head, with state checkpoints every ``chunk_size`` tokens and a chunked reverse sweep; or,
where ``use_chunked`` says so, the chunked (WY / UT) form.

Siblings: ``_numba.py``, ``_cuda.py`` (``cuda/gated_delta_scan.cu``); reference
``reference/gated_delta_scan.py``. Arguments are validated and made contiguous by ``__init__``;
``log_decay`` arrives as [B, T, H, Kd] with Kd = 1 (per head) or K (per key row).

With one decay per head and at least ``MIN_BLOCK`` tokens (``use_chunked``), both directions
run the chunked (WY / UT) form instead: batched matrix products within blocks of ``BLOCK``
tokens, the state recurrence across them (the algebra is in ``_numba_chunked.py``'s docstring).
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
    if use_chunked(q.shape[1], log_decay.shape[3] > 1):
        return _forward_chunked(q, k, v, log_decay, beta, initial_state, chunk_size,
                                keep_checkpoints)
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
    if use_chunked(q.shape[1], log_decay.shape[3] > 1):
        return _backward_chunked(dout, dstate, q, k, v, log_decay, beta, checkpoints,
                                 chunk_size)
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


# -- the chunked (WY / UT) form: matrix products within blocks of tokens ------------------------

#: Tokens per block of the chunked form (as ``_numba_chunked.BLOCK``).
BLOCK = 64
#: Fewest tokens for which the chunked form runs (``use_chunked``; measured faster from 4 on).
MIN_BLOCK = 4
#: Log-decays are clamped here before they are summed: exp of anything below -745 is 0 in
#: float64, and a finite floor keeps G_t - G_s from being -inf + inf.
LOG_FLOOR = -800.0


def use_chunked(nt, per_key):
    """The rule: the chunked form runs for one decay per head and at least ``MIN_BLOCK`` tokens:
    NumPy's cost is per call, and the chunked form makes a few dozen calls per block of up to
    ``BLOCK`` tokens where the loop makes a dozen per token (measured at B = 4, T = 512, H = 8,
    K = V = 64, float32: forward 1.7-1.9x, backward 2.2-4.9x). The forward's blocks do not depend on
    ``chunk_size`` (checkpoints inside a block are read off its algebra), so training and
    inference compute the same outputs bitwise. Per-key decays stay token by token."""
    return not per_key and nt >= MIN_BLOCK


def _spans(nt, span):
    """(checkpoint index, [(t0, t1) blocks of at most BLOCK tokens]) per checkpoint chunk."""
    for c in range(-(-nt // span)):
        start, end = c * span, min(nt, (c + 1) * span)
        yield c, [(t0, min(end, t0 + BLOCK)) for t0 in range(start, end, BLOCK)]


def _block(xp, q, k, v, log_decay, beta, s0):
    """Block quantities for q, k [B, H, n, K], v [B, H, n, V], log_decay, beta [B, H, n] entering
    with s0 [B, H, K, V] (``_numba_chunked`` has the algebra)."""
    n = q.shape[2]
    g = xp.cumsum(xp.maximum(log_decay.astype(xp.float64), LOG_FLOOR), axis=-1)
    lower = xp.tril(xp.ones((n, n), bool))
    diff = xp.where(lower, g[..., :, None] - g[..., None, :], -xp.inf)
    decay = xp.exp(diff).astype(q.dtype)
    a = xp.exp(g).astype(q.dtype)
    kk = k @ xp.swapaxes(k, -1, -2)
    qk = q @ xp.swapaxes(k, -1, -2)
    m = xp.tril(decay * kk, -1)
    p = decay * qk
    nbeta = beta[..., :, None] * m
    inv = _backend.empty(m.shape, q.dtype, xp)
    inv[...] = xp.eye(n, dtype=q.dtype)
    for t in range(1, n):  # A = I - diag(beta) M A, row by row
        inv[..., t, :t] = -(nbeta[..., t:t + 1, :t] @ inv[..., :t, :t])[..., 0, :]
    ks, qs = k @ s0, q @ s0
    x = v - a[..., None] * ks
    delta = inv @ (beta[..., None] * x)
    return a, decay, kk, qk, m, p, inv, ks, qs, x, delta


def _advance(xp, k, a, decay, delta, s0, j):
    """The state after the block's first j tokens: a_{j-1} s0 + (D[j-1, :j] * k[:j]).T @ delta."""
    tail = decay[..., j - 1, :j]
    return (a[..., j - 1, None, None] * s0
            + xp.swapaxes(tail[..., None] * k[..., :j, :], -1, -2) @ delta[..., :j, :])


def _by_head(xp, *arrays):
    """[B, T, H, ...] -> [B, H, T, ...] copies (contiguous blocks along T)."""
    return [xp.ascontiguousarray(xp.moveaxis(a, 2, 1)) for a in arrays]


def _forward_chunked(q, k, v, log_decay, beta, initial_state, chunk_size, keep_checkpoints):
    xp = _backend.array_module(q)
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    span = chunk_size if keep_checkpoints else nt
    qh, kh, vh, gh, bh = _by_head(xp, q, k, v, log_decay[..., 0], beta)
    out = _backend.empty((nb, nt, nh, nv), q.dtype, xp)
    checkpoints = None
    if keep_checkpoints:
        checkpoints = _backend.empty((nb, nh, -(-nt // span), nk, nv), q.dtype, xp)
    s = initial_state.copy()
    for t0 in range(0, nt, BLOCK):
        t1 = min(nt, t0 + BLOCK)
        kb = kh[:, :, t0:t1]
        a, decay, _, _, _, p, _, _, qs, _, delta = _block(
            xp, qh[:, :, t0:t1], kb, vh[:, :, t0:t1], gh[:, :, t0:t1], bh[:, :, t0:t1], s)
        out[:, t0:t1] = xp.moveaxis(a[..., None] * qs + p @ delta, 1, 2)
        if keep_checkpoints:
            for c in range(-(-t0 // span), -(-t1 // span)):
                j = c * span - t0
                checkpoints[:, :, c] = s if j == 0 else _advance(xp, kb, a, decay, delta, s, j)
        s = _advance(xp, kb, a, decay, delta, s, t1 - t0)
    return out, s, checkpoints


def _backward_chunked(dout, dstate, q, k, v, log_decay, beta, checkpoints, chunk_size):
    xp = _backend.array_module(q)
    nt = q.shape[1]
    qh, kh, vh, gh, bh, doh = _by_head(xp, q, k, v, log_decay[..., 0], beta, dout)
    grads = [_backend.empty(a.shape, q.dtype, xp) for a in (q, k, v, log_decay, beta)]
    dlog = grads[3]
    grads[3] = dlog[..., 0]  # written [B, T, H]
    ds = dstate.copy()
    tr = lambda x: xp.swapaxes(x, -1, -2)  # noqa: E731
    for c, blocks in reversed(list(_spans(nt, chunk_size))):
        states = [checkpoints[:, :, c]]
        for t0, t1 in blocks[:-1]:
            parts = [a[:, :, t0:t1] for a in (qh, kh, vh, gh, bh)]
            a, decay, *_, delta = _block(xp, *parts, states[-1])
            states.append(_advance(xp, parts[1], a, decay, delta, states[-1], t1 - t0))
        for (t0, t1), s0 in reversed(list(zip(blocks, states))):
            qb, kb, vb, gb, bb = (x[:, :, t0:t1] for x in (qh, kh, vh, gh, bh))
            do = doh[:, :, t0:t1]
            a, decay, kk, qk, m, p, inv, ks, qs, x, delta = _block(xp, qb, kb, vb, gb, bb, s0)
            tail = decay[..., -1, :]
            ddelta = tr(p) @ do + (tail[..., None] * kb) @ ds
            y = tr(inv) @ ddelta
            z = bb[..., None] * y
            yd = y @ tr(delta)
            dp = xp.tril(do @ tr(delta))
            e = delta @ tr(ds)
            dm = xp.tril(-bb[..., :, None] * yd, -1)
            dkk = decay * dm
            dqk = decay * dp
            # D[t, s] grows with G_t and shrinks with G_s.
            # The diagonal (D = 1) and the last token's b = 1 add and take away the same term:
            # left out, so tiny gradients (decays near 0) keep no rounding of O(1) terms.
            w = xp.tril((kk * dm + qk * dp) * decay, -1)
            dg = (w.sum(-1) - w.sum(-2)).astype(xp.float64)
            da = (do * qs).sum(-1) - (z * ks).sum(-1)
            db = ((kb * e).sum(-1) * tail)[..., :-1]
            dg += da * a
            dg[..., :-1] -= db
            dg[..., -1] += db.sum(-1) + (s0 * ds).sum((-2, -1)) * a[..., -1]
            grads[0][:, t0:t1] = xp.moveaxis(dqk @ kb + a[..., None] * (do @ tr(s0)), 1, 2)
            grads[1][:, t0:t1] = xp.moveaxis((dkk + tr(dkk)) @ kb + tr(dqk) @ qb
                                             - a[..., None] * (z @ tr(s0))
                                             + tail[..., None] * e, 1, 2)
            grads[2][:, t0:t1] = xp.moveaxis(z, 1, 2)
            grads[3][:, t0:t1] = xp.moveaxis(xp.flip(xp.cumsum(xp.flip(dg, -1), -1), -1), 1, 2)
            grads[4][:, t0:t1] = xp.moveaxis((y * x).sum(-1) - (m * yd).sum(-1), 1, 2)
            ds = (a[..., -1, None, None] * ds + tr(a[..., None] * qb) @ do
                  - tr(a[..., None] * kb) @ z)
    return grads[0], grads[1], grads[2], dlog, grads[4], ds
