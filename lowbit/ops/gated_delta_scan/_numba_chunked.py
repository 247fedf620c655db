"""Chunked (WY / UT) gated delta rule in Numba: within a block of tokens, matrix products through
BLAS; across blocks, the state recurrence. Parallel over batch x head. Not selected by the numba
backend (``_numba.py`` has the measurements and why).

Siblings: ``_numba.py`` (the token-by-token kernels the numba backend runs; its docstring has the
measurements that keep this form unselected on the CPU it was built on), ``_numpy.py``;
reference ``reference/gated_delta_scan.py``; tests ``tests/test_gated_delta_scan.py``; timed in
``bench/scan.py`` against the token-by-token kernels and flash-linear-attention's torch peer.
``forward`` and ``backward`` keep the backend contract of ``_numpy.py`` for one decay per head
(log_decay [B, T, H, 1]): the pairwise decays of per-key gates would cost one product per key
and pair, as much work as the recurrence.

For one block of n tokens entering with state S0 [K, V] (Yang et al., Gated Delta Networks; the
form of flash-linear-attention's ``chunk_gated_delta_rule``), with D[t, s] the product of the
decays of tokens s + 1 .. t (s <= t), a_t that of tokens 0 .. t and b_s = D[n - 1, s]:

    X = V - a * (K @ S0);  M = tril(D * (K @ K.T), -1);  A = (I + diag(beta) M)^-1
    delta = A @ (beta * X)                      (the tokens' writes, beta_t * residual_t)
    out = a * (Q @ S0) + tril(D * (Q @ K.T)) @ delta
    S_n = a_{n-1} S0 + (b * K).T @ delta

which is the recurrence unrolled: A folds in the writes of the block's earlier tokens (the UT
transform). D and a are running products of decays <= 1 (kept in float64 while they are
formed), so nothing overflows and a decay of exactly 0 gives exact zeros, where exp(G_t - G_s)
of summed log-decays would be exp(-inf + inf). The backward runs the block algebra in reverse:
Y = A.T @ ddelta, dX = beta * Y, dM = -(beta * Y) @ delta.T, and the gradient of each
log-decay sums dD * D over the pairs (t, s) it lies between.

Blocks hold ``BLOCK`` tokens; a shorter last block is padded with tokens that change nothing
(q = k = v = 0, beta = 0, decay 1), so every product has one shape and every buffer is
allocated once per task. The backward recomputes each block from the state entering it: the
forward's checkpoint, or, inside a checkpoint chunk longer than ``BLOCK``, states recomputed
block by block from the checkpoint into a task-local buffer.

The products call SciPy's BLAS ``?gemm`` directly (by symbol, so the functions stay cacheable):
``np.dot`` in Numba allocates every result and cannot accumulate into a view. A is solved four
rows at a time: each group of rows takes its product with the rows above from 4 x 4 register
tiles (``_tile``), then is solved within itself. Row by row, every update went through one row
in memory, a chain of store-to-load latencies: 1.15x slower forward, 1.07x backward (1 thread,
B = 1, T = 2048, H = 8, K = V = 64, float32).
"""

import math

import llvmlite.binding
import numba
import numpy as np
from numba import types
from numba.extending import get_cython_function_address

from ... import _backend

#: Tokens per block: flash-linear-attention's default and the default checkpoint chunk, so the
#: backward needs no states between checkpoints; 16 and 32 were no faster at K = V = 64 (fewer
#: multiply-adds, but smaller products and more calls).
BLOCK = 64

for _name in ("sgemm", "dgemm"):
    llvmlite.binding.add_symbol(f"lowbit_{_name}",
                                get_cython_function_address("scipy.linalg.cython_blas", _name))
# Fortran ?gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): every argument a
# pointer, passed as an address.
_SGEMM = types.ExternalFunction("lowbit_sgemm", types.void(*([types.intp] * 13)))
_DGEMM = types.ExternalFunction("lowbit_dgemm", types.void(*([types.intp] * 13)))
_NO, _YES = ord("N"), ord("T")
_INT = 4  # bytes of a Fortran integer in SciPy's LP64 BLAS


@numba.njit(cache=True)
def _mm(a, ta, b, tb, c, beta, ints, scalars):
    """c = op(a) @ op(b) + beta * c for row-major 2-D arrays (rows may be strided, columns
    contiguous); op transposes when ta / tb. ints: int32 [8], scalars: [2] of c's dtype."""
    m, n = c.shape
    item = c.itemsize
    # Row-major c is column-major c.T = op(b).T @ op(a).T: b goes first.
    ints[0] = n
    ints[1] = m
    ints[2] = a.shape[0] if ta else a.shape[1]
    ints[3] = b.strides[0] // item
    ints[4] = a.strides[0] // item
    ints[5] = c.strides[0] // item
    ints[6] = _YES if tb else _NO
    ints[7] = _YES if ta else _NO
    scalars[0] = 1
    scalars[1] = beta
    i = ints.ctypes.data
    s = scalars.ctypes.data
    args = (i + 6 * _INT, i + 7 * _INT, i, i + _INT, i + 2 * _INT, s, b.ctypes.data,
            i + 3 * _INT, a.ctypes.data, i + 4 * _INT, s + item, c.ctypes.data, i + 5 * _INT)
    if item == 4:
        _SGEMM(*args)
    else:
        _DGEMM(*args)


# reassoc lets each sum over p run in SIMD lanes: the 16 sums stay in registers.
@numba.njit(cache=True, fastmath={"contract", "reassoc"})
def _tile(x, y, n, out, i0, j0, zero):
    """out[i0 + r, j0 + c] = x[i0 + r, :n] . y[j0 + c, :n] for r, c < 4; zero: 0 of out's dtype."""
    x0, x1, x2, x3 = x[i0], x[i0 + 1], x[i0 + 2], x[i0 + 3]
    y0, y1, y2, y3 = y[j0], y[j0 + 1], y[j0 + 2], y[j0 + 3]
    c00 = c01 = c02 = c03 = c10 = c11 = c12 = c13 = zero
    c20 = c21 = c22 = c23 = c30 = c31 = c32 = c33 = zero
    for p in range(n):
        a0, a1, a2, a3 = x0[p], x1[p], x2[p], x3[p]
        b0, b1, b2, b3 = y0[p], y1[p], y2[p], y3[p]
        c00 += a0 * b0
        c01 += a0 * b1
        c02 += a0 * b2
        c03 += a0 * b3
        c10 += a1 * b0
        c11 += a1 * b1
        c12 += a1 * b2
        c13 += a1 * b3
        c20 += a2 * b0
        c21 += a2 * b1
        c22 += a2 * b2
        c23 += a2 * b3
        c30 += a3 * b0
        c31 += a3 * b1
        c32 += a3 * b2
        c33 += a3 * b3
    out[i0, j0:j0 + 4] = (c00, c01, c02, c03)
    out[i0 + 1, j0:j0 + 4] = (c10, c11, c12, c13)
    out[i0 + 2, j0:j0 + 4] = (c20, c21, c22, c23)
    out[i0 + 3, j0:j0 + 4] = (c30, c31, c32, c33)


@numba.njit(cache=True)
def _workspace(nk, nv, dtype):
    """Per-task buffers for one block (see ``_setup``)."""
    n = BLOCK
    return (np.empty((2 * n, nk), dtype),   # 0 qk2: q rows, then k rows
            np.empty((2 * n, nv), dtype),   # 1 proj: q @ S0, then k @ S0
            np.empty((2 * n, n), dtype),    # 2 gram: q @ k.T, then k @ k.T
            np.zeros((n, n), dtype),        # 3 decay D (lower triangle)
            np.zeros((n, n), dtype),        # 4 inv A
            np.empty((n, nv), dtype),       # 5 x
            np.empty((n, nv), dtype),       # 6 beta * x, then the output rows
            np.empty((n, nv), dtype),       # 7 delta
            np.empty((n, nk), dtype),       # 8 b * k
            np.empty((3, n), dtype),        # 9 beta, a, b
            np.zeros(n, np.float64),        # 10 a row of D being formed
            np.empty(8, np.int32),          # 11 _mm's integers
            np.empty(2, dtype),             # 12 _mm's scalars
            np.zeros((n, n), dtype),        # 13 L = diag(beta) M (strict lower triangle)
            np.zeros((n, n), dtype))        # 14 A.T


@numba.njit(cache=True)
def _setup(q, k, v, log_decay, beta, b, h, t0, n, s0, ws):
    """Fill ws with the block of n <= BLOCK tokens from t0 entering with state s0, up to delta."""
    qk2, proj, gram, decay, inv, x, bx, delta, kt, coef, row, ints, scal, low, inv_t = ws
    big = BLOCK
    nk = q.shape[3]
    for t in range(big):
        if t < n:
            qk2[t] = q[b, t0 + t, h]
            qk2[big + t] = k[b, t0 + t, h]
            x[t] = v[b, t0 + t, h]
        else:
            qk2[t] = 0
            qk2[big + t] = 0
            x[t] = 0
    total = 1.0
    for t in range(big):
        gamma = math.exp(np.float64(log_decay[b, t0 + t, h, 0])) if t < n else 1.0
        coef[0, t] = beta[b, t0 + t, h] if t < n else 0
        total *= gamma
        coef[1, t] = total
        for s in range(t):
            row[s] *= gamma
        row[t] = 1.0
        for s in range(t + 1):
            decay[t, s] = row[s]
    for s in range(big):
        coef[2, s] = decay[big - 1, s]
        for i in range(nk):
            kt[s, i] = coef[2, s] * qk2[big + s, i]
    _mm(qk2, False, s0, False, proj, 0, ints, scal)
    _mm(qk2, False, qk2[big:], True, gram, 0, ints, scal)
    # A = (I + L)^-1, L = diag(beta) M, by blocked forward substitution: rows r0 .. r0 + 3 are
    # E - L[rows, :r0] @ A[:r0] (register tiles against A.T), then solved among themselves.
    # A row by row would chain every update through the same row in memory (latency bound).
    for t in range(big):
        for s in range(t):
            low[t, s] = coef[0, t] * decay[t, s] * gram[big + t, s]
    scal[1] = 0  # a zero of the input dtype for the tiles' sums
    for r0 in range(0, big, 4):
        for j0 in range(0, r0, 4):
            _tile(low, inv_t, r0, inv, r0, j0, scal[1])
        for t in range(r0, r0 + 4):
            arow = inv[t]
            for j in range(r0):
                arow[j] = -arow[j]
            arow[r0:] = 0
            arow[t] = 1
            for u in range(r0, t):
                c = low[t, u]
                prev = inv[u]
                for j in range(u + 1):
                    arow[j] -= c * prev[j]
            for j in range(t + 1):
                inv_t[j, t] = arow[j]
    nv = x.shape[1]
    for t in range(big):
        at = coef[1, t]
        bt = coef[0, t]
        for j in range(nv):
            xv = x[t, j] - at * proj[big + t, j]
            x[t, j] = xv
            bx[t, j] = bt * xv
    _mm(inv, False, bx, False, delta, 0, ints, scal)


@numba.njit(cache=True)
def _advance(s, ws):
    """s <- the state after the block (in place): a_{n-1} s + (b * k).T @ delta."""
    delta, kt, coef, ints, scal = ws[7], ws[8], ws[9], ws[11], ws[12]
    s *= coef[1, BLOCK - 1]
    _mm(kt, True, delta, False, s, 1, ints, scal)


@numba.njit(parallel=True, cache=True)
def _forward(q, k, v, log_decay, beta, s0, span, out, final, checkpoints, keep):
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    big = BLOCK
    for task in numba.prange(nb * nh):
        b, h = task // nh, task % nh
        ws = _workspace(nk, nv, q.dtype)
        proj, gram, decay, o, delta, coef, ints, scal = (ws[1], ws[2], ws[3], ws[6], ws[7],
                                                         ws[9], ws[11], ws[12])
        s = s0[b, h].copy()
        for c in range(-(-nt // span)):
            if keep:
                checkpoints[b, h, c] = s
            end = min(nt, (c + 1) * span)
            for t0 in range(c * span, end, big):
                n = min(big, end - t0)
                _setup(q, k, v, log_decay, beta, b, h, t0, n, s, ws)
                # P = tril(D * (q @ k.T)) in place of q @ k.T; o starts as a * (q @ S0).
                for t in range(big):
                    for r in range(t + 1):
                        gram[t, r] *= decay[t, r]
                    for r in range(t + 1, big):
                        gram[t, r] = 0
                    for j in range(nv):
                        o[t, j] = coef[1, t] * proj[t, j]
                _mm(gram[:big], False, delta, False, o, 1, ints, scal)
                for t in range(n):
                    out[b, t0 + t, h] = o[t]
                _advance(s, ws)
        final[b, h] = s


@numba.njit(cache=True)
def _block_backward(dout, b, h, t0, n, s0, ds, ws, gs, dq, dk, dv, dlog, dbeta):
    """Gradients of the block set up in ws: write its rows; ds <- the gradient of the state
    entering it. gs: the backward's buffers (``_backward``)."""
    qk2, proj, gram, decay, inv, x, _, delta, kt, coef, _, ints, scal, _, _ = ws
    ydo, dz, pair, e, dd, r2, w2, dg, s_prev = gs
    big = BLOCK
    nk = qk2.shape[1]
    nv = x.shape[1]
    for t in range(big):
        if t < n:
            ydo[big + t] = dout[b, t0 + t, h]
        else:
            ydo[big + t] = 0
    do = ydo[big:]
    # P = tril(D * (q @ k.T)) for ddelta = P.T @ do + (b * k) @ ds.
    for t in range(big):
        for r in range(big):
            w2[t, r] = gram[t, r] * decay[t, r] if r <= t else 0
    _mm(kt, False, ds, False, dd, 0, ints, scal)
    _mm(w2[:, :big], True, do, False, dd, 1, ints, scal)
    _mm(inv, True, dd, False, ydo[:big], 0, ints, scal)   # y
    _mm(ydo, False, delta, True, pair, 0, ints, scal)     # y @ delta.T, then do @ delta.T
    _mm(delta, False, ds, True, e, 0, ints, scal)
    # dz = [do; -beta * y]: the products with S0.T and with the a-scaled q and k.
    dg[:] = 0
    for t in range(big):
        bt = coef[0, t]
        dbt = 0.0
        da = 0.0
        for j in range(nv):
            yj = ydo[t, j]
            dbt += yj * x[t, j]
            z = -bt * yj
            dz[big + t, j] = z
            dz[t, j] = do[t, j]
            da += do[t, j] * proj[t, j] + z * proj[big + t, j]
        # w2 = [dqk.T | dkk], the gradients of q @ k.T and of the symmetric k @ k.T.
        for s in range(big):
            w2[t, s] = 0
            w2[t, big + s] = 0
        for s in range(t):
            dbt -= decay[t, s] * gram[big + t, s] * pair[t, s]
        # D[t, s] grows with G_t and shrinks with G_s. The diagonal (D = 1) and the last token's
        # b = 1 would add and take away the same term: left out, so tiny gradients (decays near
        # 0) keep no rounding of O(1) terms.
        for s in range(t):
            dgram = -bt * pair[t, s] * gram[big + t, s] + gram[t, s] * pair[big + t, s]
            w = dgram * decay[t, s]
            dg[t] += w
            dg[s] -= w
        dg[t] += da * coef[1, t]
        if t < big - 1:
            db = 0.0
            for i in range(nk):
                db += qk2[big + t, i] * e[t, i]
            dg[t] -= db * coef[2, t]
            dg[big - 1] += db * coef[2, t]
        if t < n:
            dbeta[b, t0 + t, h] = dbt
            for j in range(nv):
                dv[b, t0 + t, h, j] = -dz[big + t, j]
    for t in range(big):
        for s in range(t + 1):
            dp = pair[big + t, s] * decay[t, s]
            w2[s, t] = dp  # dqk.T
        for s in range(t):
            dm = -coef[0, t] * pair[t, s] * decay[t, s]
            w2[t, big + s] += dm
            w2[s, big + t] += dm
    _mm(dz, False, s0, True, r2, 0, ints, scal)
    for t in range(big):
        at = coef[1, t]
        bs = coef[2, t]
        for i in range(nk):
            r2[t, i] *= at
            r2[big + t, i] = at * r2[big + t, i] + bs * e[t, i]
    # dq = dqk @ k + a * (do @ S0.T); dk = [dqk.T | dkk] @ [q; k] + ...
    _mm(w2[:, :big], True, qk2[big:], False, r2[:big], 1, ints, scal)
    _mm(w2, False, qk2, False, r2[big:], 1, ints, scal)
    for t in range(n):
        dq[b, t0 + t, h] = r2[t]
        dk[b, t0 + t, h] = r2[big + t]
    acc = 0.0
    total = 0.0
    for i in range(nk):
        for j in range(nv):
            total += s0[i, j] * ds[i, j]
    dg[big - 1] += total * coef[1, big - 1]
    # A log-decay enters every G_t from its token on.
    for t in range(big - 1, -1, -1):
        acc += dg[t]
        if t < n:
            dlog[b, t0 + t, h, 0] = acc
    for t in range(2 * big):
        at = coef[1, t % big]
        for i in range(nk):
            s_prev[t, i] = at * qk2[t, i]
    ds *= coef[1, big - 1]
    _mm(s_prev, True, dz, False, ds, 1, ints, scal)


@numba.njit(cache=True)
def _grad_workspace(nk, nv, dtype):
    n = BLOCK
    return (np.empty((2 * n, nv), dtype),   # ydo: y, then do
            np.empty((2 * n, nv), dtype),   # dz: do, then -beta * y
            np.empty((2 * n, n), dtype),    # pair: y @ delta.T, then do @ delta.T
            np.empty((n, nk), dtype),       # e = delta @ ds.T
            np.empty((n, nv), dtype),       # ddelta
            np.empty((2 * n, nk), dtype),   # r2: dq rows, then dk rows
            np.empty((n, 2 * n), dtype),    # w2
            np.empty(n, np.float64),        # dg: gradient of each G_t
            np.empty((2 * n, nk), dtype))   # a * [q; k]


@numba.njit(parallel=True, cache=True)
def _backward(q, k, v, log_decay, beta, checkpoints, dout, dstate, span,
              dq, dk, dv, dlog, dbeta, dinit):
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    big = BLOCK
    for task in numba.prange(nb * nh):
        b, h = task // nh, task % nh
        ws = _workspace(nk, nv, q.dtype)
        gs = _grad_workspace(nk, nv, q.dtype)
        ds = dstate[b, h].copy()
        states = np.empty((-(-min(span, nt) // big), nk, nv), q.dtype)
        for c in range(checkpoints.shape[2] - 1, -1, -1):
            start = c * span
            end = min(nt, start + span)
            nsub = -(-(end - start) // big)
            states[0] = checkpoints[b, h, c]
            for m in range(nsub - 1):
                states[m + 1] = states[m]
                _setup(q, k, v, log_decay, beta, b, h, start + m * big, big, states[m], ws)
                _advance(states[m + 1], ws)
            for m in range(nsub - 1, -1, -1):
                t0 = start + m * big
                n = min(big, end - t0)
                _setup(q, k, v, log_decay, beta, b, h, t0, n, states[m], ws)
                _block_backward(dout, b, h, t0, n, states[m], ds, ws, gs,
                                dq, dk, dv, dlog, dbeta)
        dinit[b, h] = ds


def forward(q, k, v, log_decay, beta, initial_state, chunk_size, keep_checkpoints):
    """Same contract as ``_numpy.forward``, for one decay per head (log_decay [B, T, H, 1])."""
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    span = chunk_size if keep_checkpoints else nt
    out = _backend.empty((nb, nt, nh, nv), q.dtype)
    final = _backend.empty((nb, nh, nk, nv), q.dtype)
    checkpoints = _backend.empty((nb, nh, -(-nt // span) if keep_checkpoints else 0, nk, nv),
                                 q.dtype)
    with _backend.single_threaded_blas():
        _forward(q, k, v, log_decay, beta, initial_state, span, out, final, checkpoints,
                 keep_checkpoints)
    return out, final, (checkpoints if keep_checkpoints else None)


def backward(dout, dstate, q, k, v, log_decay, beta, checkpoints, chunk_size):
    """Same contract as ``_numpy.backward``, for one decay per head (log_decay [B, T, H, 1])."""
    grads = [_backend.empty(a.shape, q.dtype) for a in (q, k, v, log_decay, beta)]
    dinit = _backend.empty(dstate.shape, q.dtype)
    with _backend.single_threaded_blas():
        _backward(q, k, v, log_decay, beta, checkpoints, dout, dstate, chunk_size, *grads, dinit)
    return (*grads, dinit)
