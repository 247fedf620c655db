"""Tests of the BDH low-rank residual layer (``lowbit/ops/lowrank_residual``).

Every backend against the float64 reference (``reference/lowrank_residual.py``), the reference
backward against central finite differences, saved-activation policies (gradient cosine against
fp32), low-bit plans, profiling, and one test per validation rule.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_equal, cosine, lowrank_inputs, numerical_grad, to_numpy

import lowbit
from lowbit import _dispatch
from lowbit.ops import lowrank_residual as lr
from lowbit.ops.lowrank_residual import _layer as layer_math
from lowbit.reference.lowrank_residual import (
    causal_linear_bwd_ref,
    causal_linear_ref,
    layer_norm_bwd_ref,
    layer_norm_ref,
    lowrank_residual_bwd_ref,
    lowrank_residual_ref,
)


_layer = lowrank_inputs


# -- the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["causal_linear", "segmented"])
@pytest.mark.parametrize("lengths", [None, [1, 2, 3]])
def test_reference_backward_matches_finite_differences(rng, attention, lengths):
    B, T, D, H, N = 2, 6, 4, 2, 5
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N, np.float64)
    weights = rng.standard_normal((B, T, D))
    kwargs = dict(attention=attention, lengths=lengths, relu_threshold=0.05, dropout=0.3, seed=7)

    def loss():
        return float((lowrank_residual_ref(current, encoder, encoder_v, decoder, **kwargs)
                      * weights).sum())

    grads = lowrank_residual_bwd_ref(weights, current, encoder, encoder_v, decoder, **kwargs)
    for name, x, g in zip(("dcurrent", "dencoder", "dencoder_v", "ddecoder"),
                          (current, encoder, encoder_v, decoder), grads):
        assert_close(name, numerical_grad(loss, x, 1e-6), g, rtol=1e-6)


# -- the backend pieces ----------------------------------------------------------------------------

@pytest.mark.parametrize("split", [False, True])
def test_causal_linear_attention_kernel(backend, rng, split):
    """Forward and both gradients; segments of several chunks (the numba kernel's CHUNK) and
    odd N."""
    _check_causal_linear(backend, rng, split, 5, 7)


@pytest.mark.parametrize("use_fma", [False, True])
def test_numba_causal_linear_kernel_paths(backend, rng, monkeypatch, use_fma):
    # float32 runs the FMA tiles where the CPU has them: force each path in turn, so that
    # the BLAS kernels are checked on every machine, and both with N and D past one 64-lane
    # panel and not a multiple of it (the tiles' padded lanes and columns).
    if backend.name != "numba":
        pytest.skip("the numba backend's kernel choice")
    from lowbit.ops.lowrank_residual import _numba
    from lowbit.ops.packed_matmul._numba import _fma

    if use_fma and not _fma.AVAILABLE:
        pytest.skip("the CPU has no FMA tiles (AVX-512, or AVX2 + FMA)")
    monkeypatch.setattr(_numba, "USE_FMA", use_fma)
    _check_causal_linear(backend, rng, True, 66, 70)


def _check_causal_linear(backend, rng, split, D, N):
    from lowbit.ops.lowrank_residual._numba import CHUNK

    lengths = [1, 1, CHUNK + 6, 3, 2 * CHUNK + 11] if split else None
    B, T = 2, 3 * CHUNK + 22
    if backend.name == "cudasim":  # one OS thread per CUDA thread: a few blocks only
        B, T, lengths = 1, 13, (None if lengths is None else [1, 1, 6, 3, 2])
    _, impl = _dispatch.resolve("lowrank_residual", backend.to(np.zeros(1, np.float32)))
    x = np.maximum(rng.standard_normal((B, T, N)), 0).astype(np.float32)
    v = rng.standard_normal((B, T, D)).astype(np.float32)
    da = rng.standard_normal((B, T, D)).astype(np.float32)
    xp = backend.xp
    starts = layer_math.starts(lr._lengths(lengths, T), xp)
    cos, sin = layer_math.rope_tables(T, N, xp)
    out = impl.causal_linear_forward(backend.to(x), backend.to(v), starts, cos, sin)
    dx, dv = impl.causal_linear_backward(backend.to(da), backend.to(x), backend.to(v), starts,
                                         cos, sin)
    ref = np.stack([causal_linear_ref(x[b].astype(np.float64), v[b], lengths) for b in range(B)])
    grads = [causal_linear_bwd_ref(da[b], x[b].astype(np.float64), v[b], lengths)
             for b in range(B)]
    assert_close("a", ref, out, rtol=1e-5)
    assert_close("dx", np.stack([g[0] for g in grads]), dx, rtol=1e-5)
    assert_close("dv", np.stack([g[1] for g in grads]), dv, rtol=1e-5)
    # A backward's recompute gives the forward's bits, and its cache the backward's.
    again, cache = impl.causal_linear_recompute(backend.to(x), backend.to(v), starts, cos, sin)
    assert_equal("recomputed a", to_numpy(out), to_numpy(again))
    for name, a, b in zip(("dx", "dv"), (dx, dv), impl.causal_linear_backward(
            backend.to(da), backend.to(x), backend.to(v), starts, cos, sin, cache)):
        assert_equal(f"{name} from the cache", to_numpy(a), to_numpy(b))


def test_layer_norm_kernels(backend, rng):
    x = (rng.standard_normal((3, 5, 37)) * 3 + 1).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    from lowbit.ops.layer_norm import normalize, normalize_backward

    y, mean, rstd = normalize(backend.to(x))
    dx = normalize_backward(backend.to(dy), y, rstd)
    assert_close("y", layer_norm_ref(x.astype(np.float64)), y, rtol=1e-5)
    assert_close("mean", x.astype(np.float64).mean(-1), mean, rtol=1e-6)
    assert_close("dx", layer_norm_bwd_ref(dy, x.astype(np.float64)), dx, rtol=1e-5)


# -- the layer against the reference ---------------------------------------------------------------

LAYER_CASES = [
    ("causal_linear", None, 0.0, 0.0),
    ("causal_linear", [1, 20, 16], 0.1, 0.25),
    ("causal_linear", [37], -0.2, 0.0),
    ("segmented", None, 0.1, 0.0),
    ("segmented", [3, 1, 33], 0.0, 0.25),
]


@pytest.mark.parametrize("attention,lengths,threshold,dropout", LAYER_CASES)
def test_layer_matches_reference(backend, rng, attention, lengths, threshold, dropout):
    B, T, D, H, N = 2, 37, 6, 2, 9
    if backend.name == "cudasim":  # one OS thread per CUDA thread: a few blocks only
        B, T, lengths = 1, 9, (None if lengths is None else [3, 1, 5])
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    dnext = rng.standard_normal((B, T, D)).astype(np.float32)
    kwargs = dict(attention=attention, lengths=lengths, relu_threshold=threshold,
                  dropout=dropout, seed=11 if dropout else 0)  # a seed needs dropout
    keep = [a.copy() for a in (current, encoder, encoder_v, decoder, dnext)]
    args = [backend.to(a) for a in (current, encoder, encoder_v, decoder)]
    out, ctx = lowbit.lowrank_residual_forward(*args, **kwargs)
    grads = lowbit.lowrank_residual_backward(backend.to(dnext), ctx)
    again = lowbit.lowrank_residual_backward(backend.to(dnext), ctx)
    inference = lowbit.lowrank_residual(*args, **kwargs)
    ref = lowrank_residual_ref(current, encoder, encoder_v, decoder, **kwargs)
    ref_grads = lowrank_residual_bwd_ref(dnext, current, encoder, encoder_v, decoder, **kwargs)
    assert_close("next", ref, out, rtol=2e-5)
    assert_equal("inference next", to_numpy(out), to_numpy(inference))
    for name, r, g, g2 in zip(("dcurrent", "dencoder", "dencoder_v", "ddecoder"), ref_grads,
                              grads, again):
        assert_close(name, r, g, rtol=1e-4)
        assert_equal(f"{name} (second backward on the same ctx)", to_numpy(g), to_numpy(g2))
    for name, k, a in zip(("current", "encoder", "encoder_v", "decoder", "dnext"), keep,
                          (current, encoder, encoder_v, decoder, dnext)):
        assert_equal(f"{name} unchanged", k, a)


def test_row_offset_draws_the_dropout_masks_of_the_larger_batch(rng):
    """Rows [1, 3) of a 3-row batch with row_offset=1 equal the same rows of the whole batch,
    forward and dcurrent; the masks are the reference's for those global rows."""
    current, encoder, encoder_v, decoder = _layer(rng, 3, 7, 6, 2, 8)
    dnext = rng.standard_normal(current.shape).astype(np.float32)
    kwargs = dict(dropout=0.4, seed=5)
    whole, wctx = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder, **kwargs)
    part, pctx = lowbit.lowrank_residual_forward(current[1:], encoder, encoder_v, decoder,
                                                 row_offset=1, **kwargs)
    ref = lowrank_residual_ref(current[1:], encoder, encoder_v, decoder, row_offset=1, **kwargs)
    assert_close("next (rows 1:3)", ref, part, rtol=2e-5)
    assert_equal("next (rows 1:3)", whole[1:], part)
    dwhole = lowbit.lowrank_residual_backward(dnext, wctx)[0]
    dpart = lowbit.lowrank_residual_backward(dnext[1:], pctx)[0]
    assert_equal("dcurrent (rows 1:3)", dwhole[1:], dpart)
    shifted = lowbit.lowrank_residual(current[1:], encoder, encoder_v, decoder, **kwargs)
    assert not np.array_equal(shifted, part)  # the offset changes the masks


def test_dropout_indices_past_two_to_the_32(rng):
    """A row offset that puts the flat dropout indices past 2**32 (the hash's 64-bit path; the
    uint32 one below it) draws the reference's masks."""
    B, T, D, H, N = 2, 5, 4, 2, 6
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    for offset in (2**32 // (H * T * N) - 1, 0):  # rows straddling 2**32, then small
        kwargs = dict(dropout=0.5, seed=9, row_offset=offset)
        assert_close("next", lowrank_residual_ref(current, encoder, encoder_v, decoder, **kwargs),
                     lowbit.lowrank_residual(current, encoder, encoder_v, decoder, **kwargs),
                     rtol=2e-5)


def test_float64_input_is_computed_in_float32(rng):
    """float64 in, float64 out (NumPy's dtype rule), with float32 accuracy."""
    current, encoder, encoder_v, decoder = _layer(rng, 1, 9, 4, 2, 6, np.float64)
    out = lowbit.lowrank_residual(current, encoder, encoder_v, decoder)
    assert out.dtype == np.float64
    assert_close("next", lowrank_residual_ref(current, encoder, encoder_v, decoder), out, 1e-5)


def test_accumulate_sums_weight_gradients_in_place(rng):
    current, encoder, encoder_v, decoder = _layer(rng, 1, 11, 6, 2, 8)
    dnext = rng.standard_normal(current.shape).astype(np.float32)
    mid, ctx1 = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder)
    _, ctx2 = lowbit.lowrank_residual_forward(mid, encoder, encoder_v, decoder)
    dmid, *grads2 = lowbit.lowrank_residual_backward(dnext, ctx2)
    _, *grads1 = lowbit.lowrank_residual_backward(dmid, ctx1)
    buffers = tuple(np.zeros(w.shape, np.float32) for w in (encoder, encoder_v, decoder))
    g, *out = lowbit.lowrank_residual_backward(dnext, ctx2, accumulate=buffers)
    _, *out = lowbit.lowrank_residual_backward(g, ctx1, accumulate=buffers)
    for name, a, b, acc, buf in zip(("dencoder", "dencoder_v", "ddecoder"), grads1, grads2, out,
                                    buffers):
        assert acc is buf, f"{name}: the accumulate buffer is returned"
        assert_close(name, a + b, acc, rtol=1e-6)
    with pytest.raises(ValueError, match="accumulate ddecoder"):
        lowbit.lowrank_residual_backward(dnext, ctx2, accumulate=buffers[:2] + (buffers[0],))
    with pytest.raises(TypeError, match="accumulate"):
        lowbit.lowrank_residual_backward(dnext, ctx2, accumulate=buffers[:2])


# -- saved-activation policies ---------------------------------------------------------------------

def _bdh_like(rng, B=2, T=64, D=32, H=2, N=256):
    """Unit-variance inputs and 1/sqrt(fan-in) weights: a threshold of 1.645 leaves ~5% active."""
    return _layer(rng, B, T, D, H, N), 1.645


#: (policy, minimum cosine, relu_threshold). int4 is bounded on dense ReLU activations (threshold
#: 0: half the neurons active); on BDH-like 5% activations its per-group steps are too coarse for
#: the small nonzeros (that is what "sparse" is for), so there it is reported by the benchmark.
POLICY_CASES = [("int8", 0.999, 1.645), ("sparse", 0.999, 1.645), ("int4", 0.98, 0.0),
                ("int2", None, 1.645)]


def test_saved_fp32_equals_unsaved(rng):
    (current, encoder, encoder_v, decoder), thr = _bdh_like(rng)
    dnext = rng.standard_normal(current.shape).astype(np.float32)
    out0, ctx0 = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder,
                                                 relu_threshold=thr)
    out1, ctx1 = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder,
                                                 relu_threshold=thr, saved="fp32")
    assert_equal("next", out0, out1)
    for name, g0, g1 in zip("dcurrent dencoder dencoder_v ddecoder".split(),
                            lowbit.lowrank_residual_backward(dnext, ctx0),
                            lowbit.lowrank_residual_backward(dnext, ctx1)):
        assert_equal(name, g0, g1)
    assert ctx1.nbytes == ctx1.dense_nbytes


@pytest.mark.parametrize("policy,bound,thr", POLICY_CASES)
def test_saved_policy_gradientcosine(rng, policy, bound, thr):
    (current, encoder, encoder_v, decoder), _ = _bdh_like(rng)
    dnext = rng.standard_normal(current.shape).astype(np.float32)
    _, ctx_fp = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder,
                                                relu_threshold=thr, saved="fp32")
    _, ctx = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder,
                                             relu_threshold=thr, saved=policy)
    density = np.mean([np.count_nonzero(s.unpack()) / s.unpack().size for s in ctx_fp.x_neuron])
    assert (0.02 < density < 0.1) if thr else (0.3 < density < 0.7), f"density {density:.3f}"
    cosines = [cosine(a, b) for a, b in zip(lowbit.lowrank_residual_backward(dnext, ctx_fp),
                                              lowbit.lowrank_residual_backward(dnext, ctx))]
    ratio = ctx.nbytes / ctx_fp.nbytes
    print(f"saved={policy}: min gradient cosine {min(cosines):.5f}, bytes ratio {ratio:.4f}")
    if bound is not None:
        assert min(cosines) >= bound, f"saved={policy}: gradient cosines {cosines}"
    assert ratio < 1


def test_sparse_policy_formats_and_report(rng):
    (current, encoder, encoder_v, decoder), thr = _bdh_like(rng)
    _, ctx = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder,
                                             relu_threshold=thr, saved="sparse")
    report = lowbit.memory_report(ctx)
    formats = {row.name.split(".")[1].split("[")[0]: row.format for row in report.rows}
    assert formats["x_neuron"] == formats["y_gate"] == "sparse"
    assert formats["current"] == formats["attn"] == formats["mlp"] == "int8"
    assert report.nbytes == ctx.nbytes
    assert "x_neuron" in str(report)
    assert ctx.nbytes <= ctx.dense_nbytes / 12


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_under_nvrtc_without_spills(arch):
    from lowbit import _kernels, _nvrtc
    from lowbit.ops.lowrank_residual import _cuda

    if not _nvrtc.available():
        pytest.skip(_nvrtc.unavailable_reason())
    report = _nvrtc.compile_check(_kernels.source(_cuda.SOURCE), _cuda.NAME_EXPRESSIONS,
                                  [str(_kernels.cuda_dir())], arch)
    assert set(report) == set(_cuda.NAME_EXPRESSIONS)
    for name, usage in report.items():
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (name, usage)


def test_saved_config_policy(rng):
    from lowbit.ops.saved_activation import SavedConfig

    (current, encoder, encoder_v, decoder), thr = _bdh_like(rng, T=16)
    _, ctx = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder,
                                             relu_threshold=thr,
                                             saved=SavedConfig("sparse", group_size=64))
    formats = {row.name.split(".")[1].split("[")[0]: row.format
               for row in lowbit.memory_report(ctx).rows}
    assert formats["x_neuron"] == "sparse" and formats["current"] == "int8"
    grads = lowbit.lowrank_residual_backward(np.ones_like(current), ctx)
    assert all(np.isfinite(g).all() for g in grads)


# -- validation ------------------------------------------------------------------------------------

def _good(rng):
    return list(_layer(rng, 1, 5, 4, 2, 3))


@pytest.mark.parametrize("index,name,bad,exc", [
    (0, "current", lambda a: a[0], ValueError),
    (0, "current", lambda a: a.astype(np.int32), TypeError),
    (0, "current", lambda a: a.tolist(), TypeError),
    (1, "encoder", lambda a: a[:, :3], ValueError),
    (2, "encoder_v", lambda a: a[:1], ValueError),
    (3, "decoder", lambda a: a[:5], ValueError),
    (3, "decoder", lambda a: np.full_like(a, np.nan), ValueError),
])
def test_bad_arrays_name_the_argument(never_runs, rng, index, name, bad, exc):
    args = _good(rng)
    args[index] = bad(args[index])
    with pytest.raises(exc, match=name):
        lowbit.lowrank_residual_forward(*args)


@pytest.mark.parametrize("kwargs,name,exc", [
    (dict(attention="softmax"), "attention", ValueError),
    (dict(lengths=[2, 2]), "lengths", ValueError),
    (dict(lengths=[5, 0]), "lengths", ValueError),
    (dict(lengths=[]), "lengths", ValueError),
    (dict(lengths=5), "lengths", TypeError),
    (dict(plan=("ternary", "int8")), "plan", TypeError),
    (dict(saved="int3"), "saved", ValueError),
    (dict(relu_threshold=float("nan")), "relu_threshold", ValueError),
    (dict(dropout=1.0), "dropout", ValueError),
    (dict(seed=-1), "seed", ValueError),
    (dict(row_offset=-1), "row_offset", ValueError),
    (dict(row_offset=1.5), "row_offset", TypeError),
])
def test_bad_options_name_the_argument(never_runs, rng, kwargs, name, exc):
    with pytest.raises(exc, match=name):
        lowbit.lowrank_residual_forward(*_good(rng), **kwargs)


@pytest.mark.parametrize("pair,message", [(("ternary4", "int8"), "plan.x weight format"),
                                          (("int8", "int2"), "plan.x activation format"),
                                          ("int8", "plan.x must be a pair")])
def test_bad_plan_formats(pair, message):
    with pytest.raises(ValueError, match=message):
        lowbit.LowBitPlan(x=pair)


def test_bad_backward_arguments(never_runs, rng):
    with never_runs.paused():
        out, ctx = lowbit.lowrank_residual_forward(*_good(rng))
    with pytest.raises(ValueError, match="dnext"):
        lowbit.lowrank_residual_backward(out[:, :2], ctx)
    with pytest.raises(TypeError, match="ctx"):
        lowbit.lowrank_residual_backward(out, None)
