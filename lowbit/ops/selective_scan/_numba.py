"""Selective scan in Numba: parallel over batch x head, sequential over T, each task's state in a
local array held transposed as [N, P] so the inner loops run over P (SIMD lanes).

Siblings: ``_numpy.py`` (same signatures), ``_cuda.py``; reference ``reference/selective_scan.py``.
The backward sweeps the chunks in reverse, recomputing the states entering each token of a chunk
from its checkpoint into a task-local buffer. The per-head gradients (ddt_bias, dA_log, dD) are
written per (batch, head) and summed over the batch afterwards, in order (deterministic).
"""

import math

import numba
import numpy as np

from ... import _backend


# zero (a scalar of the input dtype) keeps the step in that dtype: max(z, 0) would be float64 and
# carry delta and a, and with them the state loops, to float64 (measured 1.3x slower in float32).
@numba.njit(inline="always")
def _softplus(z, zero):
    """log(1 + exp(z)) without overflow: softplus(100) is 100."""
    return max(z, zero) + math.log1p(math.exp(-abs(z)))


@numba.njit(inline="always")
def _step(dt, dt_bias, A_log, dt_floor, b, t, h, zero):
    """(softplus(z), delta, a) of token t, z = dt + dt_bias."""
    soft = _softplus(dt[b, t, h] + dt_bias[h], zero)
    delta = max(soft, dt_floor)
    return soft, delta, math.exp(-math.exp(A_log[h]) * delta)


# contract: the multiply-adds become FMAs.
@numba.njit(parallel=True, cache=True, fastmath={"contract"})
def _forward(x, B, C, dt, dt_bias, A_log, D, s0, dt_floor, chunk, out, final, checkpoints, keep,
             zero):
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    for task in numba.prange(nb * nh):
        b = task // nh
        h = task % nh
        s = np.empty((nn, npp), x.dtype)
        s[:, :] = s0[b, h].T
        dx = np.empty(npp, x.dtype)
        o = np.empty(npp, x.dtype)
        for t in range(nt):
            if keep and t % chunk == 0:
                checkpoints[b, h, t // chunk] = s.T
            _, delta, a = _step(dt, dt_bias, A_log, dt_floor, b, t, h, zero)
            for p in range(npp):
                dx[p] = delta * x[b, t, h, p]
                o[p] = D[h] * x[b, t, h, p]
            # update and read-out in one pass over the state
            for n in range(nn):
                bn = B[b, t, h, n]
                cn = C[b, t, h, n]
                for p in range(npp):
                    v = a * s[n, p] + bn * dx[p]
                    s[n, p] = v
                    o[p] += v * cn
            for p in range(npp):
                out[b, t, h, p] = o[p]
        final[b, h] = s.T


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def _backward(x, B, C, dt, dt_bias, A_log, D, checkpoints, dout, dstate, dt_floor, chunk,
              dx, dB, dC, ddt, ddt_bias, dA_log, dD, dinit, zero):
    """ddt_bias, dA_log, dD: [Bt, H] rows summed over the batch by the caller; zero: a scalar of
    the input dtype (accumulators start from it and keep its precision)."""
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    nchunks = checkpoints.shape[2]
    for task in numba.prange(nb * nh):
        b = task // nh
        h = task % nh
        rate = -math.exp(A_log[h])
        ds = np.empty((nn, npp), x.dtype)
        ds[:, :] = dstate[b, h].T
        span = max(1, min(chunk, nt))
        before = np.empty((span, nn, npp), x.dtype)
        # softplus, delta and a of each token of the chunk, computed once for both sweeps
        softs = np.empty(span, x.dtype)
        deltas = np.empty(span, x.dtype)
        decays = np.empty(span, x.dtype)
        xd = np.empty(npp, x.dtype)
        bias_acc = zero
        alog_acc = zero
        d_acc = zero
        for c in range(nchunks - 1, -1, -1):
            t0 = c * chunk
            t1 = min(nt, t0 + chunk)
            for t in range(t0, t1):
                softs[t - t0], deltas[t - t0], decays[t - t0] = _step(
                    dt, dt_bias, A_log, dt_floor, b, t, h, zero)
            before[0] = checkpoints[b, h, c].T
            for t in range(t0, t1 - 1):
                # before[t + 1 - t0] = a * before[t - t0] + delta * outer(B_t, x_t), one pass
                delta = deltas[t - t0]
                a = decays[t - t0]
                cur = before[t - t0]
                nxt = before[t + 1 - t0]
                for p in range(npp):
                    xd[p] = delta * x[b, t, h, p]
                for n in range(nn):
                    bn = B[b, t, h, n]
                    cur_n = cur[n]
                    nxt_n = nxt[n]
                    for p in range(npp):
                        nxt_n[p] = a * cur_n[p] + bn * xd[p]
            for t in range(t1 - 1, t0 - 1, -1):
                soft = softs[t - t0]
                delta = deltas[t - t0]
                a = decays[t - t0]
                prev = before[t - t0]
                x_t = x[b, t, h]
                do_t = dout[b, t, h]
                gx = dx[b, t, h]
                do_x = zero
                for p in range(npp):
                    do_x += do_t[p] * x_t[p]
                    gx[p] = D[h] * do_t[p]
                d_acc += do_x
                # da = sum over (n, p) of g * prev, summed per row like xs (as fast as a row of
                # SIMD lanes across n, with one buffer fewer)
                da = zero
                ddelta = zero
                for n in range(nn):
                    cn = C[b, t, h, n]
                    bn = B[b, t, h, n]
                    db = delta * bn
                    do_prev = zero
                    xs = zero
                    dsn = ds[n]
                    prev_n = prev[n]
                    for p in range(npp):
                        # the state after token t is a * prev + delta * B[n] * x[p]
                        do_prev += do_t[p] * prev_n[p]
                        g = dsn[p] + do_t[p] * cn
                        da += g * prev_n[p]
                        xs += g * x_t[p]
                        gx[p] += g * db
                        dsn[p] = g * a
                    dC[b, t, h, n] = a * do_prev + db * do_x
                    dB[b, t, h, n] = delta * xs
                    ddelta += bn * xs
                ddelta += da * a * rate
                alog_acc += da * a * delta * rate
                if soft >= dt_floor:
                    # sigmoid(z) = exp(z - softplus(z)), stable: the exponent is never positive
                    gz = ddelta * math.exp(dt[b, t, h] + dt_bias[h] - soft)
                else:
                    gz = zero
                ddt[b, t, h] = gz
                bias_acc += gz
        dinit[b, h] = ds.T
        ddt_bias[b, h] = bias_acc
        dA_log[b, h] = alog_acc
        dD[b, h] = d_acc


def forward(x, B, C, dt, dt_bias, A_log, D, initial_state, dt_floor, chunk_size,
            keep_checkpoints):
    """Same contract as ``_numpy.forward``."""
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    out = _backend.empty(x.shape, x.dtype)
    final = _backend.empty((nb, nh, npp, nn), x.dtype)
    checkpoints = _backend.empty(
        (nb, nh, -(-nt // chunk_size) if keep_checkpoints else 0, npp, nn), x.dtype)
    _forward(*_backend.read_only(x, B, C, dt, dt_bias, A_log, D, initial_state),
             x.dtype.type(dt_floor), chunk_size, out, final, checkpoints, keep_checkpoints,
             x.dtype.type(0))
    return out, final, (checkpoints if keep_checkpoints else None)


def backward(dout, dstate, x, B, C, dt, dt_bias, A_log, D, checkpoints, dt_floor, chunk_size):
    """Same contract as ``_numpy.backward``."""
    nb, nt, nh, npp = x.shape
    nn = B.shape[3]
    dx = _backend.empty(x.shape, x.dtype)
    dB = _backend.empty(B.shape, x.dtype)
    dC = _backend.empty(C.shape, x.dtype)
    ddt = _backend.empty(dt.shape, x.dtype)
    rows = [_backend.empty((nb, nh), x.dtype) for _ in range(3)]
    dinit = _backend.empty((nb, nh, npp, nn), x.dtype)
    _backward(*_backend.read_only(x, B, C, dt, dt_bias, A_log, D, checkpoints, dout, dstate),
              x.dtype.type(dt_floor), chunk_size, dx, dB, dC, ddt, *rows, dinit, x.dtype.type(0))
    ddt_bias, dA_log, dD = (r.sum(axis=0) for r in rows)
    return dx, dB, dC, ddt, ddt_bias, dA_log, dD, dinit
