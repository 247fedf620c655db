"""Reference gated delta rule: float64, explicit loops over batch, head, token and state entries.

Checked against: ``lowbit/ops/gated_delta_scan/`` (every backend) in
``tests/test_gated_delta_scan.py``, where the backward is also checked against central finite
differences. Kernels: ``cuda/gated_delta_scan.cu``.

For every batch b, head h and token t, with the state S of shape [K, V]:
    S[i, :] *= exp(log_decay_t[i]);  memory = S.T @ k_t;  delta = beta_t * (v_t - memory);
    S += outer(k_t, delta);  out_t = S.T @ q_t.
"""

import numpy as np


def _decay(log_decay, b, t, h, i):
    """exp of the decay of state row i: one per head ([B, T, H]) or per key ([B, T, H, K])."""
    if log_decay.ndim == 3:
        return np.exp(log_decay[b, t, h])
    return np.exp(log_decay[b, t, h, i])


def gated_delta_scan_ref(q, k, v, log_decay, beta, initial_state=None):
    """Forward of the gated delta rule.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; log_decay: [B, T, H] or [B, T, H, K];
        beta: [B, T, H]; initial_state: [B, H, K, V] or None (zeros). Any float dtype.

    Returns:
        out [B, T, H, V] float64, final state [B, H, K, V] float64.
    """
    q, k, v, log_decay, beta = (np.asarray(a, dtype=np.float64)
                                for a in (q, k, v, log_decay, beta))
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    out = np.zeros((nb, nt, nh, nv))
    state = np.zeros((nb, nh, nk, nv))
    if initial_state is not None:
        state[...] = initial_state
    for b in range(nb):
        for h in range(nh):
            s = state[b, h]
            for t in range(nt):
                for i in range(nk):
                    for j in range(nv):
                        s[i, j] *= _decay(log_decay, b, t, h, i)
                for j in range(nv):
                    memory = 0.0
                    for i in range(nk):
                        memory += s[i, j] * k[b, t, h, i]
                    delta = beta[b, t, h] * (v[b, t, h, j] - memory)
                    for i in range(nk):
                        s[i, j] += k[b, t, h, i] * delta
                    for i in range(nk):
                        out[b, t, h, j] += s[i, j] * q[b, t, h, i]
    return out, state


def gated_delta_scan_bwd_ref(q, k, v, log_decay, beta, initial_state, dout, dstate=None):
    """Reverse-mode gradients of ``gated_delta_scan_ref``, storing every state (small shapes).

    Args:
        as ``gated_delta_scan_ref``; dout: [B, T, H, V]; dstate: [B, H, K, V] or None (zeros).

    Returns:
        dq, dk, dv, dlog_decay (shape of ``log_decay``), dbeta, dinitial_state (None when
        ``initial_state`` is None); float64.
    """
    q, k, v, log_decay, beta, dout = (np.asarray(a, dtype=np.float64)
                                      for a in (q, k, v, log_decay, beta, dout))
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    dq, dk = np.zeros_like(q), np.zeros_like(k)
    dv, dbeta, dlog = np.zeros_like(v), np.zeros_like(beta), np.zeros_like(log_decay)
    dinit = np.zeros((nb, nh, nk, nv))
    for b in range(nb):
        for h in range(nh):
            # before[t]: the state entering token t; decayed[t]: after step 1 of token t.
            s = np.zeros((nk, nv))
            if initial_state is not None:
                s[...] = initial_state[b, h]
            before, decayed, deltas, residuals = [], [], [], []
            for t in range(nt):
                before.append(s.copy())
                for i in range(nk):
                    for j in range(nv):
                        s[i, j] *= _decay(log_decay, b, t, h, i)
                decayed.append(s.copy())
                delta, residual = np.zeros(nv), np.zeros(nv)
                for j in range(nv):
                    memory = 0.0
                    for i in range(nk):
                        memory += s[i, j] * k[b, t, h, i]
                    residual[j] = v[b, t, h, j] - memory
                    delta[j] = beta[b, t, h] * residual[j]
                    for i in range(nk):
                        s[i, j] += k[b, t, h, i] * delta[j]
                deltas.append(delta)
                residuals.append(residual)
            ds = np.zeros((nk, nv)) if dstate is None else np.array(dstate[b, h], np.float64)
            for t in reversed(range(nt)):
                sd, delta, residual = decayed[t], deltas[t], residuals[t]
                after = sd + np.outer(k[b, t, h], delta)
                for i in range(nk):
                    for j in range(nv):
                        # out_t[j] = sum_i after[i, j] q[i]
                        dq[b, t, h, i] += dout[b, t, h, j] * after[i, j]
                        ds[i, j] += dout[b, t, h, j] * q[b, t, h, i]
                for j in range(nv):
                    # after = decayed + outer(k, delta)
                    ddelta = 0.0
                    for i in range(nk):
                        ddelta += ds[i, j] * k[b, t, h, i]
                        dk[b, t, h, i] += ds[i, j] * delta[j]
                    # delta = beta * (v - memory), memory = decayed.T @ k
                    dv[b, t, h, j] = beta[b, t, h] * ddelta
                    dbeta[b, t, h] += residual[j] * ddelta
                    dmemory = -beta[b, t, h] * ddelta
                    for i in range(nk):
                        dk[b, t, h, i] += dmemory * sd[i, j]
                        ds[i, j] += dmemory * k[b, t, h, i]
                for i in range(nk):
                    # decayed[i, :] = exp(log_decay_i) * before[i, :]
                    g = _decay(log_decay, b, t, h, i)
                    for j in range(nv):
                        if log_decay.ndim == 3:
                            dlog[b, t, h] += ds[i, j] * sd[i, j]
                        else:
                            dlog[b, t, h, i] += ds[i, j] * sd[i, j]
                        ds[i, j] *= g
            dinit[b, h] = ds
    return dq, dk, dv, dlog, dbeta, (None if initial_state is None else dinit)
