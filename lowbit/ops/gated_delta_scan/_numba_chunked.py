"""Chunked (WY / UT) gated delta rule in Numba: within a block of tokens, matrix products;
across blocks, the state recurrence. Parallel over batch x head. The numba backend runs it where
it is faster than its token-by-token kernels (``_numba.use_chunked``: float32, K = V = 64, on
AVX-512 or AVX2 + FMA; ``_numba.py`` has the rule and the measurements).

Siblings: ``_numba_chunked_tiles.py`` (the products), ``_numba.py`` (the token-by-token kernels
and the rule), ``_numpy.py``; reference ``reference/gated_delta_scan.py``; tests
``tests/test_gated_delta_scan_chunked.py``; timed in ``bench/scan.py``. ``forward`` and
``backward`` keep ``_numpy.py``'s contract for one decay per head (log_decay [B, T, H, 1]):
per-key gates' pairwise decays would cost one product per key and pair, the recurrence's work.

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

The products (``_numba_chunked_tiles.product``) run on the register tiles of
``lowbit/ops/packed_matmul/_numba/_fma.py`` for float32 with K = V = 64 where ``USE_FMA``, else
through SciPy's BLAS ``?gemm`` (called by symbol: ``np.dot`` in Numba allocates every result and
cannot accumulate into a view). Their right operands are row-major, so the kernels keep k.T,
delta.T, S0.T and ds.T; the triangular ones (A, tril(D * (Q @ K.T)) and their transposes) skip
the zeros on the tiles. The backward needs A, solved four rows at a time: each group of rows
takes its product with the rows above (the tiles, else ``tile4`` against A.T), then is solved
within itself; row by row, every update went through one row in memory, a chain of
store-to-load latencies (1.15x slower forward, 1.07x backward through BLAS). The forward
(``_forward_block``) needs only delta, which it solves for in place the same way
(``_substitute``): half the multiply-adds of forming A and then its product (3.3 -> 2.1 us).
It stores neither D (formed row by row in the pass that uses it) nor X (bx = beta * (V - a * (K
@ S0)) in that pass), and asks for the next block's input rows while a block runs.

Where the time goes (one thread, float32 on the tiles, B = 4, T = 2048, H = 8, K = V = 64;
microseconds per block of 64 tokens on a Zen 5 EPYC, from a copy of these kernels with one part
removed at a time): forward 26-27.5, of which the products 15.5-16 (all of them removed: 10.5-11
left), the q / k loads with k.T and b * k 3, the D / L / P / bx pass 1.8, the output rows 1.6,
the checkpoint copy 1.0, the decays 0.8. Backward 66-67.5: the products 38.5 (all removed: 28
left), the set-up recomputed 18.3 (its solve for A 6.3; it leaves out Q @ S0, whose one use,
do . (q @ S0), is q . (do @ S0.T) from dq's product), the pairwise decay-gradient loops 4.4. A
full 64 x 64 x 64 product takes 2.1 us on the tiles (~250 GFLOP/s, this core's FMA peak), a
triangular one 1.7 (its six-row tiles pay per call). The token-by-token kernels take 54 forward
and 89-97 backward in the same runs, so 2.5x their speed needs <= 21.5 and <= 36-39: the
backward's products alone exceed that, the forward's leave 5.5 us for 11 of element passes.
"""

import math

import numba
import numpy as np

from ... import _backend
from ..packed_matmul._numba import _blas, _fma, _llvm
from ._numba_chunked_tiles import (prefetch, prefetch_rows, product, tile4, tiles_fit,
                                   transpose, triangular_product, uses_tiles)

# The products call the tiles of ``_fma.py``, the BLAS binding of ``_blas.py`` and the prefetch
# of ``_llvm.py``, which Numba's cache does not key on.
_backend.numba_cache_guard(__file__, _fma.__file__, _blas.__file__, _llvm.__file__)

#: Tokens per block: flash-linear-attention's default and the default checkpoint chunk, so the
#: backward needs no states between checkpoints; 16 and 32 were no faster at K = V = 64 (fewer
#: multiply-adds, but smaller products and more calls).
BLOCK = 64

#: Rows solved together in ``_substitute`` (a divisor of BLOCK; 2, 8 and 16 ran the forward
#: 1.06x, 1.12x and 1.3x slower).
SOLVE = 4

#: Whether float32 with K = V = 64 runs the register tiles (``tiles_fit``), else BLAS.
USE_FMA = _fma.AVAILABLE


@numba.njit(cache=True)
def _workspace(nk, nv, dtype):
    """Per-task buffers for one block (see ``_setup``)."""
    n = BLOCK
    return (np.empty((2 * n, nk), dtype),   # 0 qk2: q rows, then k rows
            np.empty((2 * n, nv), dtype),   # 1 proj: q @ S0, then k @ S0
            np.empty((2 * n, n), dtype),    # 2 gram: q @ k.T, then k @ k.T
            np.zeros((n, n), dtype),        # 3 decay D (lower triangle; the forward's P)
            np.zeros((n, n), dtype),        # 4 inv A
            np.empty((n, nv), dtype),       # 5 x
            np.empty((n, nv), dtype),       # 6 beta * x; the forward's P @ delta
            np.empty((n, nv), dtype),       # 7 delta
            np.empty((n, nk), dtype),       # 8 b * k
            np.empty((4, n), dtype),        # 9 beta, a, b, a row of D
            np.zeros((2, n), np.float64),   # 10 the decays, a row of D being formed
            np.empty(8, np.int32),          # 11 BLAS's integers
            np.empty(2, dtype),             # 12 BLAS's scalars
            np.zeros((n, n), dtype),        # 13 L = diag(beta) M (strict lower; the forward's -L)
            np.zeros((n, n), dtype),        # 14 A.T
            np.empty((nk, n), dtype),       # 15 k.T
            np.empty((nv, n), dtype))       # 16 delta.T (the backward's)


@numba.njit(cache=True)
def _substitute(neg, x, tiles, blas):
    """x <- (I - neg)^-1 x in place, for neg strictly lower triangular, by blocked forward
    substitution: rows r0 .. r0 + SOLVE - 1 take neg[rows, :r0] @ x[:r0] (one product), then are
    solved among themselves. The forward needs only delta = A @ bx, not A: half the
    multiply-adds of forming A (as ``_setup`` does for the backward) and then its product."""
    big = BLOCK
    for r0 in range(0, big, SOLVE):
        if r0:
            product(neg[r0:], SOLVE, r0, False, x, x[r0:], True, tiles, blas)
        for t in range(r0 + 1, r0 + SOLVE):
            row = x[t]
            for u in range(r0, t):
                c = neg[t, u]
                prev = x[u]
                for j in range(x.shape[1]):
                    row[j] += c * prev[j]


@numba.njit(cache=True)
def _setup(q, k, v, log_decay, beta, b, h, t0, n, s0, ws, tiles):
    """Fill ws with the block of n <= BLOCK tokens from t0 entering with state s0, up to delta,
    for the backward: every intermediate it needs (D, x, k @ S0; not q @ S0, whose one use it
    takes from dq's product)."""
    qk2, proj, gram, decay, inv, x, bx, delta, kt, coef, rows, ints, scal, low, inv_t, k_t, _ = ws
    blas = ints, scal
    row = rows[1]
    big = BLOCK
    nk = q.shape[3]
    nv = x.shape[1]
    # Element loops: a row assignment per token (a view and its checks each) took 4.6 us of the
    # block's 25 at K = V = 64 (the row loads and stores of the forward and backward alike).
    for t in range(big):
        live = t < n
        for i in range(nk):
            qk2[t, i] = q[b, t0 + t, h, i] if live else 0
            qk2[big + t, i] = k[b, t0 + t, h, i] if live else 0
        for j in range(nv):
            x[t, j] = v[b, t0 + t, h, j] if live else 0
    transpose(qk2[big:], k_t)
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
    product(qk2[big:], big, nk, False, s0, proj[big:], False, tiles, blas)
    product(qk2, 2 * big, nk, False, k_t, gram, False, tiles, blas)
    for t in range(big):
        for s in range(t):
            low[t, s] = coef[0, t] * decay[t, s] * gram[big + t, s]
    # A = (I + L)^-1, L = diag(beta) M, by blocked forward substitution: rows r0 .. r0 + 3 are
    # E - L[rows, :r0] @ A[:r0] (the tiles, else 4 x 4 register tiles against A.T), then
    # solved among themselves. A row by row would chain every update through the same row in
    # memory (latency bound).
    scal[1] = 0  # a zero of the input dtype for the tiles' sums
    for r0 in range(0, big, 4):
        if uses_tiles(tiles):
            product(low[r0:], 4, r0, False, inv, inv[r0:], False, tiles, blas)
        else:
            for j0 in range(0, r0, 4):
                tile4(low, inv_t, r0, inv, r0, j0, scal[1])
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
            if not uses_tiles(tiles):  # the 4 x 4 tiles' operand
                for j in range(t + 1):
                    inv_t[j, t] = arow[j]
    for t in range(big):
        at = coef[1, t]
        bt = coef[0, t]
        for j in range(nv):
            xv = x[t, j] - at * proj[big + t, j]
            x[t, j] = xv
            bx[t, j] = bt * xv
    triangular_product(inv, big, False, False, bx, delta, False, tiles, blas)


@numba.njit(cache=True)
def _forward_block(q, k, v, log_decay, beta, b, h, t0, n, s, out, ws, tiles):
    """The block of n <= BLOCK tokens from t0 entering with state s: write its output rows and
    advance s past it (in place). Only what the output and the state need, in few passes: D is
    formed row by row as it is used and never stored, and the a-scalings ride on the passes that
    read the products (x is never stored: bx = beta * (v - a * (k @ S0)))."""
    qk2, proj, gram, tri, _, _, o, delta, kt, coef, gam, ints, scal, low, _, k_t, _ = ws
    blas = ints, scal
    big = BLOCK
    nk = q.shape[3]
    nv = v.shape[3]
    total = 1.0
    for t in range(big):
        live = t < n
        gamma = math.exp(np.float64(log_decay[b, t0 + t, h, 0])) if live else 1.0
        gam[0, t] = gamma
        coef[0, t] = beta[b, t0 + t, h] if live else 0
        total *= gamma
        coef[1, t] = total
    total = 1.0
    for t in range(big - 1, -1, -1):  # b_t, the decays after token t
        coef[2, t] = total
        total *= gam[0, t]
    for t in range(big):  # t < n tested once a token, not once an element: 1.02x the forward
        bt = coef[2, t]
        if t < n:
            for i in range(nk):
                kv = k[b, t0 + t, h, i]
                qk2[t, i] = q[b, t0 + t, h, i]
                qk2[big + t, i] = kv
                kt[t, i] = bt * kv
        else:
            for i in range(nk):
                qk2[t, i] = 0
                qk2[big + t, i] = 0
                kt[t, i] = 0
    transpose(qk2[big:], k_t)
    # The next block's rows arrive while this one runs its products.
    for a in (q, k, v):
        prefetch_rows(a, b, t0 + big, t0 + 2 * big, h, False)
    prefetch_rows(out, b, t0, t0 + n, h, True)
    product(qk2, 2 * big, nk, False, s, proj, False, tiles, blas)
    product(qk2, 2 * big, nk, False, k_t, gram, False, tiles, blas)
    # One pass per token: row t of D (float64 as it is formed, then in the input dtype), of -L =
    # -diag(beta) M, of P = tril(D * (q @ k.T)) (tri's upper triangle stays zero), and of bx,
    # in delta, which _substitute solves for in place.
    row = gam[1]
    drow = coef[3]
    for t in range(big):
        gamma = gam[0, t]
        for r in range(t):
            d = row[r] * gamma
            row[r] = d
            drow[r] = d
        row[t] = 1.0
        drow[t] = 1.0
        bt = coef[0, t]
        at = coef[1, t]
        for r in range(t):
            low[t, r] = -bt * drow[r] * gram[big + t, r]
        for r in range(t + 1):
            tri[t, r] = drow[r] * gram[t, r]
        if t < n:
            for j in range(nv):
                delta[t, j] = bt * (v[b, t0 + t, h, j] - at * proj[big + t, j])
        else:
            delta[t] = 0
    _substitute(low, delta, tiles, blas)
    triangular_product(tri, big, False, False, delta, o, False, tiles, blas)
    for t in range(n):
        at = coef[1, t]
        for j in range(nv):
            out[b, t0 + t, h, j] = at * proj[t, j] + o[t, j]
    _advance(s, ws, tiles)


@numba.njit(cache=True)
def _advance(s, ws, tiles):
    """s <- the state after the block (in place): a_{n-1} s + (b * k).T @ delta."""
    delta, kt, coef, blas = ws[7], ws[8], ws[9], (ws[11], ws[12])
    s *= coef[1, BLOCK - 1]
    product(kt, s.shape[0], BLOCK, True, delta, s, True, tiles, blas)


@numba.njit(parallel=True, cache=True)
def _forward(q, k, v, log_decay, beta, s0, span, out, final, checkpoints, keep, tiles):
    nb, nt, nh, nk = q.shape
    nv = v.shape[3]
    big = BLOCK
    for task in numba.prange(nb * nh):
        b, h = task // nh, task % nh
        ws = _workspace(nk, nv, q.dtype)
        s = s0[b, h].copy()
        for c in range(-(-nt // span)):
            if keep:  # element loops: the slice assignment took ~3.5 us a block
                mark = checkpoints[b, h, c]
                for i in range(nk):
                    for j in range(nv):
                        mark[i, j] = s[i, j]
            end = min(nt, (c + 1) * span)
            if keep and c + 1 < checkpoints.shape[2]:  # the next one, while this chunk runs
                prefetch(checkpoints, (task * checkpoints.shape[2] + c + 1) * nk * nv, nk * nv,
                         True)
            for t0 in range(c * span, end, big):
                n = min(big, end - t0)
                _forward_block(q, k, v, log_decay, beta, b, h, t0, n, s, out, ws, tiles)
        final[b, h] = s


# reassoc lets the sums over V, K and the pairs run in SIMD lanes (the per-token loops 10.4 ->
# 6.9 us a block; deterministic still: the order is fixed when the kernel compiles).
@numba.njit(cache=True, fastmath={"reassoc"})
def _block_backward(dout, b, h, t0, n, s0, ds, ws, gs, dq, dk, dv, dlog, dbeta, tiles):
    """Gradients of the block set up in ws: write its rows; ds <- the gradient of the state
    entering it. gs: the backward's buffers (``_backward``)."""
    qk2, proj, gram, decay, inv, x, _, delta, kt, coef, _, ints, scal, _, _, _, delta_t = ws
    blas = ints, scal
    ydo, dz, pair, e, dd, r2, tri, dkk, dg, s_prev, s0_t, ds_t = gs
    big = BLOCK
    nk = qk2.shape[1]
    nv = x.shape[1]
    for t in range(big):  # element loops: see _setup
        for j in range(nv):
            ydo[big + t, j] = dout[b, t0 + t, h, j] if t < n else 0
    do = ydo[big:]
    # P = tril(D * (q @ k.T)) for ddelta = P.T @ do + (b * k) @ ds. tri and dkk are written
    # only in their lower triangles: the rest stays the zeros they were allocated with.
    for t in range(big):
        for r in range(t + 1):
            tri[t, r] = gram[t, r] * decay[t, r]
    transpose(delta, delta_t)
    transpose(ds, ds_t)
    product(kt, big, nk, False, ds, dd, False, tiles, blas)
    triangular_product(tri, big, True, True, do, dd, True, tiles, blas)
    triangular_product(inv, big, True, True, dd, ydo, False, tiles, blas)  # y
    product(ydo, 2 * big, nv, False, delta_t, pair, False, tiles, blas)  # [y; do] @ delta.T
    product(delta, big, nv, False, ds_t, e, False, tiles, blas)
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
            da += z * proj[big + t, j]  # the do . (q @ S0) part comes with r2
        # tri = dqk, the gradient of q @ k.T (lower); dkk that of k @ k.T, whose symmetric
        # gradient is dkk + dkk.T (dkk strictly lower).
        # D[t, s] grows with G_t and shrinks with G_s. The diagonal (D = 1) and the last token's
        # b = 1 would add and take away the same term: left out, so tiny gradients (decays near
        # 0) keep no rounding of O(1) terms.
        grow = 0.0
        for s in range(t):
            dec = decay[t, s]
            pd = pair[t, s] * dec
            dbt -= pd * gram[big + t, s]
            dkk[t, s] = -bt * pd
            w = (-bt * pair[t, s] * gram[big + t, s] + gram[t, s] * pair[big + t, s]) * dec
            grow += w
            dg[s] -= w
        for s in range(t + 1):
            tri[t, s] = pair[big + t, s] * decay[t, s]
        dg[t] += grow + da * coef[1, t]
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
    transpose(s0, s0_t)
    product(dz, 2 * big, nv, False, s0_t, r2, False, tiles, blas)
    for t in range(big):
        at = coef[1, t]
        bs = coef[2, t]
        dqs = 0.0  # do_t . (q_t @ S0) = q_t . (do_t @ S0.T)
        for i in range(nk):
            dqs += qk2[t, i] * r2[t, i]
            r2[t, i] *= at
            r2[big + t, i] = at * r2[big + t, i] + bs * e[t, i]
        dg[t] += dqs * at
    # dq = dqk @ k + a * (do @ S0.T); dk = dqk.T @ q + (dkk + dkk.T) @ k + ...
    k_rows = qk2[big:]
    triangular_product(tri, big, False, False, k_rows, r2, True, tiles, blas)
    triangular_product(tri, big, True, True, qk2, r2[big:], True, tiles, blas)
    triangular_product(dkk, big, False, False, k_rows, r2[big:], True, tiles, blas)
    triangular_product(dkk, big, True, True, k_rows, r2[big:], True, tiles, blas)
    for t in range(n):
        for i in range(nk):
            dq[b, t0 + t, h, i] = r2[t, i]
            dk[b, t0 + t, h, i] = r2[big + t, i]
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
    product(s_prev, nk, 2 * big, True, dz, ds, True, tiles, blas)


@numba.njit(cache=True)
def _grad_workspace(nk, nv, dtype):
    n = BLOCK
    return (np.empty((2 * n, nv), dtype),   # ydo: y, then do
            np.empty((2 * n, nv), dtype),   # dz: do, then -beta * y
            np.empty((2 * n, n), dtype),    # pair: y @ delta.T, then do @ delta.T
            np.empty((n, nk), dtype),       # e = delta @ ds.T
            np.empty((n, nv), dtype),       # ddelta
            np.empty((2 * n, nk), dtype),   # r2: dq rows, then dk rows
            np.zeros((n, n), dtype),        # tri: P, then dqk (lower triangles)
            np.zeros((n, n), dtype),        # dkk (strict lower triangle)
            np.empty(n, np.float64),        # dg: gradient of each G_t
            np.empty((2 * n, nk), dtype),   # a * [q; k]
            np.empty((nv, nk), dtype),      # S0.T
            np.empty((nv, nk), dtype))      # ds.T


@numba.njit(parallel=True, cache=True)
def _backward(q, k, v, log_decay, beta, checkpoints, dout, dstate, span,
              dq, dk, dv, dlog, dbeta, dinit, tiles):
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
                _setup(q, k, v, log_decay, beta, b, h, start + m * big, big, states[m], ws,
                       tiles)
                _advance(states[m + 1], ws, tiles)
            for m in range(nsub - 1, -1, -1):
                t0 = start + m * big
                n = min(big, end - t0)
                _setup(q, k, v, log_decay, beta, b, h, t0, n, states[m], ws, tiles)
                _block_backward(dout, b, h, t0, n, states[m], ds, ws, gs,
                                dq, dk, dv, dlog, dbeta, tiles)
        dinit[b, h] = ds


def _tiles(dtype, nk, nv):
    """The kernels' ``tiles`` (``_numba_chunked_tiles``): whether float32 runs the register tiles
    (``USE_FMA`` and ``tiles_fit``); None for other dtypes, whose kernels hold BLAS alone."""
    if dtype != np.float32:
        return None
    return bool(USE_FMA and tiles_fit(dtype, nk, nv, BLOCK))


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
        _forward(*_backend.read_only(q, k, v, log_decay, beta, initial_state), span, out, final,
                 checkpoints, keep_checkpoints, _tiles(q.dtype, nk, nv))
    return out, final, (checkpoints if keep_checkpoints else None)


def backward(dout, dstate, q, k, v, log_decay, beta, checkpoints, chunk_size):
    """Same contract as ``_numpy.backward``, for one decay per head (log_decay [B, T, H, 1])."""
    grads = [_backend.empty(a.shape, q.dtype) for a in (q, k, v, log_decay, beta)]
    dinit = _backend.empty(dstate.shape, q.dtype)
    with _backend.single_threaded_blas():
        _backward(*_backend.read_only(q, k, v, log_decay, beta, checkpoints, dout, dstate),
                  chunk_size, *grads, dinit, _tiles(q.dtype, q.shape[3], v.shape[3]))
    return (*grads, dinit)
