"""Gated delta rule in Numba: parallel over batch x head x slices of V (the state's columns evolve
independently), sequential over T, each task's state slice in a local array.

Siblings: ``_numpy.py`` (same signatures), ``_numba_chunked.py`` (the chunked form, run by
``use_chunked``), ``_cuda.py``; reference
``reference/gated_delta_scan.py``. The backward sweeps the chunks in reverse, recomputing from
the chunk's checkpoint each token's decayed state and residual into task-local buffers. dq, dk,
dlog_decay and dbeta sum over V, so with several slices each slice writes its own partial row
and the rows are summed afterwards in a fixed order (deterministic, no atomics).

The backward is bound by passes over the K x V state (each SIMD vector of a row loaded and
stored per pass), so it makes one pass per token in each sweep (1.3x faster than two each):
the recompute derives token t + 1's decayed state and residual from token t's in one pass, and
the reverse sweep gets ddelta = (ds + q do^T)^T k = ds^T k + (q.k) do before its pass, the
ds^T k part accumulated by the previous (later) token's pass as it writes ds.

``forward`` and ``backward`` run the chunked form of the same function instead
(``_numba_chunked.py``: matrix products within blocks of 64 tokens, on the register tiles) where it
is faster, by ``use_chunked``: float32 with K = V = 64 on a CPU with AVX-512 or AVX2 + FMA
(``_numba_chunked.USE_FMA``; through BLAS the form runs 0.9x forward, 0.6x backward at B = 4, T =
2048, H = 8), one decay per head, T >= ``CHUNKED_MIN_TOKENS``; the forward when its checkpoint
chunks hold whole blocks (chunk_size >= 64, or no checkpoints), the backward only at chunk_size =
64 (a longer chunk recomputes its states block by block). Measured on a 2-core AMD EPYC (Zen 5,
AVX-512), float32, K = V = 64, chunked over these kernels in the same process, interleaved, median
of 5:

    B, T, H        chunk   forward   backward
    4, 2048, 8     64      1.94x     1.28x
    1, 2048, 1     64      2.71x     2.47x
    2, 256, 2      64      1.75x     1.14x
    1, 128, 2      64      2.64x     2.26x
    1, 64, 4       64      1.64x     1.41x      (not taken: one block, T = 65 would pad a second)
    2, 1024, 8     128     1.90x     0.97x
    2, 1024, 8     32      0.97x     0.60x      (blocks cut at every chunk)
    2, 1000, 8     100     1.50x     0.79x

Both forms save the same checkpoints, so either backward takes either forward's ctx. Elsewhere
(float64, per-key decays, other K or V, no FMA tiles) these kernels run.
"""

import math

import numba
import numpy as np

from ... import _backend
from . import _numba_chunked

#: Fewest state columns per task; narrower slices would starve the SIMD lanes.
MIN_SLICE = 8
#: Tasks per thread wanted before the columns of V are split into slices.
TASKS_PER_THREAD = 2
#: Bytes per cache line. The task-local buffers start on one and their rows are padded to whole
#: lines: a 64-byte SIMD access that straddles two lines costs ~1.5x (measured; np.empty in Numba
#: only aligns to 32 bytes).
LINE = 64


@numba.njit(inline="always")
def _padded(n, like):
    """n rounded up to whole cache lines of like's dtype."""
    per = LINE // like.itemsize
    return -(-n // per) * per


@numba.njit(inline="always")
def _aligned_empty(size, like):
    """An uninitialized 1-D array of size elements of like's dtype, starting on a cache line."""
    raw = np.empty(size + LINE // like.itemsize, like.dtype)
    skip = (LINE - np.intp(raw.ctypes.data) % LINE) % LINE // like.itemsize
    return raw[skip:skip + size]


#: Fewest tokens for the chunked kernels: shorter scans are mostly padding of one block.
CHUNKED_MIN_TOKENS = 2 * _numba_chunked.BLOCK


def use_chunked(backward, dtype, nt, nk, nv, per_key, span):
    """Whether ``forward`` (``backward`` False) or ``backward`` runs the chunked kernels.

    Args:
        backward: the backward's rule, else the forward's.
        dtype: the inputs' dtype; nt, nk, nv: T, K, V.
        per_key: log_decay is [B, T, H, K] (the chunked form takes one decay per head).
        span: tokens between checkpoints (T for a forward that keeps none).

    Returns:
        True where the chunked kernels are the faster form (the rule of the module docstring).
    """
    block = _numba_chunked.BLOCK
    fits = (_numba_chunked.USE_FMA and _numba_chunked.tiles_fit(dtype, nk, nv, block)
            and not per_key and nt >= CHUNKED_MIN_TOKENS)
    return fits and (span == block if backward else span >= block)


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
    wp = _padded(w, q)
    span = max(1, min(chunk, nt))
    ds = _aligned_empty(nk * wp, q).reshape((nk, wp))
    # Per token of the chunk: its decayed state and its residual v - decayed.T @ k.
    decayed = _aligned_empty(span * nk * wp, q).reshape((span, nk, wp))
    residuals = _aligned_empty(span * wp, q).reshape((span, wp))
    rows = _aligned_empty(4 * wp, q).reshape((4, wp))
    delta = rows[0]
    dmem = rows[1]
    kds = rows[2]  # ds.T @ k of the token the reverse sweep does next
    do_t = rows[3]
    ds[:, :w] = dstate[b, h, :, j0:j0 + w]
    kds[:] = 0
    for i in range(nk):
        ki = k[b, nt - 1, h, i]
        for j in range(w):
            kds[j] += ki * ds[i, j]
    for c in range(nchunks - 1, -1, -1):
        t0 = c * chunk
        t1 = min(nt, t0 + chunk)
        sd = decayed[0]
        r = residuals[0]
        r[:] = 0
        gi = math.exp(log_decay[b, t0, h, 0])
        for i in range(nk):
            if per_key:
                gi = math.exp(log_decay[b, t0, h, i])
            ki = k[b, t0, h, i]
            # Row views: an index j0 + j would need a negative-index check that blocks SIMD.
            cp = checkpoints[b, h, c, i, j0:j0 + w]
            for j in range(w):
                x = cp[j] * gi
                sd[i, j] = x
                r[j] += ki * x
        v_t = v[b, t0, h, j0:j0 + w]
        for j in range(w):
            r[j] = v_t[j] - r[j]
        for t in range(t0, t1 - 1):
            # The state after token t, decayed by token t + 1, and token t + 1's residual: one pass.
            sd = decayed[t - t0]
            r = residuals[t - t0]
            sdn = decayed[t + 1 - t0]
            rn = residuals[t + 1 - t0]
            bt = beta[b, t, h]
            for j in range(w):
                delta[j] = bt * r[j]
            rn[:] = 0
            gi = math.exp(log_decay[b, t + 1, h, 0])
            for i in range(nk):
                if per_key:
                    gi = math.exp(log_decay[b, t + 1, h, i])
                ki = k[b, t, h, i]
                kn = k[b, t + 1, h, i]
                for j in range(w):
                    x = (sd[i, j] + ki * delta[j]) * gi
                    sdn[i, j] = x
                    rn[j] += kn * x
            v_t = v[b, t + 1, h, j0:j0 + w]
            for j in range(w):
                rn[j] = v_t[j] - rn[j]
        for t in range(t1 - 1, t0 - 1, -1):
            # The state after token t is sd + outer(k_t, beta_t * r).
            sd = decayed[t - t0]
            r = residuals[t - t0]
            bt = beta[b, t, h]
            do_row = dout[b, t, h, j0:j0 + w]
            dv_t = dv[b, t, h, j0:j0 + w]
            qk = zero
            for i in range(nk):
                qk += q[b, t, h, i] * k[b, t, h, i]
            do_r = zero
            dbt = zero
            for j in range(w):
                do = do_row[j]
                do_t[j] = do  # an aligned copy for the pass below
                do_r += do * r[j]
                ddelta = kds[j] + do * qk
                dv_t[j] = bt * ddelta
                dbt += r[j] * ddelta
                # the gradient of memory = sd.T @ k, and delta = beta * r
                dmem[j] = -bt * ddelta
                delta[j] = bt * r[j]
            dbeta[sl, b, t, h] = dbt
            # k of the token the sweep does next (at t = 0 the sum is unused)
            tp = max(t - 1, 0)
            kds[:] = 0
            gi = math.exp(log_decay[b, t, h, 0])
            # One decay for all rows: its gradient sums the rows' sums.
            dl_sum = zero
            for i in range(nk):
                ki = k[b, t, h, i]
                qi = q[b, t, h, i]
                kp = k[b, tp, h, i]
                if per_key:
                    gi = math.exp(log_decay[b, t, h, i])
                dqi = zero
                dki = zero
                dli = zero
                for j in range(w):
                    x = sd[i, j]
                    do = do_t[j]
                    dqi += do * x
                    g = ds[i, j] + do * qi  # gradient of the state after token t
                    dki += g * delta[j] + dmem[j] * x
                    g = g + ki * dmem[j]  # gradient of sd
                    dli += g * x
                    g = g * gi
                    ds[i, j] = g
                    kds[j] += kp * g
                dq[sl, b, t, h, i] = dqi + ki * bt * do_r
                dk[sl, b, t, h, i] = dki
                if per_key:
                    dlog[sl, b, t, h, i] = dli
                else:
                    dl_sum += dli
            if not per_key:
                dlog[sl, b, t, h, 0] = dl_sum
    dinit[b, h, :, j0:j0 + w] = ds[:, :w]


def forward(q, k, v, log_decay, beta, initial_state, chunk_size, keep_checkpoints):
    """Same contract as ``_numpy.forward``: the chunked kernels where ``use_chunked``, else the
    token-by-token ones (``recurrent_forward``)."""
    nt, nk, nv = q.shape[1], q.shape[3], v.shape[3]
    chunked = use_chunked(False, q.dtype, nt, nk, nv, log_decay.shape[3] > 1,
                          chunk_size if keep_checkpoints else nt)
    return (_numba_chunked.forward if chunked else recurrent_forward)(
        q, k, v, log_decay, beta, initial_state, chunk_size, keep_checkpoints)


def recurrent_forward(q, k, v, log_decay, beta, initial_state, chunk_size, keep_checkpoints):
    """``forward`` through the token-by-token kernels, whatever the shape."""
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    out = _backend.empty((nb, nt, nh, nv), q.dtype)
    final = _backend.empty((nb, nh, nk, nv), q.dtype)
    checkpoints = _backend.empty(
        (nb, nh, -(-nt // chunk_size) if keep_checkpoints else 0, nk, nv), q.dtype)
    _forward(*_backend.read_only(q, k, v, log_decay, beta, initial_state), chunk_size,
             _slice_width(nb, nh, nv), out, final, checkpoints, keep_checkpoints)
    return out, final, (checkpoints if keep_checkpoints else None)


def _sum_slices(partial):
    """[slices, ...] -> [...], summed in slice order (a view when there is one slice)."""
    if partial.shape[0] == 1:
        return partial[0]
    out = _backend.empty(partial.shape[1:], partial.dtype)
    np.sum(partial, axis=0, out=out)
    return out


def backward(dout, dstate, q, k, v, log_decay, beta, checkpoints, chunk_size):
    """Same contract as ``_numpy.backward``: the chunked kernels where ``use_chunked``, else the
    token-by-token ones (``recurrent_backward``)."""
    chunked = use_chunked(True, q.dtype, q.shape[1], q.shape[3], v.shape[3],
                          log_decay.shape[3] > 1, chunk_size)
    return (_numba_chunked.backward if chunked else recurrent_backward)(
        dout, dstate, q, k, v, log_decay, beta, checkpoints, chunk_size)


def recurrent_backward(dout, dstate, q, k, v, log_decay, beta, checkpoints, chunk_size):
    """``backward`` through the token-by-token kernels, whatever the shape."""
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
    _backward(*_backend.read_only(q, k, v, log_decay, beta, checkpoints, dout, dstate),
              chunk_size, width, dq, dk, dv, dlog, dbeta, dinit, q.dtype.type(0))
    return (_sum_slices(dq), _sum_slices(dk), dv, _sum_slices(dlog), _sum_slices(dbeta), dinit)
