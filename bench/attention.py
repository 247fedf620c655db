"""Suite ``attention``: segmented attention forward and backward against per-segment NumPy.

Op: ``lowbit/ops/segmented_attention``; reference: ``reference/segmented_attention.py``. Rows
(CPU, float32, T = 8192 in seeded segments of 512 to 2048 tokens, H = 8, D = Dv = 64; ``--quick``
shrinks it to T = 1024 in segments of 64 to 256):

- what a user would write: NumPy per segment (batched over heads: matmul, softmax, matmul), and
  its backward from the probabilities it kept (matmuls and the softmax Jacobian);
- lowbit's numba forward (target 4x the NumPy forward) and backward (target 3x), with GFLOP/s by
  FlashAttention's count (forward ``4 * sum(L**2) * H * D``, backward 2.5x that) and the bytes of
  what each side keeps for its backward (the NumPy side holds every ``L x L`` probability);
- torch's CPU ``scaled_dot_product_attention`` per segment, forward and forward + backward, when
  torch is installed;
- the ceiling: one square NumPy float32 matmul (BLAS sgemm near this CPU's FMA peak) with the
  FLOPs of the forward, and one with those of the backward, each against the NumPy baseline. No
  exact fp32 attention can beat these ratios by much: they bound what the targets can reach on
  the machine that runs the suite.

With ``--gpu``: the cuda backend at T = 65536 (TFLOP/s = GFLOP/s / 1000 in the table).
Numba runs with 2 threads (or fewer where fewer exist); the table prints the counts.
"""

from __future__ import annotations

import contextlib

import numpy as np

import lowbit
from lowbit.reference.segmented_attention import (segmented_attention_bwd_ref,
                                                  segmented_attention_ref)

from ._harness import Case, Config

SUITE = "attention"
THREADS = 2


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _lengths(rng, tokens, low, high):
    """Seeded segment lengths in [low, high] summing to ``tokens``; the last absorbs the rest."""
    lengths = []
    while tokens - sum(lengths) > high:
        lengths.append(int(rng.integers(low, high + 1)))
    rest = tokens - sum(lengths)
    if rest < low and lengths:
        lengths[-1] += rest
    else:
        lengths.append(rest)
    return lengths


def _check(xp, backend, causal):
    """The timed path on a small shape against the float64 reference, forward and backward."""
    rng = np.random.default_rng(2)
    lengths = [70, 1, 129]
    q, k, v, dout = (rng.standard_normal((200, h, 64)).astype(np.float32) for h in (4, 2, 2, 4))
    with _maybe(backend):
        out, ctx = lowbit.segmented_attention_forward(xp.asarray(q), xp.asarray(k),
                                                      xp.asarray(v), lengths, causal=causal)
        grads = lowbit.segmented_attention_backward(xp.asarray(dout), ctx)
    ref_out, _ = segmented_attention_ref(q, k, v, lengths, causal=causal)
    np.testing.assert_allclose(_host(out), ref_out, rtol=1e-4, atol=1e-4)
    for got, ref in zip(grads, segmented_attention_bwd_ref(dout, q, k, v, lengths, causal=causal)):
        np.testing.assert_allclose(_host(got), ref, rtol=1e-4, atol=1e-4)


class _NumpyPerSegment:
    """The plain NumPy a user would write: one batched softmax attention per segment."""

    def __init__(self, q, k, v, offsets, scale):
        self.q, self.k, self.v, self.offsets, self.scale = q, k, v, offsets, np.float32(scale)
        self.probs = []

    def _heads(self, x, s0, s1):
        return x[s0:s1].transpose(1, 0, 2)

    def forward(self):
        out = np.empty((self.q.shape[0], self.q.shape[1], self.v.shape[2]), np.float32)
        self.probs = []
        for s0, s1 in zip(self.offsets[:-1], self.offsets[1:]):
            q, k, v = (self._heads(x, s0, s1) for x in (self.q, self.k, self.v))
            s = q @ k.transpose(0, 2, 1) * self.scale
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            self.probs.append(p)
            out[s0:s1] = (p @ v).transpose(1, 0, 2)
        return out

    def backward(self, dout):
        grads = [np.empty_like(x) for x in (self.q, self.k, self.v)]
        for p, s0, s1 in zip(self.probs, self.offsets[:-1], self.offsets[1:]):
            q, k, v, do = (self._heads(x, s0, s1) for x in (self.q, self.k, self.v, dout))
            dv = p.transpose(0, 2, 1) @ do
            dp = do @ v.transpose(0, 2, 1)
            ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * self.scale
            for grad, value in zip(grads, (ds @ k, ds.transpose(0, 2, 1) @ q, dv)):
                grad[s0:s1] = value.transpose(1, 0, 2)
        return grads


def _torch_cases(q, k, v, dout, offsets, fwd_flops, baselines):
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(THREADS)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    tq, tk, tv, tdo = (torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))
                       for x in (q, k, v, dout))
    bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))

    def forward():
        with torch.no_grad():
            return [sdpa(tq[:, a:b], tk[:, a:b], tv[:, a:b]) for a, b in bounds]

    def forward_backward():
        for a, b in bounds:
            xs = [t[:, a:b].clone().requires_grad_() for t in (tq, tk, tv)]
            sdpa(*xs).backward(tdo[:, a:b])

    info = {"threads": torch.get_num_threads()}
    yield Case(SUITE, "fwd torch sdpa", fn=forward, baseline=baselines[0], flops=fwd_flops,
               info=info)
    yield Case(SUITE, "fwd+bwd torch sdpa", fn=forward_backward, baseline=baselines[1],
               flops=3.5 * fwd_flops, info=info)


def cases(config: Config):
    rng = np.random.default_rng(0)
    if config.gpu:
        import cupy as xp

        tokens, low, high = 65536, 512, 2048
    else:
        xp = np
        tokens, low, high = (1024, 64, 256) if config.quick else (8192, 512, 2048)
    heads, dim = 8, 64
    lengths = _lengths(rng, tokens, low, high)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    q, k, v, dout = (rng.standard_normal((tokens, heads, dim)).astype(np.float32)
                     for _ in range(4))
    fwd_flops = 4.0 * sum(n * n for n in lengths) * heads * dim
    shape = {"T": tokens, "segments": len(lengths), "H": heads, "D": dim}
    backend = config.backend or ("cuda" if config.gpu else "numba")
    if not config.gpu:
        import numba

        numba.set_num_threads(min(THREADS, numba.config.NUMBA_NUM_THREADS))
        shape["numba_threads"] = numba.get_num_threads()
    dq, dk, dv_ = (xp.asarray(x) for x in (q, k, v))
    ddout = xp.asarray(dout)

    if config.gpu:
        for causal in (False, True):
            tag = " causal" if causal else ""
            flops = fwd_flops / (2 if causal else 1)
            with _maybe(backend):
                _, cctx = lowbit.segmented_attention_forward(dq, dk, dv_, lengths, causal=causal)

            def fwd(c=causal):
                with _maybe(backend):
                    lowbit.segmented_attention_forward(dq, dk, dv_, lengths, causal=c)

            def bwd(c=cctx):
                with _maybe(backend):
                    lowbit.segmented_attention_backward(ddout, c)

            yield Case(SUITE, f"fwd {backend}{tag}", fn=fwd,
                       check=lambda c=causal: _check(xp, backend, c), flops=flops, info=shape)
            yield Case(SUITE, f"bwd {backend}{tag}", fn=bwd, flops=2.5 * flops, info=shape)
        return

    def run_forward():
        with _maybe(backend):
            return lowbit.segmented_attention_forward(dq, dk, dv_, lengths)

    _, ctx = run_forward()

    def run_backward():
        with _maybe(backend):
            return lowbit.segmented_attention_backward(ddout, ctx)

    user = _NumpyPerSegment(q, k, v, offsets, 1.0 / np.sqrt(dim))
    user.forward()
    square_bytes = sum(p.nbytes for p in user.probs)
    yield Case(SUITE, "fwd numpy per-segment", fn=user.forward, flops=fwd_flops,
               info={**shape, "saved_MB": (square_bytes + 4 * q.nbytes) / 2**20})
    yield Case(SUITE, f"fwd {backend}", fn=run_forward, check=lambda: _check(xp, backend, False),
               baseline="fwd numpy per-segment", target=4.0, flops=fwd_flops,
               info={**shape, "saved_MB": ctx.nbytes / 2**20})
    yield Case(SUITE, "bwd numpy per-segment", fn=lambda: user.backward(dout),
               flops=2.5 * fwd_flops, info=shape)
    yield Case(SUITE, f"bwd {backend}", fn=run_backward, check=lambda: _check(xp, backend, True),
               baseline="bwd numpy per-segment", target=3.0, flops=2.5 * fwd_flops, info=shape)
    yield Case(SUITE, "fwd+bwd numpy per-segment",
               fn=lambda: (user.forward(), user.backward(dout)), flops=3.5 * fwd_flops,
               info=shape)
    def run_both():
        with _maybe(backend):
            return lowbit.segmented_attention_backward(ddout, run_forward()[1])

    yield Case(SUITE, f"fwd+bwd {backend}", fn=run_both,
               baseline="fwd+bwd numpy per-segment", flops=3.5 * fwd_flops, info=shape)
    yield from _torch_cases(q, k, v, dout, offsets, fwd_flops,
                            ("fwd numpy per-segment", "fwd+bwd numpy per-segment"))
    for step, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
        n = round((flops / 2) ** (1 / 3))
        a, b = (np.random.default_rng(3).standard_normal((n, n)).astype(np.float32)
                for _ in range(2))
        yield Case(SUITE, f"{step} FLOPs as one sgemm (ceiling)", fn=lambda a=a, b=b: a @ b,
                   baseline=f"{step} numpy per-segment", flops=2.0 * n**3,
                   info={"shape": f"{n}x{n}x{n}"})
