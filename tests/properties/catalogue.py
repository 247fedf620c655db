"""One small forward-and-backward call of every public op, for the cross-cutting tests.

``tests/test_concurrency.py``, ``tests/test_determinism.py`` and ``tests/test_memory_bounds.py``
run these: each entry of ``CALLS`` builds its inputs once (seeded, shapes small enough for
cudasim) and returns a function that runs the op under whatever backend is forced and returns
every output array (forward and gradients) as a flat list. ``SIZES`` scales the shapes up for the
numba-only checks (more than one parallel chunk).
"""

from __future__ import annotations

import numpy as np

import lowbit


def _rng(name):
    return np.random.default_rng(sum(map(ord, name)))


def _matmul(s):
    rng = _rng("matmul")
    x = rng.standard_normal((3 * s, 37 * s)).astype(np.float32)
    w = rng.standard_normal((37 * s, 5 * s)).astype(np.float32)
    dy = rng.standard_normal((3 * s, 5 * s)).astype(np.float32)

    def run():
        pw = lowbit.quantize_weight(w, "ternary")
        y, ctx = lowbit.linear_forward(x, w, "ternary", "int8")
        return [pw.data, pw.scale, lowbit.packed_matmul(x, pw, None), y,
                *lowbit.linear_backward(dy, ctx)]

    return run


def _bits(s):
    rng = _rng("bits")
    codes = rng.integers(0, 4, (5 * s, 37 * s))
    x = rng.standard_normal((5 * s, 300 * s)).astype(np.float32)

    def run():
        packed = lowbit.pack_bits(codes, 2)
        act = lowbit.pack_activation(x, "int4", rounding="stochastic", seed=3)
        sparse = lowbit.pack_activation(np.maximum(x, 0), "sparse", kind="nonneg")
        return [packed, lowbit.unpack_bits(packed, 2, codes.shape[1]), *act.arrays.values(),
                act.unpack(), sparse.unpack()]

    return run


def _attention(s):
    rng = _rng("attention")
    T = 7 * s
    q, k, v, dout = (rng.standard_normal((T, 2, 4)).astype(np.float32) for _ in range(4))
    lengths = [1, 2 * s, T - 2 * s - 1]

    def run():
        out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths, causal=True)
        return [out, *lowbit.segmented_attention_backward(dout, ctx),
                lowbit.expand_heads(k, 1, 4), lowbit.expand_heads_backward(dout, 1, 1)]

    return run


def _delta(s):
    rng = _rng("delta")
    q, k = (rng.standard_normal((1, 5 * s, 2, 3)) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, dout = (rng.standard_normal((1, 5 * s, 2, 2)) for _ in range(2))
    decay, beta = -rng.uniform(0, 0.5, (1, 5 * s, 2)), rng.uniform(0, 1, (1, 5 * s, 2))

    def run():
        out, state, ctx = lowbit.gated_delta_scan_forward(q, k, v, decay, beta, chunk_size=2)
        return [out, state, *(g for g in lowbit.gated_delta_scan_backward(dout, None, ctx)
                              if g is not None)]

    return run


def _selective(s):
    rng = _rng("selective")
    x, dout = (rng.standard_normal((1, 5 * s, 2, 3)) for _ in range(2))
    B, C = (rng.standard_normal((1, 5 * s, 2, 2)) for _ in range(2))
    dt = rng.standard_normal((1, 5 * s, 2))
    per_head = [rng.standard_normal(2) * 0.5 for _ in range(3)]

    def run():
        out, state, ctx = lowbit.selective_scan_forward(x, B, C, dt, *per_head, chunk_size=2)
        return [out, state, *(g for g in lowbit.selective_scan_backward(dout, None, ctx)
                              if g is not None)]

    return run


def _lowrank(s):
    rng = _rng("lowrank")
    T, D, H, N = 5 * s, 4, 2, 6
    current = rng.standard_normal((1, T, D)).astype(np.float32)
    enc, enc_v = ((rng.standard_normal((H, D, N)) / 2).astype(np.float32) for _ in range(2))
    dec = (rng.standard_normal((H * N, D)) / 3).astype(np.float32)
    dnext = rng.standard_normal((1, T, D)).astype(np.float32)
    plan = lowbit.LowBitPlan(x=("ternary", "int8"))

    def run():
        out, ctx = lowbit.lowrank_residual_forward(current, enc, enc_v, dec, plan=plan,
                                                   dropout=0.25, seed=5)
        return [out, *lowbit.lowrank_residual_backward(dnext, ctx)]

    return run


def _training(s):
    rng = _rng("training")
    table = rng.standard_normal((11, 8 * s)).astype(np.float32)
    ids = rng.integers(0, 11, (3, 5 * s))
    logits = rng.standard_normal((3, 5 * s, 11)).astype(np.float32)
    dout = rng.standard_normal((3, 5 * s, 8 * s)).astype(np.float32)
    params = {"a": rng.standard_normal((7, 8 * s)).astype(np.float32),
              "b": rng.standard_normal(13 * s).astype(np.float32)}
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}

    def run():
        emb, ectx = lowbit.embedding_forward(table, ids)
        loss, cctx = lowbit.cross_entropy_forward(logits, ids)
        y, lctx = lowbit.layer_norm_forward(emb)
        work = {k: v.copy() for k, v in params.items()}
        opt = lowbit.AdamW(lr=1e-2, max_grad_norm=1.0)
        opt.step(work, grads)
        return [emb, lowbit.embedding_backward(dout, ectx), loss,
                lowbit.cross_entropy_backward(1.0, cctx), y, lowbit.layer_norm_backward(dout, lctx),
                work["a"], work["b"]]

    return run


def _rotary(s):
    rng = _rng("rotary")
    x = rng.standard_normal((5 * s, 3, 16)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    positions = rng.integers(0, 100000, 5 * s)

    def run():
        y, ctx = lowbit.rotary_forward(x, positions, style="interleaved")
        return [y, lowbit.rotary_backward(dy, ctx), lowbit.rotary(x, positions)]

    return run


def _rms_norm(s):
    rng = _rng("rms_norm")
    x = rng.standard_normal((5 * s, 3, 37)).astype(np.float32)
    weight = rng.standard_normal(37).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)

    def run():
        y, ctx = lowbit.rms_norm_forward(x, weight)
        return [y, *lowbit.rms_norm_backward(dy, ctx), lowbit.rms_norm(x, weight)]

    return run


BUILDERS = {"matmul": _matmul, "bits": _bits, "attention": _attention, "delta": _delta,
            "selective": _selective, "lowrank": _lowrank, "training": _training,
            "rotary": _rotary, "rms_norm": _rms_norm}


def calls(scale: int = 1) -> dict:
    """``{family: run}`` for every op family at shapes scaled by ``scale`` (1: cudasim-sized)."""
    return {name: build(scale) for name, build in BUILDERS.items()}


def run_all(runs: dict) -> dict:
    """``{family: [arrays]}`` from one call of each ``run``."""
    return {name: [np.array(a, copy=True) for a in run()] for name, run in runs.items()}


def assert_bitwise(label, want: dict, got: dict):
    """Every array of every family equal bit for bit (NaNs by bit pattern)."""
    for name in want:
        assert len(want[name]) == len(got[name]), f"{label} {name}: output count"
        for i, (a, b) in enumerate(zip(want[name], got[name])):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{label} {name}[{i}]"
            assert a.tobytes() == b.tobytes(), f"{label} {name}[{i}] differs"
