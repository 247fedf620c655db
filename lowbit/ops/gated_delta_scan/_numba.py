"""Gated delta rule in Numba: parallel over batch x head x slices of V (the state's columns evolve
independently), sequential over T, each task's state slice in a local array.

Siblings: ``_numpy.py`` (same signatures), ``_cuda.py``; reference
``reference/gated_delta_scan.py``. The backward sweeps the chunks in reverse, recomputing from
the chunk's checkpoint each token's decayed state and residual into task-local buffers. dq, dk,
dlog_decay and dbeta sum over V, so with several slices each slice writes its own partial row
and the rows are summed afterwards in a fixed order (deterministic, no atomics).
"""

import math

import numba
import numpy as np

from ... import _backend

#: Fewest state columns per task; narrower slices would starve the SIMD lanes.
MIN_SLICE = 8
#: Tasks per thread wanted before the columns of V are split into slices.
TASKS_PER_THREAD = 2


def _slice_width(nb, nh, nv):
    """Columns of V per task: all of them when batch x head alone keeps the threads busy."""
    want = TASKS_PER_THREAD * numba.get_num_threads()
    if nb * nh >= want:
        return nv
    slices = -(-want // (nb * nh))
    return min(nv, max(MIN_SLICE, -(-nv // slices)))


@numba.njit(inline="always")
def _decay_and_residual(s, k, v, log_decay, beta, b, t, h, j0, w, residual):
    """Decay the state slice s [K, w] in place by token t; residual[:w] = v_t - s.T @ k_t."""
    nk = s.shape[0]
    per_key = log_decay.shape[3] > 1
    gi = math.exp(log_decay[b, t, h, 0])
    residual[:w] = 0
    for i in range(nk):
        if per_key:
            gi = math.exp(log_decay[b, t, h, i])
        ki = k[b, t, h, i]
        for j in range(w):
            s[i, j] *= gi
            residual[j] += ki * s[i, j]
    v_t = v[b, t, h, j0:j0 + w]
    for j in range(w):
        residual[j] = v_t[j] - residual[j]


@numba.njit(parallel=True, cache=True)
def _forward(q, k, v, log_decay, beta, s0, chunk, width, out, final, checkpoints, keep):
    nb, nh, nv = q.shape[0], q.shape[2], v.shape[3]
    for task in numba.prange(nb * nh * -(-nv // width)):
        _forward_task(q, k, v, log_decay, beta, s0, chunk, width, out, final, checkpoints, keep,
                      task)


# contract: the multiply-adds become FMAs.
@numba.njit(cache=True, fastmath={"contract"})
def _forward_task(q, k, v, log_decay, beta, s0, chunk, width, out, final, checkpoints, keep,
                  task):
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    nslices = -(-nv // width)
    sl = task % nslices
    b = task // (nslices * nh)
    h = (task // nslices) % nh
    j0 = sl * width
    w = min(nv, j0 + width) - j0
    s = np.empty((nk, w), q.dtype)
    s[:, :] = s0[b, h, :, j0:j0 + w]
    delta = np.empty(w, q.dtype)
    o = np.empty(w, q.dtype)
    for t in range(nt):
        if keep and t % chunk == 0:
            checkpoints[b, h, t // chunk, :, j0:j0 + w] = s
        _decay_and_residual(s, k, v, log_decay, beta, b, t, h, j0, w, delta)
        bt = beta[b, t, h]
        for j in range(w):
            delta[j] *= bt
        o[:] = 0
        for i in range(nk):
            ki = k[b, t, h, i]
            qi = q[b, t, h, i]
            for j in range(w):
                s[i, j] += ki * delta[j]
                o[j] += qi * s[i, j]
        out[b, t, h, j0:j0 + w] = o
    final[b, h, :, j0:j0 + w] = s


@numba.njit(parallel=True, cache=True)
def _backward(q, k, v, log_decay, beta, checkpoints, dout, dstate, chunk, width,
              dq, dk, dv, dlog, dbeta, dinit, zero):
    """dq, dk, dlog, dbeta: [slices, ...] partial sums, one row per slice of V; zero: a scalar
    of the input dtype (accumulators start from it and keep its precision)."""
    nb, nh, nv = q.shape[0], q.shape[2], v.shape[3]
    for task in numba.prange(nb * nh * -(-nv // width)):
        _backward_task(q, k, v, log_decay, beta, checkpoints, dout, dstate, chunk, width,
                       dq, dk, dv, dlog, dbeta, dinit, zero, task)


# reassoc lets the sums over j (dq, dk, dlog) run in SIMD lanes.
@numba.njit(cache=True, fastmath={"reassoc", "contract"})
def _backward_task(q, k, v, log_decay, beta, checkpoints, dout, dstate, chunk, width,
                   dq, dk, dv, dlog, dbeta, dinit, zero, task):
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    per_key = log_decay.shape[3] > 1
    nslices = -(-nv // width)
    nchunks = checkpoints.shape[2]
    sl = task % nslices
    b = task // (nslices * nh)
    h = (task // nslices) % nh
    j0 = sl * width
    w = min(nv, j0 + width) - j0
    ds = np.empty((nk, w), q.dtype)
    ds[:, :] = dstate[b, h, :, j0:j0 + w]
    # Per token of the chunk: its decayed state and its residual v - decayed.T @ k.
    span = max(1, min(chunk, nt))
    decayed = np.empty((span, nk, w), q.dtype)
    residuals = np.empty((span, w), q.dtype)
    s = np.empty((nk, w), q.dtype)
    ddelta = np.empty(w, q.dtype)
    dlog_lanes = np.empty(w, q.dtype)
    for c in range(nchunks - 1, -1, -1):
        t0 = c * chunk
        t1 = min(nt, t0 + chunk)
        s[:, :] = checkpoints[b, h, c, :, j0:j0 + w]
        for t in range(t0, t1):
            # decayed[t - t0] = s * g written in the same pass that computes the memory.
            sd = decayed[t - t0]
            r = residuals[t - t0]
            r[:] = 0
            gi = math.exp(log_decay[b, t, h, 0])
            for i in range(nk):
                if per_key:
                    gi = math.exp(log_decay[b, t, h, i])
                ki = k[b, t, h, i]
                for j in range(w):
                    x = s[i, j] * gi
                    sd[i, j] = x
                    r[j] += ki * x
            v_t = v[b, t, h, j0:j0 + w]
            for j in range(w):
                r[j] = v_t[j] - r[j]
            if t + 1 < t1:
                bt = beta[b, t, h]
                for i in range(nk):
                    kb = k[b, t, h, i] * bt
                    for j in range(w):
                        s[i, j] = sd[i, j] + kb * r[j]
        for t in range(t1 - 1, t0 - 1, -1):
            # The state after token t is sd + outer(k_t, beta_t * r).
            sd = decayed[t - t0]
            r = residuals[t - t0]
            bt = beta[b, t, h]
            # Row views: an index j0 + j would need a negative-index check that blocks SIMD.
            do_t = dout[b, t, h, j0:j0 + w]
            dv_t = dv[b, t, h, j0:j0 + w]
            do_r = zero
            for j in range(w):
                do_r += do_t[j] * r[j]
            ddelta[:] = 0
            for i in range(nk):
                ki = k[b, t, h, i]
                qi = q[b, t, h, i]
                dqi = zero
                for j in range(w):
                    do = do_t[j]
                    dqi += do * sd[i, j]
                    g = ds[i, j] + do * qi
                    ds[i, j] = g
                    ddelta[j] += ki * g
                dq[sl, b, t, h, i] = dqi + ki * bt * do_r
            dbt = zero
            for j in range(w):
                dv_t[j] = bt * ddelta[j]
                dbt += r[j] * ddelta[j]
                # from here on ddelta holds the gradient of memory = sd.T @ k, and r holds
                # delta = beta * r: dk sums ds * delta + dmemory * sd in one pass below
                ddelta[j] *= -bt
                r[j] *= bt
            dbeta[sl, b, t, h] = dbt
            if per_key:
                for i in range(nk):
                    ki = k[b, t, h, i]
                    gi = math.exp(log_decay[b, t, h, i])
                    dki = zero
                    dli = zero
                    for j in range(w):
                        dki += ds[i, j] * r[j] + ddelta[j] * sd[i, j]
                        g = ds[i, j] + ddelta[j] * ki
                        dli += g * sd[i, j]
                        ds[i, j] = g * gi
                    dk[sl, b, t, h, i] = dki
                    dlog[sl, b, t, h, i] = dli
            else:
                # One decay for all rows: its gradient is summed in SIMD lanes across the
                # rows and reduced once.
                gi = math.exp(log_decay[b, t, h, 0])
                dlog_lanes[:] = 0
                for i in range(nk):
                    ki = k[b, t, h, i]
                    dki = zero
                    for j in range(w):
                        dki += ds[i, j] * r[j] + ddelta[j] * sd[i, j]
                        g = ds[i, j] + ddelta[j] * ki
                        dlog_lanes[j] += g * sd[i, j]
                        ds[i, j] = g * gi
                    dk[sl, b, t, h, i] = dki
                dl = zero
                for j in range(w):
                    dl += dlog_lanes[j]
                dlog[sl, b, t, h, 0] = dl
    dinit[b, h, :, j0:j0 + w] = ds


def gated_delta_scan_forward(q, k, v, log_decay, beta, initial_state, chunk_size,
                             keep_checkpoints):
    """Same contract as ``_numpy.gated_delta_scan_forward``."""
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    out = _backend.empty((nb, nt, nh, nv), q.dtype)
    final = _backend.empty((nb, nh, nk, nv), q.dtype)
    checkpoints = _backend.empty(
        (nb, nh, -(-nt // chunk_size) if keep_checkpoints else 0, nk, nv), q.dtype)
    _forward(q, k, v, log_decay, beta, initial_state, chunk_size, _slice_width(nb, nh, nv),
             out, final, checkpoints, keep_checkpoints)
    return out, final, (checkpoints if keep_checkpoints else None)


def _sum_slices(partial):
    """[slices, ...] -> [...], summed in slice order (a view when there is one slice)."""
    if partial.shape[0] == 1:
        return partial[0]
    out = _backend.empty(partial.shape[1:], partial.dtype)
    np.sum(partial, axis=0, out=out)
    return out


def gated_delta_scan_backward(q, k, v, log_decay, beta, checkpoints, dout, dstate, chunk_size):
    """Same contract as ``_numpy.gated_delta_scan_backward``."""
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    width = _slice_width(nb, nh, nv)
    nslices = -(-nv // width)
    dq = _backend.empty((nslices,) + q.shape, q.dtype)
    dk = _backend.empty((nslices,) + k.shape, q.dtype)
    dlog = _backend.empty((nslices,) + log_decay.shape, q.dtype)
    dbeta = _backend.empty((nslices,) + beta.shape, q.dtype)
    dv = _backend.empty(v.shape, q.dtype)
    dinit = _backend.empty((nb, nh, nk, nv), q.dtype)
    _backward(q, k, v, log_decay, beta, checkpoints, dout, dstate, chunk_size, width,
              dq, dk, dv, dlog, dbeta, dinit, q.dtype.type(0))
    return (_sum_slices(dq), _sum_slices(dk), dv, _sum_slices(dlog), _sum_slices(dbeta), dinit)
