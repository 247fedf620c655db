"""Suite ``scan``: the gated delta rule and the selective scan, forward and backward, against what
a user would write: a NumPy loop over T, vectorized over batch and head (the backward keeping
every state from its forward, so it does no recomputation).

Ops: ``lowbit/ops/gated_delta_scan``, ``lowbit/ops/selective_scan``; references:
``reference/gated_delta_scan.py``, ``reference/selective_scan.py``. Each fast case is checked
against the float64 reference on a small shape before it is timed. ``tokens/s`` is batch x T
over the median call time of the very calls the harness times.

On CPU the gated delta rule also gets the chunked (WY / UT) numba kernels
(``lowbit/ops/gated_delta_scan/_numba_chunked.py``, which the numba backend runs where
``_numba.use_chunked`` says, so its ``numba`` rows time whichever form that picks) timed against
the token-by-token numba kernels (``recurrent_forward`` / ``recurrent_backward``) in the same
run (target ``CHUNKED_TARGET``), and, when flash-linear-attention is installed
(pip package ``fla-core``), its torch ``naive_chunk_gated_delta_rule`` as the peer: run as its
users run it (the [B, T, H, K] tensors it takes, built before the clock; ``scale=1``, so it
computes lowbit's function; the backward through torch autograd on a graph kept from one
forward), torch's threads pinned to Numba's, its result checked against the reference first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time
from pathlib import Path

import numpy as np

import lowbit
from lowbit.reference.gated_delta_scan import gated_delta_scan_bwd_ref, gated_delta_scan_ref
from lowbit.reference.selective_scan import selective_scan_bwd_ref, selective_scan_ref

from ._harness import Case, Config

#: Speedup over the NumPy loop each numba case must reach.
TARGET = 10.0
#: Speedup of the chunked gated delta kernels over the token-by-token ones.
CHUNKED_TARGET = 2.5


# -- what a user would write: NumPy loops over T, vectorized over batch and head ---------------

def gdr_forward_loop(q, k, v, log_decay, beta, state):
    """Gated delta rule; log_decay [B, T, H]. Returns out and every state entering a token."""
    out = np.empty(v.shape, v.dtype)
    states = []
    S = state.copy()
    for t in range(q.shape[1]):
        states.append(S.copy())
        S *= np.exp(log_decay[:, t])[:, :, None, None]
        memory = np.einsum("bhkv,bhk->bhv", S, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - memory)
        S += np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S, states


def gdr_backward_loop(q, k, v, log_decay, beta, states, dout, dstate):
    """Reverse sweep over the states kept by ``gdr_forward_loop``."""
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    dlog, dbeta = np.empty_like(log_decay), np.empty_like(beta)
    dS = dstate.copy()
    for t in reversed(range(q.shape[1])):
        g = np.exp(log_decay[:, t])[:, :, None, None]
        decayed = states[t] * g
        residual = v[:, t] - np.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        delta = beta[:, t, :, None] * residual
        after = decayed + np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        dq[:, t] = np.einsum("bhkv,bhv->bhk", after, dout[:, t])
        dS += np.einsum("bhk,bhv->bhkv", q[:, t], dout[:, t])
        ddelta = np.einsum("bhkv,bhk->bhv", dS, k[:, t])
        dv[:, t] = beta[:, t, :, None] * ddelta
        dbeta[:, t] = (residual * ddelta).sum(-1)
        dmemory = -beta[:, t, :, None] * ddelta
        dk[:, t] = (np.einsum("bhkv,bhv->bhk", dS, delta)
                    + np.einsum("bhkv,bhv->bhk", decayed, dmemory))
        dS += np.einsum("bhk,bhv->bhkv", k[:, t], dmemory)
        dlog[:, t] = (dS * decayed).sum((-2, -1))
        dS *= g
    return dq, dk, dv, dlog, dbeta, dS


def _softplus(z):
    return np.maximum(z, 0) + np.log1p(np.exp(-np.abs(z)))


def ssm_forward_loop(x, B, C, dt, dt_bias, A_log, D, state):
    """Selective scan (dt_floor 0). Returns out and every state entering a token."""
    delta = _softplus(dt + dt_bias)
    a = np.exp(-np.exp(A_log) * delta)
    out = np.empty(x.shape, x.dtype)
    states = []
    S = state.copy()
    for t in range(x.shape[1]):
        states.append(S.copy())
        S = a[:, t, :, None, None] * S + np.einsum(
            "bhp,bhn->bhpn", delta[:, t, :, None] * x[:, t], B[:, t])
        out[:, t] = np.einsum("bhpn,bhn->bhp", S, C[:, t]) + D[:, None] * x[:, t]
    return out, S, states


def ssm_backward_loop(x, B, C, dt, dt_bias, A_log, D, states, dout, dstate):
    """Reverse sweep over the states kept by ``ssm_forward_loop``."""
    z = dt + dt_bias
    delta = _softplus(z)
    rate = -np.exp(A_log)
    a = np.exp(rate * delta)
    dx, dB, dC = np.empty_like(x), np.empty_like(B), np.empty_like(C)
    ddelta, da = np.empty_like(dt), np.empty_like(dt)
    dS = dstate.copy()
    for t in reversed(range(x.shape[1])):
        prev = states[t]
        after = a[:, t, :, None, None] * prev + np.einsum(
            "bhp,bhn->bhpn", delta[:, t, :, None] * x[:, t], B[:, t])
        dC[:, t] = np.einsum("bhpn,bhp->bhn", after, dout[:, t])
        dS += np.einsum("bhp,bhn->bhpn", dout[:, t], C[:, t])
        da[:, t] = (dS * prev).sum((-2, -1))
        xs = np.einsum("bhpn,bhp->bhn", dS, x[:, t])
        dB[:, t] = delta[:, t, :, None] * xs
        ddelta[:, t] = (xs * B[:, t]).sum(-1)
        dx[:, t] = D[:, None] * dout[:, t] + delta[:, t, :, None] * np.einsum(
            "bhpn,bhn->bhp", dS, B[:, t])
        dS *= a[:, t, :, None, None]
    ddelta += da * a * rate
    ddt = ddelta / (1 + np.exp(-z))
    return (dx, dB, dC, ddt, ddt.sum((0, 1)), (da * a * delta).sum((0, 1)) * rate,
            (dout * x).sum((0, 1, 3)), dS)


# -- checks against the float64 references (small shapes) ---------------------------------------

def _host(x):
    return x if x is None or isinstance(x, np.ndarray) else x.get()


def _close(name, ref, got, rtol):
    got = np.asarray(_host(got), np.float64)
    err = np.sqrt(np.mean((got - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30)
    if not err <= rtol:
        raise AssertionError(f"{name}: relative RMS error {err:.2e} above {rtol:.0e}")


def _gdr_inputs(rng, nb, nt, nh, nk, nv, dtype):
    k = rng.normal(size=(nb, nt, nh, nk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    arrays = (rng.normal(size=(nb, nt, nh, nk)), k, rng.normal(size=(nb, nt, nh, nv)),
              -rng.uniform(0.0, 0.3, (nb, nt, nh)), rng.uniform(0.0, 1.0, (nb, nt, nh)),
              rng.normal(size=(nb, nh, nk, nv)))
    return [a.astype(dtype) for a in arrays]


def _ssm_inputs(rng, nb, nt, nh, npp, nn, dtype):
    arrays = (rng.normal(size=(nb, nt, nh, npp)), rng.normal(size=(nb, nt, nh, nn)),
              rng.normal(size=(nb, nt, nh, nn)), rng.normal(size=(nb, nt, nh)) - 1.0,
              rng.normal(scale=0.5, size=nh), rng.normal(scale=0.5, size=nh),
              rng.normal(size=nh), rng.normal(size=(nb, nh, npp, nn)))
    return [a.astype(dtype) for a in arrays]


def _check_gdr(xp, backend):
    rng = np.random.default_rng(1)
    inputs = _gdr_inputs(rng, 2, 11, 2, 5, 37, np.float32)
    dout = rng.normal(size=inputs[2].shape).astype(np.float32)
    dstate = rng.normal(size=inputs[5].shape).astype(np.float32)
    with _forced(backend):
        out, state, ctx = lowbit.gated_delta_scan_forward(
            *(xp.asarray(a) for a in inputs[:5]), initial_state=xp.asarray(inputs[5]),
            chunk_size=4)
        grads = lowbit.gated_delta_scan_backward(xp.asarray(dout), xp.asarray(dstate), ctx)
    ref_out, ref_state = gated_delta_scan_ref(*inputs)
    _close("out", ref_out, out, 1e-5)
    _close("state", ref_state, state, 1e-5)
    for name, ref, got in zip(("dq", "dk", "dv", "dlog_decay", "dbeta", "dinitial_state"),
                              gated_delta_scan_bwd_ref(*inputs, dout, dstate), grads):
        _close(name, ref, got, 1e-5)


def _check_ssm(xp, backend):
    rng = np.random.default_rng(2)
    inputs = _ssm_inputs(rng, 2, 11, 2, 37, 5, np.float32)
    dout = rng.normal(size=inputs[0].shape).astype(np.float32)
    dstate = rng.normal(size=inputs[7].shape).astype(np.float32)
    with _forced(backend):
        out, state, ctx = lowbit.selective_scan_forward(
            *(xp.asarray(a) for a in inputs[:7]), initial_state=xp.asarray(inputs[7]),
            chunk_size=4)
        grads = lowbit.selective_scan_backward(xp.asarray(dout), xp.asarray(dstate), ctx)
    ref_out, ref_state = selective_scan_ref(*inputs)
    _close("out", ref_out, out, 1e-5)
    _close("state", ref_state, state, 1e-5)
    names = ("dx", "dB", "dC", "ddt", "ddt_bias", "dA_log", "dD", "dinitial_state")
    for name, ref, got in zip(names, selective_scan_bwd_ref(*inputs, dout, dstate), grads):
        _close(name, ref, got, 1e-5)


def _check_loops():
    """The NumPy-loop baselines compute the same thing as the references."""
    rng = np.random.default_rng(3)
    q, k, v, ld, beta, s0 = _gdr_inputs(rng, 2, 6, 2, 3, 4, np.float64)
    dout, dstate = rng.normal(size=v.shape), rng.normal(size=s0.shape)
    out, state, states = gdr_forward_loop(q, k, v, ld, beta, s0)
    ref_out, ref_state = gated_delta_scan_ref(q, k, v, ld, beta, s0)
    _close("loop out", ref_out, out, 1e-12)
    _close("loop state", ref_state, state, 1e-12)
    for ref, got in zip(gated_delta_scan_bwd_ref(q, k, v, ld, beta, s0, dout, dstate),
                        gdr_backward_loop(q, k, v, ld, beta, states, dout, dstate)):
        _close("loop grad", ref, got, 1e-12)
    inputs = _ssm_inputs(rng, 2, 6, 2, 3, 4, np.float64)
    dout, dstate = rng.normal(size=inputs[0].shape), rng.normal(size=inputs[7].shape)
    out, state, states = ssm_forward_loop(*inputs)
    ref_out, ref_state = selective_scan_ref(*inputs)
    _close("loop out", ref_out, out, 1e-12)
    _close("loop state", ref_state, state, 1e-12)
    for ref, got in zip(selective_scan_bwd_ref(*inputs, dout, dstate),
                        ssm_backward_loop(*inputs[:7], states, dout, dstate)):
        _close("loop grad", ref, got, 1e-12)


# -- the chunked kernels and flash-linear-attention's torch peer (CPU only) --------------------

def _fla_naive():
    """fla's ``naive`` gated delta module, or the reason it cannot be loaded.

    Loaded from its file: importing ``fla.ops`` imports every Triton kernel first, and the naive
    torch module needs only torch and einops.
    """
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None, "fla-core not installed (pip install fla-core einops)"
    path = Path(list(spec.submodule_search_locations)[0]) / "ops/gated_delta_rule/naive.py"
    try:
        loaded = importlib.util.spec_from_file_location("_fla_gated_delta_naive", path)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    except (ImportError, OSError) as error:
        return None, f"fla's naive gated delta rule cannot be loaded: {error}"
    return module, None


class _FlaPeer:
    """``naive_chunk_gated_delta_rule`` on torch CPU tensors built once, before any timing."""

    def __init__(self, torch, naive, q, k, v, log_decay, beta, s0, dout):
        self.torch = torch
        self.naive = naive
        self.inputs = [torch.from_numpy(np.ascontiguousarray(a)).requires_grad_()
                       for a in (q, k, v, log_decay, beta, s0)]
        self.dout = torch.from_numpy(dout)
        self.graph = None

    def _run(self):
        q, k, v, g, beta, s0 = self.inputs
        return self.naive.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, scale=1.0,
                                                       initial_state=s0,
                                                       output_final_state=True)

    def forward(self):
        with self.torch.no_grad():
            return self._run()

    def backward(self):
        """Gradients of (out * dout).sum() through the graph of one kept forward."""
        if self.graph is None:
            self.graph = self._run()[0]
        return self.torch.autograd.grad(self.graph, self.inputs, self.dout, retain_graph=True)


def _check_fla(torch, naive):
    """The timed fla path on a small shape (T not a multiple of 64) against the reference."""
    rng = np.random.default_rng(4)
    inputs = _gdr_inputs(rng, 2, 70, 2, 5, 7, np.float32)
    dout = rng.normal(size=inputs[2].shape).astype(np.float32)
    peer = _FlaPeer(torch, naive, *inputs, dout)
    out, state = peer.forward()
    ref_out, ref_state = gated_delta_scan_ref(*inputs)
    _close("fla out", ref_out, out.numpy(), 1e-5)
    _close("fla state", ref_state, state.numpy(), 1e-5)
    refs = gated_delta_scan_bwd_ref(*inputs, dout, np.zeros_like(inputs[5]))
    for name, ref, got in zip(("dq", "dk", "dv", "dlog_decay", "dbeta", "dinitial_state"),
                              refs, peer.backward()):
        _close(f"fla {name}", ref, got.numpy(), 1e-5)


def _check_kernels(forward, backward):
    """A pair of numba gated delta kernels (working-array contract) against the reference: on a
    small shape and at K = V = 64 in chunks of 64, where the chunked kernels run the products the
    bench times (the AVX-512 tiles where the CPU has them)."""
    rng = np.random.default_rng(5)
    for shape, chunk in (((2, 70, 2, 5, 7), 32), ((1, 70, 1, 64, 64), 64)):
        q, k, v, ld, beta, s0 = _gdr_inputs(rng, *shape, np.float32)
        dout = rng.normal(size=v.shape).astype(np.float32)
        dstate = rng.normal(size=s0.shape).astype(np.float32)
        work = (q, k, v, np.ascontiguousarray(ld[..., None]), beta)
        out, state, checkpoints = forward(*work, s0, chunk, True)
        grads = backward(dout, dstate, *work, checkpoints, chunk)
        ref_out, ref_state = gated_delta_scan_ref(q, k, v, ld, beta, s0)
        _close("out", ref_out, out, 1e-5)
        _close("state", ref_state, state, 1e-5)
        refs = gated_delta_scan_bwd_ref(q, k, v, ld, beta, s0, dout, dstate)
        for name, ref, got in zip(("dq", "dk", "dv", "dlog_decay", "dbeta", "dinitial_state"),
                                  refs, grads[:3] + (grads[3][..., 0],) + grads[4:]):
            _close(name, ref, got, 1e-5)


def _chunked_cases(inputs, dout, tokens, flops, dims):
    """Recurrent numba, chunked numba and the fla peer, per direction, chunked and fla against
    the recurrent row of the same run."""
    from lowbit.ops.gated_delta_scan import _numba, _numba_chunked

    q, k, v, ld, beta, s0 = inputs
    work = (q, k, v, np.ascontiguousarray(ld[..., None]), beta)
    zero = np.zeros_like(s0)
    kernels = {"recurrent": (_numba.recurrent_forward, _numba.recurrent_backward),
               "chunked": (_numba_chunked.forward, _numba_chunked.backward)}
    naive, reason = _fla_naive()
    peer = None
    if naive is not None:
        import numba
        import torch

        torch.set_num_threads(numba.get_num_threads())
        peer = _FlaPeer(torch, naive, *inputs, dout)
    for direction in ("forward", "backward"):
        base = f"gated_delta {direction} numba recurrent"
        for kind, (fwd, bwd) in kernels.items():
            if direction == "forward":
                def fn(f=fwd):
                    f(*work, s0, 64, True)
            else:
                checkpoints = fwd(*work, s0, 64, True)[2]

                def fn(b=bwd, c=checkpoints):
                    b(dout, zero, *work, c, 64)
            info = {"shape": dims}
            yield Case("scan", f"gated_delta {direction} numba {kind}",
                       fn=_timed(fn, info, tokens), info=info, flops=flops[direction],
                       check=lambda f=fwd, b=bwd: _check_kernels(f, b),
                       baseline=None if kind == "recurrent" else base,
                       paired=kind != "recurrent",
                       target=None if kind == "recurrent" else CHUNKED_TARGET)
        if peer is None:
            print(f"  scan/gated_delta {direction} fla: skipped, {reason}")
            continue
        info = {"shape": dims, "torch_threads": peer.torch.get_num_threads()}
        yield Case("scan", f"gated_delta {direction} fla naive_chunk (torch)",
                   fn=_timed(getattr(peer, direction), info, tokens), info=info,
                   flops=flops[direction], baseline=base,
                   check=(lambda: _check_fla(peer.torch, naive)) if direction == "forward"
                   else None)


# -- cases ----------------------------------------------------------------------------------------

def _forced(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _timed(fn, info, tokens, sync=None):
    """``fn`` that also keeps ``info["tokens/s"]`` at tokens over its median call time so far."""
    seconds = []

    def run():
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        seconds.append(time.perf_counter() - start)
        info["tokens/s"] = tokens / statistics.median(seconds)
    return run


def cases(config: Config):
    if config.gpu:
        import cupy as xp

        sync = xp.cuda.Device().synchronize
        backend = config.backend or "cuda"
        nb, nt = (2, 256) if config.quick else (16, 8192)
    else:
        xp, sync, backend = np, None, config.backend
        nb, nt = (2, 128) if config.quick else (4, 2048)
    nh, nk, nv, npp, nn = 8, 64, 64, 64, 16
    rng = np.random.default_rng(0)
    tokens = nb * nt
    label = backend or ("cuda" if config.gpu else "auto")
    shape = f"B={nb} T={nt} H={nh}"

    gdr = _gdr_inputs(rng, nb, nt, nh, nk, nv, np.float32)
    gdr_dout = rng.normal(size=gdr[2].shape).astype(np.float32)
    ssm = _ssm_inputs(rng, nb, nt, nh, npp, nn, np.float32)
    ssm_dout = rng.normal(size=ssm[0].shape).astype(np.float32)
    # flops per (token, head): the state update, read-out and their gradients, counted as
    # multiply-adds x 2 over the state entries (exp and reductions over scalars left out).
    gdr_flops = {"forward": 2 * 4 * nk * nv, "backward": 2 * 11 * nk * nv}
    ssm_flops = {"forward": 2 * 3 * npp * nn, "backward": 2 * 9 * npp * nn}

    specs = [
        ("gated_delta", f"{shape} K={nk} V={nv}", gdr, gdr_dout, gdr_flops, _check_gdr,
         gdr_forward_loop, gdr_backward_loop, lowbit.gated_delta_scan_forward,
         lowbit.gated_delta_scan_backward),
        ("selective", f"{shape} P={npp} N={nn}", ssm, ssm_dout, ssm_flops, _check_ssm,
         ssm_forward_loop, ssm_backward_loop, lowbit.selective_scan_forward,
         lowbit.selective_scan_backward),
    ]
    for op, dims, inputs, dout, flops, check, loop_fwd, loop_bwd, forward, backward in specs:
        dev = [xp.asarray(a) for a in inputs]
        dout_dev = xp.asarray(dout)
        with _forced(backend):
            _, _, ctx = forward(*dev[:-1], initial_state=dev[-1])
        for direction in ("forward", "backward"):
            base = None
            if not config.gpu:
                base = f"{op} {direction} numpy loop"
                if direction == "forward":
                    base_fn = lambda loop=loop_fwd, a=inputs: loop(*a)  # noqa: E731
                else:
                    states = loop_fwd(*inputs)[2]
                    params = inputs[:-1]
                    base_fn = (lambda loop=loop_bwd, p=params, s=states, d=dout,
                               z=np.zeros_like(inputs[-1]): loop(*p, s, d, z))
                info = {"shape": dims}
                yield Case("scan", base, fn=_timed(base_fn, info, tokens), info=info,
                           flops=tokens * nh * flops[direction],
                           check=_check_loops if direction == "forward" and op == "gated_delta"
                           else None)
            if direction == "forward":
                def fast(f=forward, a=dev):
                    with _forced(backend):
                        f(*a[:-1], initial_state=a[-1])
            else:
                def fast(b=backward, d=dout_dev, c=ctx):
                    with _forced(backend):
                        b(d, None, c)
            info = {"shape": dims}
            yield Case("scan", f"{op} {direction} {label}", fn=_timed(fast, info, tokens, sync),
                       check=lambda c=check: c(xp, backend), baseline=base,
                       target=None if config.gpu else TARGET, info=info,
                       flops=tokens * nh * flops[direction])
        if op == "gated_delta" and not config.gpu and backend in (None, "numba"):
            yield from _chunked_cases(inputs, dout, tokens,
                                      {d: tokens * nh * f for d, f in flops.items()}, dims)
