"""Tests of the BDH low-rank residual layer's low-bit plans (``lowbit/ops/lowrank_residual``):
every projection and weight format against the quantized float64 reference
(``reference/lowrank_residual.py``), packed weights given once, gradients through a plan, and
the profile of every stage. The layer against its reference, saved-activation policies and
validation: ``test_lowrank_residual.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_equal, cosine, lowrank_inputs, to_numpy

import lowbit
from lowbit.reference.lowrank_residual import lowrank_residual_bwd_ref, lowrank_residual_ref


_layer = lowrank_inputs


# -- low-bit plans ---------------------------------------------------------------------------------

@pytest.mark.parametrize("projection", ["x", "y", "residual"])
@pytest.mark.parametrize("weight", ["ternary", "sign", "int8"])
def test_plan_matches_quantized_reference(backend, rng, projection, weight):
    B, T, D, H, N = 1, 12 if backend.name != "cudasim" else 5, 8, 2, 6
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    dnext = rng.standard_normal((B, T, D)).astype(np.float32)
    plan = lowbit.LowBitPlan(**{projection: (weight, "int8")})
    args = [backend.to(a) for a in (current, encoder, encoder_v, decoder)]
    out, ctx = lowbit.lowrank_residual_forward(*args, plan=plan, relu_threshold=0.05)
    grads = lowbit.lowrank_residual_backward(backend.to(dnext), ctx)
    kwargs = dict(plan=plan, relu_threshold=0.05)
    assert_close("next", lowrank_residual_ref(current, encoder, encoder_v, decoder, **kwargs),
                 out, rtol=1e-4)
    for name, r, g in zip("dcurrent dencoder dencoder_v ddecoder".split(),
                          lowrank_residual_bwd_ref(dnext, current, encoder, encoder_v, decoder,
                                                   **kwargs), grads):
        assert_close(name, r, g, rtol=1e-3)


@pytest.mark.parametrize("weight", ["ternary", None])
def test_projection_from_saved_codes_is_the_forward_bitwise(backend, rng, weight):
    """The backward's recomputation (straight_through_codes on the forward's codes) gives the
    forward projection's bits, on every backend, with packed and float weights."""
    from lowbit.ops.packed_matmul import straight_through_codes, straight_through_forward

    M = 37 if backend.name != "cudasim" else 5
    x = backend.to(rng.standard_normal((M, 24)).astype(np.float32))
    w = backend.to(rng.standard_normal((24, 40)).astype(np.float32))
    pw = lowbit.quantize_weight(w, weight) if weight else None
    y, codes, scale = straight_through_forward(x, w, pw, "int8")
    assert_equal("y", to_numpy(y), to_numpy(straight_through_codes(codes, scale, w, pw)))


@pytest.mark.parametrize("policy", ["sparse", "int4"])
def test_lossy_policy_with_quantized_activations_recomputes_from_codes(backend, rng, policy):
    """A lossy policy under an int8-activation plan keeps the projections' codes, not
    x_neuron / y_gate / a: fewer bytes than the same policy without the plan, the forward
    unchanged bitwise, gradients close to the exact ones (every lossy difference is in current,
    mlp and LN(a) held at int8 or coarser)."""
    B, T, D, H, N = (2, 16, 8, 2, 32) if backend.name != "cudasim" else (1, 6, 4, 2, 8)
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    dnext = backend.to(rng.standard_normal((B, T, D)).astype(np.float32))
    args = [backend.to(a) for a in (current, encoder, encoder_v, decoder)]
    plan = lowbit.LowBitPlan.uniform("ternary", "int8")
    kwargs = dict(plan=plan, relu_threshold=0.05, dropout=0.2, seed=3)
    exact_out, exact = lowbit.lowrank_residual_forward(*args, **kwargs)
    out, ctx = lowbit.lowrank_residual_forward(*args, saved=policy, **kwargs)
    assert_equal("next", to_numpy(exact_out), to_numpy(out))
    assert ctx.x_neuron is None and ctx.y_gate is None and ctx.attn is None
    names = {row.name.split(".")[1].split("[")[0] for row in lowbit.memory_report(ctx).rows}
    assert {"x_codes", "attn_codes", "resid_scale"} <= names
    _, no_plan = lowbit.lowrank_residual_forward(*args, saved=policy, relu_threshold=0.05)
    assert ctx.nbytes < no_plan.nbytes
    bound = 0.999 if policy == "sparse" else 0.99
    for name, a, b in zip(("dcurrent", "dencoder", "dencoder_v", "ddecoder"),
                          lowbit.lowrank_residual_backward(dnext, exact),
                          lowbit.lowrank_residual_backward(dnext, ctx)):
        assert cosine(a, b) >= bound, (name, cosine(a, b))


def test_packed_weights_given_once_equal_quantizing_each_call(rng):
    current, encoder, encoder_v, decoder = _layer(rng, 2, 9, 8, 2, 12)
    dnext = rng.standard_normal(current.shape).astype(np.float32)
    plan = lowbit.LowBitPlan(x=("ternary", "int8"), residual=("int8", None))
    packed = lowbit.quantize_layer_weights(encoder, encoder_v, decoder, plan)
    assert set(packed) == {"encoder", "decoder"} and len(packed["encoder"]) == 2
    out, ctx = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder, plan=plan)
    out2, ctx2 = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder,
                                                 plan=plan, packed=packed)
    assert_equal("next", out, out2)
    assert_equal("inference", out, lowbit.lowrank_residual(current, encoder, encoder_v, decoder,
                                                           plan=plan, packed=packed))
    for name, a, b in zip(("dcurrent", "dencoder", "dencoder_v", "ddecoder"),
                          lowbit.lowrank_residual_backward(dnext, ctx),
                          lowbit.lowrank_residual_backward(dnext, ctx2)):
        assert_equal(name, a, b)


def test_packed_weights_must_match_the_plan_and_shapes(never_runs, rng):
    current, encoder, encoder_v, decoder = _layer(rng, 1, 5, 4, 2, 3)
    plan = lowbit.LowBitPlan(x=("ternary", "int8"))
    with never_runs.paused():
        good = lowbit.quantize_layer_weights(encoder, encoder_v, decoder, plan)
        sign = lowbit.quantize_layer_weights(encoder, encoder_v, decoder,
                                             lowbit.LowBitPlan(x=("sign", "int8")))
    for bad in ({}, {"encoder": good["encoder"][:1]}, sign, {**good, "decoder": None}, [good]):
        with pytest.raises(ValueError, match="packed"):
            lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder, plan=plan,
                                            packed=bad)
    with pytest.raises(TypeError, match="plan"):
        lowbit.quantize_layer_weights(encoder, encoder_v, decoder, ("ternary", "int8"))



def test_weights_stood_in_for_by_packed_forms_are_not_read(never_runs, rng):
    """A master weight whose packed form is given is never read (so not checked for
    finiteness: the step is the same with it poisoned); one without is still checked."""
    current, encoder, encoder_v, decoder = _layer(rng, 1, 5, 4, 2, 3)
    plan = lowbit.LowBitPlan(x=("ternary", "int8"))
    with never_runs.paused():
        packed = lowbit.quantize_layer_weights(encoder, encoder_v, decoder, plan)
        out = lowbit.lowrank_residual(current, encoder, encoder_v, decoder, plan=plan,
                                      packed=packed)
        poisoned = np.full_like(encoder, np.nan)
        assert_equal("next", out, lowbit.lowrank_residual(current, poisoned, encoder_v, decoder,
                                                          plan=plan, packed=packed))
    with pytest.raises(ValueError, match="decoder"):
        lowbit.lowrank_residual_forward(current, encoder, encoder_v,
                                        np.full_like(decoder, np.inf), plan=plan, packed=packed)
    with pytest.raises(ValueError, match="encoder"):
        lowbit.lowrank_residual_forward(current, poisoned, encoder_v, decoder, plan=plan)

def test_plan_sgd_lowers_the_loss(rng):
    B, T, D, H, N = 2, 16, 16, 2, 32
    current, encoder, encoder_v, decoder = _layer(rng, B, T, D, H, N)
    target = rng.standard_normal(current.shape).astype(np.float32)
    plan = lowbit.LowBitPlan.uniform("ternary", "int8")
    params = [encoder.copy(), encoder_v.copy(), decoder.copy()]
    losses = []
    for _ in range(6):
        out, ctx = lowbit.lowrank_residual_forward(current, *params, plan=plan)
        diff = out - target
        losses.append(float((diff**2).mean()))
        _, *grads = lowbit.lowrank_residual_backward(2 * diff / diff.size, ctx)
        params = [p - 20.0 * g for p, g in zip(params, grads)]
    assert losses[-1] < losses[0], losses


# -- profiling -------------------------------------------------------------------------------------

def test_profile_records_every_stage(rng):
    current, encoder, encoder_v, decoder = _layer(rng, 1, 16, 8, 2, 12)
    with lowbit.profile() as prof:
        out, ctx = lowbit.lowrank_residual_forward(current, encoder, encoder_v, decoder)
        lowbit.lowrank_residual_backward(np.ones_like(out), ctx)
    stages = {stage for _, stage in prof.records}
    assert stages == {"x projection", "attention", "norms", "y projection", "product",
                      "decoder tail", "residual"}
    assert {phase for phase, _ in prof.records} == {"forward", "backward"}
    assert prof.peak_bytes > 0
    assert "x projection" in str(prof)
