"""Block-sparse latent patterns of the low-rank residual layer (``lowbit.BlockPattern``): every
backend against the float64 reference with a latent mask, finite differences on the reference,
the dense pattern equal to none, and validation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_equal, lowrank_inputs, numerical_grad, to_numpy

import lowbit
from lowbit.reference.lowrank_residual import (block_mask_ref, lowrank_residual_bwd_ref,
                                               lowrank_residual_ref)


_layer = lowrank_inputs


# -- the pattern object ----------------------------------------------------------------------------

def test_pattern_is_frozen_hashable_printable():
    p = lowbit.BlockPattern(4, np.array([True, False, True]))
    q = lowbit.BlockPattern(4, [True, False, True])
    assert p == q and hash(p) == hash(q) and len({p, q}) == 1
    assert p != lowbit.BlockPattern(4, [True, True, True]) != lowbit.BlockPattern.dense(4)
    assert repr(p) == "BlockPattern(block_size=4, active='101')"
    assert repr(lowbit.BlockPattern(2, [[True], [False]])) == (
        "BlockPattern(block_size=2, active='1/0')")
    assert repr(lowbit.BlockPattern.dense(8)) == "BlockPattern.dense(8)"
    with pytest.raises(AttributeError):
        p.block_size = 2
    with pytest.raises(ValueError):
        p.active[0] = False  # read-only
    source = np.array([True, False])
    r = lowbit.BlockPattern(2, source)
    source[0] = False
    assert r.active[0]  # a copy


def test_from_mask_marks_blocks_holding_a_set_neuron():
    mask = np.zeros(10, dtype=bool)
    mask[[1, 9]] = True
    p = lowbit.BlockPattern.from_mask(mask, 4)  # blocks [0:4], [4:8], [8:10]
    assert p == lowbit.BlockPattern(4, [True, False, True])
    per_head = lowbit.BlockPattern.from_mask(np.array([[True, False], [False, False]]), 1)
    assert per_head == lowbit.BlockPattern(1, [[True, False], [False, False]])


@pytest.mark.parametrize("args,exc,match", [
    ((0, None), ValueError, "block_size"),
    ((2.5, None), TypeError, "block_size"),
    ((2, [1, 0]), TypeError, "active"),
    ((2, np.zeros((2, 2, 2), bool)), ValueError, "active"),
    ((2, np.zeros(0, bool)), ValueError, "active"),
])
def test_bad_pattern(args, exc, match):
    with pytest.raises(exc, match=match):
        lowbit.BlockPattern(*args)


def test_bad_mask():
    with pytest.raises(TypeError, match="mask"):
        lowbit.BlockPattern.from_mask(np.ones(4), 2)


# -- the layer against the reference ---------------------------------------------------------------

def _mask(pattern, H, N):
    return block_mask_ref(pattern.block_size, pattern.active, H, N)


def test_reference_with_a_pattern_matches_finite_differences(rng):
    B, T, D, H, N = 1, 5, 3, 2, 6
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N, np.float64)
    mask = _mask(lowbit.BlockPattern(2, [[True, False, True], [False, True, False]]), H, N)
    weights = rng.standard_normal((B, T, D))
    kwargs = dict(relu_threshold=0.05, latent_mask=mask)

    def loss(cur, enc, encv, dec):
        return float((lowrank_residual_ref(cur, enc, encv, dec, **kwargs) * weights).sum())

    grads = lowrank_residual_bwd_ref(weights, current, encoder, encoder_v, decoder, **kwargs)
    args = [current, encoder, encoder_v, decoder]
    for i, name in enumerate(("dcurrent", "dencoder", "dencoder_v", "ddecoder")):
        assert_close(name, numerical_grad(lambda: loss(*args), args[i]), grads[i], rtol=1e-5)
    assert not grads[1][0][:, ~mask[0]].any() and not grads[3][N:N + 2].any()


#: (block_size, active, N): one active block; every other block; a partial last block; per-head
#: patterns, one head without any active block.
PATTERNS = [
    (4, [False, True, False], 12),
    (2, [True, False, True, False, True], 10),
    (4, [True, False, True], 10),
    (2, [[True, False, False], [False, False, False]], 6),
    (2, [[False, True, True, False], [True, False, False, True]], 8),
    (8, [True, False, True], 20),  # blocks on byte boundaries of the packed codes, partial last
]


@pytest.mark.parametrize("block,active,N", PATTERNS)
@pytest.mark.parametrize("plan", [None, lowbit.LowBitPlan.uniform("ternary", "int8")],
                         ids=["fp32", "ternary"])
def test_pattern_matches_reference(backend, rng, block, active, N, plan):
    B, T, D, H = (2, 13, 6, 2) if backend.name != "cudasim" else (1, 5, 4, 2)
    pattern = lowbit.BlockPattern(block, np.array(active))
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    dnext = rng.standard_normal((B, T, D)).astype(np.float32)
    args = [backend.to(a) for a in (current, encoder, encoder_v, decoder)]
    kwargs = dict(plan=plan, relu_threshold=-0.05, dropout=0.25, seed=4, lengths=[T - 3, 3])
    out, ctx = lowbit.lowrank_residual_forward(*args, latent_pattern=pattern, **kwargs)
    grads = lowbit.lowrank_residual_backward(backend.to(dnext), ctx)
    mask = _mask(pattern, H, N)
    ref = lowrank_residual_ref(current, encoder, encoder_v, decoder, latent_mask=mask, **kwargs)
    ref_grads = lowrank_residual_bwd_ref(dnext, current, encoder, encoder_v, decoder,
                                         latent_mask=mask, **kwargs)
    rtol = 2e-5 if plan is None else 1e-4
    assert_close("next", ref, out, rtol=rtol)
    assert_equal("inference", to_numpy(out), to_numpy(lowbit.lowrank_residual(
        *args, latent_pattern=pattern, **kwargs)))
    for name, r, g in zip(("dcurrent", "dencoder", "dencoder_v", "ddecoder"), ref_grads, grads):
        assert_close(name, r, g, rtol=10 * rtol)
    dec_off = np.repeat(~mask.reshape(-1)[:, None], D, axis=1)
    assert not to_numpy(grads[1]).transpose(0, 2, 1)[~mask].any()
    assert not to_numpy(grads[2]).transpose(0, 2, 1)[~mask].any()
    assert not to_numpy(grads[3])[dec_off].any()


@pytest.mark.parametrize("attention", ["causal_linear", "segmented"])
def test_dense_pattern_is_no_pattern_bitwise(backend, rng, attention):
    B, T, D, H, N = (2, 9, 6, 2, 10) if backend.name != "cudasim" else (1, 5, 4, 2, 6)
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    dnext = backend.to(rng.standard_normal((B, T, D)).astype(np.float32))
    args = [backend.to(a) for a in (current, encoder, encoder_v, decoder)]
    kwargs = dict(attention=attention, dropout=0.2, seed=1, saved="sparse")
    out, ctx = lowbit.lowrank_residual_forward(*args, **kwargs)
    grads = lowbit.lowrank_residual_backward(dnext, ctx)
    for pattern in (lowbit.BlockPattern.dense(4), lowbit.BlockPattern(4, [True] * -(-N // 4))):
        out2, ctx2 = lowbit.lowrank_residual_forward(*args, latent_pattern=pattern, **kwargs)
        assert_equal("next", to_numpy(out), to_numpy(out2))
        assert ctx2.nbytes == ctx.nbytes
        for name, a, b in zip(("dcurrent", "dencoder", "dencoder_v", "ddecoder"), grads,
                              lowbit.lowrank_residual_backward(dnext, ctx2)):
            assert_equal(name, to_numpy(a), to_numpy(b))


@pytest.mark.parametrize("attention", ["causal_linear", "segmented"])
def test_recomputed_attention_output_is_the_kept_one_bitwise(backend, rng, monkeypatch,
                                                              attention):
    """Under a pattern that leaves a head at most D active neurons (head 0 here; head 1 keeps
    more) the ctx keeps no attention output ``a`` of it (segmented: of no head): the backward's
    recompute gives the bits a kept ``a`` gives, and the ctx is smaller by exactly the float32
    ``a`` of each such head."""
    from lowbit.ops.lowrank_residual import _layer as layer_math

    B, T, D, H, N = (2, 11, 6, 2, 12) if backend.name != "cudasim" else (1, 5, 4, 2, 8)
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    dnext = backend.to(rng.standard_normal((B, T, D)).astype(np.float32))
    args = [backend.to(a) for a in (current, encoder, encoder_v, decoder)]
    pattern = lowbit.BlockPattern(2, [np.arange(N // 2) % 3 == 1, np.arange(N // 2) % 3 != 1])
    recomputed = [True, attention == "segmented"]  # widths N / 3 <= D and 2 N / 3 > D
    kwargs = dict(attention=attention, latent_pattern=pattern, relu_threshold=0.05,
                  plan=lowbit.LowBitPlan.uniform("ternary", "int8"), dropout=0.2, seed=4)
    out, ctx = lowbit.lowrank_residual_forward(*args, **kwargs)
    assert [a is None for a in ctx.attn] == recomputed
    grads = lowbit.lowrank_residual_backward(dnext, ctx)
    monkeypatch.setattr(layer_math, "keeps_attention", lambda *args: True)
    kept_out, kept = lowbit.lowrank_residual_forward(*args, **kwargs)
    assert all(a is not None for a in kept.attn)
    assert_equal("next", to_numpy(kept_out), to_numpy(out))
    assert kept.nbytes - ctx.nbytes == sum(recomputed) * B * T * D * 4
    for name, a, b in zip(("dcurrent", "dencoder", "dencoder_v", "ddecoder"), grads,
                          lowbit.lowrank_residual_backward(dnext, kept)):
        assert_equal(name, to_numpy(b), to_numpy(a))


@pytest.mark.parametrize("plan,saved", [(lowbit.LowBitPlan.uniform("ternary", "int8"), None),
                                        (None, "sparse")], ids=["ternary-exact", "fp32-sparse"])
def test_saved_bytes_shrink_with_the_active_fraction(rng, plan, saved):
    """The latent tensors (x_neuron, y_gate) are held for the active quarter only."""
    B, T, D, H, N = 2, 16, 8, 2, 256
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    _, dense = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder, plan=plan,
                                               saved=saved)
    quarter = lowbit.BlockPattern(64, [True, False, False, False])
    _, ctx = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder, plan=plan,
                                             saved=saved, latent_pattern=quarter)
    rows = {r.name: r for r in lowbit.memory_report(ctx).rows}
    assert rows["LowrankResidualCtx.x_neuron[0]"].shape == (B, T, N // 4)
    latent = [r for r in lowbit.memory_report(dense).rows if "x_neuron" in r.name or
              "y_gate" in r.name]
    shrink = sum(r.nbytes for r in latent) * 3 / 4
    assert ctx.nbytes <= dense.nbytes - 0.9 * shrink


def test_segmented_attention_keeps_the_full_width_scale(rng):
    """The softmax scale is 1 / sqrt(N) of the whole head, whatever is active."""
    current, encoder, encoder_v, decoder = _layer(rng, 1, 7, 4, 1, 6)
    pattern = lowbit.BlockPattern(3, [True, False])
    out = lowbit.lowrank_residual(current, encoder, encoder_v, decoder, attention="segmented",
                                  latent_pattern=pattern)
    ref = lowrank_residual_ref(current, encoder, encoder_v, decoder, attention="segmented",
                               latent_mask=_mask(pattern, 1, 6))
    assert_close("next", ref, out, rtol=2e-5)


@pytest.mark.parametrize("pattern,match", [
    (lowbit.BlockPattern(4, [True, False]), "blocks"),
    (lowbit.BlockPattern(4, [[True, False, True]] * 3), "heads"),
    (lowbit.BlockPattern(3, [True, False, True, False]), "even"),
    (np.ones(3, bool), "latent_pattern"),
])
def test_bad_latent_pattern_names_the_argument(never_runs, rng, pattern, match):
    current, encoder, encoder_v, decoder = _layer(rng, 1, 5, 4, 2, 10)
    exc = TypeError if isinstance(pattern, np.ndarray) else ValueError
    with pytest.raises(exc, match=match):
        lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder,
                                        latent_pattern=pattern)


@pytest.mark.parametrize("format", ["ternary", "sign", "int8"])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25],
                                  [2, 3, 4, 5, 17], [16, 17, 18, 19, 20, 21, 22, 23]],
                         ids=["aligned-runs", "unaligned", "one-run"])
def test_gather_rows_keeps_codes_and_scale(rng, format, rows):
    # Byte-aligned runs are gathered as bytes, others re-packed: both must hold the codes of
    # the chosen rows with the whole tensor's scale.
    from lowbit.ops.lowrank_residual._pattern import gather_rows

    w = rng.standard_normal((26, 5)).astype(np.float32)
    pw = lowbit.quantize_weight(w, format)
    rows = np.array(rows, np.int64)
    got = gather_rows(pw, rows)
    assert got.shape == (len(rows), 5) and got.format == format
    assert_equal("codes", pw.codes()[rows], got.codes())
    assert_equal("scale", pw.scale, got.scale)


def test_scatter_add_by_runs_and_by_gather(rng, monkeypatch):
    from lowbit.ops.lowrank_residual import _layer_backward

    index = np.array([1, 2, 3, 7, 8, 12], np.int64)
    dw = rng.standard_normal((len(index), 3)).astype(np.float32)
    base = rng.standard_normal((14, 3)).astype(np.float32)
    expected = base.copy()
    for i, r in enumerate(index):
        expected[r] += dw[i]
    for max_runs in (64, 1):  # runs added as slices, or (too many runs) one gather
        monkeypatch.setattr(_layer_backward, "MAX_RUNS", max_runs)
        grad = base.copy()
        _layer_backward._scatter_add(grad, index, dw)
        assert_equal(f"max_runs={max_runs}", expected, grad)
