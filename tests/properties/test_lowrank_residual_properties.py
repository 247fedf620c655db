"""Properties of ``lowbit/ops/lowrank_residual`` (the BDH layer) on every CPU backend.

The forward and the four gradients equal ``reference/lowrank_residual.py`` within the tolerances
of ``tests/test_lowrank_residual.py``, for drawn shapes (token counts crossing the numba kernels'
``CHUNK``), segment lengths, thresholds, dropout and low-bit plans; the inference form equals the
forward bitwise, and a second backward on one ctx gives the same gradients.
"""

import numpy as np
from helpers import assert_close, assert_equal
from hypothesis import given, settings, strategies as st
from strategies import LAYOUTS, assert_near, boundaries, dims, on_backends, relayout

import lowbit
from lowbit.ops.lowrank_residual import _numba as lr_numba
from lowbit.reference.lowrank_residual import lowrank_residual_bwd_ref, lowrank_residual_ref

TOKENS = dims(*boundaries(lr_numba, "CHUNK"), high=129)
PAIRS = st.tuples(st.sampled_from([None, "ternary", "sign", "int8"]),
                  st.sampled_from([None, "int8", "int4"]))
SIM_TOKENS = 9


@st.composite
def layer_inputs(draw):
    T = draw(TOKENS)
    small = T <= 40
    B = draw(st.sampled_from([1, 2])) if small else 1
    H = draw(st.sampled_from([1, 2])) if small else 1
    D, N = draw(dims(high=7)), draw(dims(high=9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    current = rng.standard_normal((B, T, D))
    encoder = rng.standard_normal((H, D, N)) / np.sqrt(D)
    encoder_v = rng.standard_normal((H, D, N)) / np.sqrt(D)
    decoder = rng.standard_normal((H * N, D)) / np.sqrt(H * N)
    layout = draw(st.sampled_from(LAYOUTS))
    arrays = [relayout(a.astype(np.float32), layout)
              for a in (current, encoder, encoder_v, decoder)]
    if draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, T - 1), max_size=3))) if T > 1 else []
        lengths = list(np.diff([0, *cuts, T]))
    else:
        lengths = None
    quantized = draw(st.booleans())
    dropout = draw(st.sampled_from([0.0, 0.25]))
    kwargs = dict(attention=draw(st.sampled_from(["causal_linear", "segmented"])),
                  lengths=lengths, relu_threshold=draw(st.sampled_from([0.0, 0.1, -0.2])),
                  # a seed places dropout masks: the layer takes one only with dropout
                  dropout=dropout, seed=draw(st.integers(0, 99)) if dropout else 0,
                  plan=lowbit.LowBitPlan(draw(PAIRS), draw(PAIRS), draw(PAIRS)) if quantized
                  else None)
    dnext = rng.standard_normal((B, T, D)).astype(np.float32)
    return arrays, dnext, kwargs


# The costliest property (seven ops per example, numba kernels per plan): half the profile's count.
@settings(max_examples=max(4, settings.default.max_examples // 2))
@given(case=layer_inputs())
def test_lowrank_residual_equals_reference(case):
    arrays, dnext, kwargs = case
    ref = lowrank_residual_ref(*arrays, **kwargs)
    ref_grads = lowrank_residual_bwd_ref(dnext, *arrays, **kwargs)
    quantized = kwargs["plan"] is not None

    def call():
        out, ctx = lowbit.lowrank_residual_forward(*arrays, **kwargs)
        grads = lowbit.lowrank_residual_backward(dnext, ctx)
        again = lowbit.lowrank_residual_backward(dnext, ctx)
        return out, grads, again, lowbit.lowrank_residual(*arrays, **kwargs)

    sim = arrays[0].size if arrays[0].shape[1] <= SIM_TOKENS else 10**9
    for name, (out, grads, again, inference) in on_backends(call, sim, arrays=arrays,
                                                            dnext=dnext).items():
        # Quantized plans: the tolerances of tests/test_lowrank_residual.py's plan tests.
        rtol, grad_rtol = (1e-4, 1e-3) if quantized else (2e-5, 1e-4)
        assert_close(f"{name} next", ref, out, rtol, rtol)
        assert_equal(f"{name} inference", out, inference)
        names = ("dcurrent", "dencoder", "dencoder_v", "ddecoder")
        for g, r, got, got2 in zip(names, ref_grads, grads, again):
            assert_near(f"{name} {g}", r, got, grad_rtol, grad_rtol)
            assert_equal(f"{name} {g} twice", got, got2)
