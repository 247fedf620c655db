"""Reference selective state-space scan: float64, explicit loops over batch, head, token, state.

Checked against: ``lowbit/ops/selective_scan/`` (every backend) in
``tests/test_selective_scan.py``, where the backward is also checked against central finite
differences. Kernels: ``cuda/selective_scan.cu``.

For every batch b, head h and token t, with the state S of shape [P, N]:
    delta = max(softplus(dt + dt_bias[h]), dt_floor);  a = exp(-exp(A_log[h]) * delta);
    S[p, n] = a * S[p, n] + delta * B[n] * x[p];  out[p] = sum_n S[p, n] * C[n] + D[h] * x[p].
"""

import math

import numpy as np


def softplus_ref(z):
    """log(1 + exp(z)) without overflow for large z."""
    return max(z, 0.0) + math.log1p(math.exp(-abs(z)))


def sigmoid_ref(z):
    """1 / (1 + exp(-z)) without overflow for large |z|."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def selective_scan_ref(x, B, C, dt, dt_bias, A_log, D, initial_state=None, dt_floor=0.0):
    """Forward of the selective scan.

    Args:
        x: [Bt, T, H, P]; B, C: [Bt, T, H, N]; dt: [Bt, T, H]; dt_bias, A_log, D: [H];
        initial_state: [Bt, H, P, N] or None (zeros); dt_floor: float >= 0.

    Returns:
        out [Bt, T, H, P] float64, final state [Bt, H, P, N] float64.
    """
    x, B, C, dt, dt_bias, A_log, D = (np.asarray(a, dtype=np.float64)
                                      for a in (x, B, C, dt, dt_bias, A_log, D))
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    out = np.zeros((nb, nt, nh, npp))
    state = np.zeros((nb, nh, npp, nn))
    if initial_state is not None:
        state[...] = initial_state
    for b in range(nb):
        for h in range(nh):
            s = state[b, h]
            for t in range(nt):
                delta = max(softplus_ref(dt[b, t, h] + dt_bias[h]), dt_floor)
                a = math.exp(-math.exp(A_log[h]) * delta)
                for p in range(npp):
                    acc = 0.0
                    for n in range(nn):
                        s[p, n] = a * s[p, n] + delta * B[b, t, h, n] * x[b, t, h, p]
                        acc += s[p, n] * C[b, t, h, n]
                    out[b, t, h, p] = acc + D[h] * x[b, t, h, p]
    return out, state


def selective_scan_bwd_ref(x, B, C, dt, dt_bias, A_log, D, initial_state, dout, dstate=None,
                           dt_floor=0.0):
    """Reverse-mode gradients of ``selective_scan_ref``, storing every state (small shapes).

    The gradient through ``max(., dt_floor)`` is zero where the floor is active (softplus below
    the floor).

    Returns:
        dx, dB, dC, ddt, ddt_bias, dA_log, dD, dinitial_state (None when ``initial_state`` is
        None); float64.
    """
    x, B, C, dt, dt_bias, A_log, D, dout = (np.asarray(a, dtype=np.float64)
                                            for a in (x, B, C, dt, dt_bias, A_log, D, dout))
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    dx, dB, dC, ddt = (np.zeros_like(a) for a in (x, B, C, dt))
    ddt_bias, dA_log, dD = (np.zeros(nh) for _ in range(3))
    dinit = np.zeros((nb, nh, npp, nn))
    for b in range(nb):
        for h in range(nh):
            s = np.zeros((npp, nn))
            if initial_state is not None:
                s[...] = initial_state[b, h]
            before = []
            for t in range(nt):
                before.append(s.copy())
                delta = max(softplus_ref(dt[b, t, h] + dt_bias[h]), dt_floor)
                a = math.exp(-math.exp(A_log[h]) * delta)
                for p in range(npp):
                    for n in range(nn):
                        s[p, n] = a * s[p, n] + delta * B[b, t, h, n] * x[b, t, h, p]
            ds = np.zeros((npp, nn)) if dstate is None else np.array(dstate[b, h], np.float64)
            rate = -math.exp(A_log[h])
            for t in reversed(range(nt)):
                z = dt[b, t, h] + dt_bias[h]
                soft = softplus_ref(z)
                delta = max(soft, dt_floor)
                a = math.exp(rate * delta)
                prev = before[t]
                ddelta = 0.0
                da = 0.0
                for p in range(npp):
                    # out[p] = sum_n S[p, n] C[n] + D x[p]
                    dD[h] += dout[b, t, h, p] * x[b, t, h, p]
                    dx[b, t, h, p] += D[h] * dout[b, t, h, p]
                    for n in range(nn):
                        after = a * prev[p, n] + delta * B[b, t, h, n] * x[b, t, h, p]
                        dC[b, t, h, n] += dout[b, t, h, p] * after
                        ds[p, n] += dout[b, t, h, p] * C[b, t, h, n]
                    # S[p, n] = a prev[p, n] + delta B[n] x[p]
                    for n in range(nn):
                        da += ds[p, n] * prev[p, n]
                        ddelta += ds[p, n] * B[b, t, h, n] * x[b, t, h, p]
                        dB[b, t, h, n] += ds[p, n] * delta * x[b, t, h, p]
                        dx[b, t, h, p] += ds[p, n] * delta * B[b, t, h, n]
                        ds[p, n] *= a
                # a = exp(rate * delta), rate = -exp(A_log)
                ddelta += da * a * rate
                dA_log[h] += da * a * delta * rate
                if soft >= dt_floor:
                    ddt[b, t, h] = ddelta * sigmoid_ref(z)
                    ddt_bias[h] += ddt[b, t, h]
                else:
                    ddt[b, t, h] = 0.0
            dinit[b, h] = ds
    return dx, dB, dC, ddt, ddt_bias, dA_log, dD, (None if initial_state is None else dinit)
