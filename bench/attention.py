"""Suite ``attention``: segmented attention forward and backward against per-segment NumPy.

Op: ``lowbit/ops/segmented_attention``; reference: ``reference/segmented_attention.py``. Rows
(CPU, float32, T = 8192 in seeded segments of 512 to 2048 tokens, H = 8, D = Dv = 64; ``--quick``
shrinks it to T = 1024 in segments of 64 to 256):

- what a user would write: NumPy per segment (batched over heads: matmul, softmax, matmul), and
  its backward from the probabilities it kept (matmuls and the softmax Jacobian);
- lowbit's numba forward (target 4x the NumPy forward) and backward (target 3x), with GFLOP/s by
  FlashAttention's count (forward ``4 * sum(L**2) * H * D``, backward 2.5x that) and the bytes of
  what each side keeps for its backward (the NumPy side holds every ``L x L`` probability);
- the ceiling: one square NumPy float32 matmul (BLAS sgemm near this CPU's FMA peak) with the
  FLOPs of the forward, one with those of the backward and one with those of both, each against
  the NumPy baseline; lowbit's forward and forward + backward against the sgemm of the same
  FLOPs, target ``CEILING_SHARE`` (60%) of its GFLOP/s;
- the peer, when torch is installed: torch's CPU ``scaled_dot_product_attention`` as its users
  run variable-length segments (``_TorchPerSegment``: one call per segment on contiguous
  ``[1, H, L, D]`` tensors built before the clock, torch's threads pinned to Numba's, checked
  against the reference first), forward and forward + backward, full and causal; each row is
  followed by lowbit's same step timed again right after it, target 1.0 (as fast as torch).

- a decode step (no peer): one query per sequence against its KV cache through ``k_lengths``
  (``DECODE``: BitNet b1.58 2B's H = 20, Hkv = 5, D = 128, S = 1, a 1024-token cache), causal,
  with GFLOP/s and the GB/s of reading the cache.

With ``--gpu``: the cuda backend at T = 65536 (TFLOP/s = GFLOP/s / 1000 in the table).
Numba runs with 2 threads (or fewer where fewer exist); the table prints the counts.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

import lowbit
from lowbit.reference.segmented_attention import (segmented_attention_bwd_ref,
                                                  segmented_attention_ref)

from ._harness import Case, Config

SUITE = "attention"
THREADS = 2
#: The floor for exact attention: this share of one square sgemm's GFLOP/s.
CEILING_SHARE = 0.6


#: The decode row: sequences, cached keys each, query heads, key/value heads, head dimension.
DECODE = {"S": 1, "Lk": 1024, "H": 20, "Hkv": 5, "D": 128}


def _check_decode(backend):
    """The decode path on a small shape (two sequences) against the float64 reference."""
    rng = np.random.default_rng(4)
    lengths, k_lengths = [1, 1], [300, 17]
    q = rng.standard_normal((2, 20, 128)).astype(np.float32)
    k, v = (rng.standard_normal((317, 5, 128)).astype(np.float32) for _ in range(2))
    with _maybe(backend):
        out = lowbit.segmented_attention(q, k, v, lengths, k_lengths=k_lengths, causal=True)
    ref, _ = segmented_attention_ref(q, k, v, lengths, causal=True, k_lengths=k_lengths)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def _decode_case(backend):
    rng = np.random.default_rng(5)
    s, keys, heads, kv_heads, dim = (DECODE[n] for n in ("S", "Lk", "H", "Hkv", "D"))
    q = rng.standard_normal((s, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((s * keys, kv_heads, dim)).astype(np.float32) for _ in range(2))

    def step():
        with _maybe(backend):
            return lowbit.segmented_attention(q, k, v, [1] * s, k_lengths=[keys] * s, causal=True)

    return Case(SUITE, f"decode {backend}", fn=step, check=lambda: _check_decode(backend),
                flops=4.0 * s * heads * keys * dim, nbytes=k.nbytes + v.nbytes, info=DECODE)


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


class _TorchPerSegment:
    """torch's SDPA as its users run variable-length segments on CPU: one call per segment.

    Inputs are built before the clock: per segment, contiguous ``[1, H, L, D]`` tensors (and,
    for the backward, leaves that require grad). The other form, one call over all ``T`` tokens
    with a block-diagonal boolean mask, computes every ``T x T`` score: measured 13x slower at
    the bench shape (6 segments), so it is not the peer.
    """

    def __init__(self, torch, q, k, v, dout, offsets, causal):
        self.torch, self.causal = torch, causal
        bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))

        def per_segment(x):
            return [torch.from_numpy(np.ascontiguousarray(x[a:b].transpose(1, 0, 2)))[None]
                    for a, b in bounds]

        self.q, self.k, self.v, self.dout = (per_segment(x) for x in (q, k, v, dout))
        self.leaves = [[t.clone().requires_grad_() for t in qkv]
                       for qkv in zip(self.q, self.k, self.v)]
        self.sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward(self):
        with self.torch.no_grad():
            return [self.sdpa(q, k, v, is_causal=self.causal)
                    for q, k, v in zip(self.q, self.k, self.v)]

    def forward_backward(self):
        for leaves, dout in zip(self.leaves, self.dout):
            for t in leaves:
                t.grad = None
            self.sdpa(*leaves, is_causal=self.causal).backward(dout)
        return [[t.grad for t in leaves] for leaves in self.leaves]

    @staticmethod
    def tokens_major(parts):
        """Per-segment ``[1, H, L, D]`` tensors -> one ``[T, H, D]`` float64 array."""
        return np.concatenate([p[0].numpy().transpose(1, 0, 2) for p in parts]).astype(np.float64)


def _openmp(torch):
    """Which OpenMP runtime torch runs on: its own, or one loaded before it.

    Once Numba's ``omp`` threading layer has started (``numba.get_num_threads()`` starts it),
    torch imported afterwards binds to that system ``libgomp`` and its SDPA runs 5-7x slower
    (measured on this suite's shape), so a torch row timed that way would flatter lowbit.
    ``torch`` must be imported before Numba's threads start; this column shows whether it was.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return "unknown"
    own = os.path.dirname(torch.__file__)
    if not paths:
        return "none"
    # The runtime loaded first satisfies every later request for libgomp.so.1: torch's own
    # copy is mapped only when torch came first.
    return "torch's" if any(p.startswith(own) for p in paths) else "other (slowed)"


def _check_torch(torch, causal):
    """The timed torch path on a small shape against the float64 reference."""
    rng = np.random.default_rng(2)
    lengths = [70, 1, 129]
    q, k, v, dout = (rng.standard_normal((200, 4, 64)).astype(np.float32) for _ in range(4))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    peer = _TorchPerSegment(torch, q, k, v, dout, offsets, causal)
    ref_out, _ = segmented_attention_ref(q, k, v, lengths, causal=causal)
    np.testing.assert_allclose(peer.tokens_major(peer.forward()), ref_out, rtol=1e-4, atol=1e-4)
    grads = list(zip(*peer.forward_backward()))
    for got, ref in zip(grads, segmented_attention_bwd_ref(dout, q, k, v, lengths, causal=causal)):
        np.testing.assert_allclose(peer.tokens_major(got), ref, rtol=1e-4, atol=1e-4)


def _peer_cases(q, k, v, dout, offsets, fwd_flops, shape, backend, runs):
    """torch rows next to lowbit's, the sgemm ceilings, and the targets against both.

    ``runs[(step, causal)]`` is lowbit's timed call. Each target row times lowbit again right
    after its peer, so both see the same machine state. Each ceiling sgemm carries the FLOPs of
    its step, so the ceiling rows' time ratio is the share of the sgemm's GFLOP/s itself.
    """
    ceilings = {}
    step_flops = {"fwd": fwd_flops, "bwd": 2.5 * fwd_flops, "fwd+bwd": 3.5 * fwd_flops}
    for step, flops in step_flops.items():
        n = round((flops / 2) ** (1 / 3))
        a, b = (np.random.default_rng(3).standard_normal((n, n)).astype(np.float32)
                for _ in range(2))
        ceilings[step] = f"{step} FLOPs as one sgemm (ceiling)"
        yield Case(SUITE, ceilings[step], fn=lambda a=a, b=b: a @ b,
                   baseline=f"{step} numpy per-segment", flops=2.0 * n**3,
                   info={"shape": f"{n}x{n}x{n}"})
    # Against the sgemm with the same FLOPs, the time ratio is the share of its GFLOP/s (up to
    # the cube root's rounding of n, under 0.2% here).
    for step in ("fwd", "fwd+bwd"):
        yield Case(SUITE, f"{step} {backend} vs ceiling", fn=runs[(step, False)],
                   baseline=ceilings[step], target=CEILING_SHARE, flops=step_flops[step],
                   info={**shape, "ceiling_share": CEILING_SHARE})
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(shape["numba_threads"])
    info = {**shape, "torch_threads": torch.get_num_threads(), "torch_openmp": _openmp(torch)}
    for causal in (False, True):
        tag = " causal" if causal else ""
        flops = fwd_flops / 2 if causal else fwd_flops
        peer = _TorchPerSegment(torch, q, k, v, dout, offsets, causal)
        for step, fn, step_flops in (("fwd", peer.forward, flops),
                                     ("fwd+bwd", peer.forward_backward, 3.5 * flops)):
            yield Case(SUITE, f"{step} torch sdpa{tag}", fn=fn, flops=step_flops, info=info,
                       check=lambda c=causal: _check_torch(torch, c))
            yield Case(SUITE, f"{step} {backend}{tag} vs torch", fn=runs[(step, causal)],
                       baseline=f"{step} torch sdpa{tag}", target=1.0, flops=step_flops,
                       info=info)


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

    def run_forward(causal=False):
        with _maybe(backend):
            return lowbit.segmented_attention_forward(dq, dk, dv_, lengths, causal=causal)

    def run_both(causal=False):
        with _maybe(backend):
            return lowbit.segmented_attention_backward(ddout, run_forward(causal)[1])

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
    yield Case(SUITE, f"fwd+bwd {backend}", fn=run_both,
               baseline="fwd+bwd numpy per-segment", flops=3.5 * fwd_flops, info=shape)
    yield _decode_case(backend)
    runs = {(step, causal): (lambda f=fn, c=causal: f(c))
            for step, fn in (("fwd", run_forward), ("fwd+bwd", run_both))
            for causal in (False, True)}
    yield from _peer_cases(q, k, v, dout, offsets, fwd_flops, shape, backend, runs)
