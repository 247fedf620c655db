"""Properties of ``lowbit/ops/gated_delta_scan`` and ``lowbit/ops/selective_scan``.

Outputs, final states and every gradient on every CPU backend equal ``reference/
gated_delta_scan.py`` and ``reference/selective_scan.py`` within the tolerances of
``tests/test_gated_delta_scan.py`` and ``tests/test_selective_scan.py``; token counts cross the
checkpoint chunk (``chunk_size`` drawn too), decays include exactly 1 (``log_decay = 0``) and
underflow to exactly 0. The inference form equals the forward bitwise.
"""

import numpy as np
import pytest
from helpers import assert_equal
from hypothesis import example, given, strategies as st
from strategies import LAYOUTS, assert_near, dims, on_backends, relayout

import lowbit
from lowbit.reference.gated_delta_scan import gated_delta_scan_bwd_ref, gated_delta_scan_ref
from lowbit.reference.selective_scan import selective_scan_bwd_ref, selective_scan_ref

RTOL = {np.float32: 3e-5, np.float64: 1e-10}
CHUNKS = st.sampled_from([1, 2, 3, 7, 64])
SIM_TOKENS = 8


def _check(name, refs, got, rtol):
    # Inputs are O(1): a gradient that vanishes (1e-54 through a decay of exactly 1, zero in
    # float32) is held to an absolute rtol.
    for label, ref, g in zip(name, refs, got):
        if ref is None:
            assert g is None, f"{label} must be None"
        else:
            assert_near(label, ref, g, rtol, rtol)


@st.composite
def delta_inputs(draw):
    chunk = draw(CHUNKS)
    nb, nh = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    nt = draw(dims(chunk, low=0 if chunk > 1 else 1, high=chunk * 2 + 1 if chunk < 64 else 65))
    nk, nv = draw(dims(high=5)), draw(dims(high=5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    per_key = draw(st.booleans())
    q = rng.normal(size=(nb, nt, nh, nk))
    k = rng.normal(size=(nb, nt, nh, nk))
    k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-3)
    v = rng.normal(size=(nb, nt, nh, nv))
    decay_shape = (nb, nt, nh, nk) if per_key else (nb, nt, nh)
    mode = draw(st.sampled_from(["random", "one", "zero"]))
    log_decay = {"random": -rng.uniform(0, 0.5, decay_shape), "one": np.zeros(decay_shape),
                 "zero": np.full(decay_shape, -800.0)}[mode]  # exp(-800) is exactly 0
    beta = rng.uniform(0, 1, (nb, nt, nh))
    s0 = rng.normal(size=(nb, nh, nk, nv)) if draw(st.booleans()) else None
    layout = draw(st.sampled_from(LAYOUTS))
    arrays = [None if a is None else relayout(a.astype(dtype), layout)
              for a in (q, k, v, log_decay, beta, s0)]
    dout = rng.normal(size=v.shape).astype(dtype)
    dstate = rng.normal(size=(nb, nh, nk, nv)).astype(dtype) if draw(st.booleans()) else None
    return arrays, dout, dstate, chunk


@given(case=delta_inputs())
def test_gated_delta_scan_equals_reference(case):
    inputs, dout, dstate, chunk = case
    ref_out, ref_state = gated_delta_scan_ref(*inputs)
    ref_grads = gated_delta_scan_bwd_ref(*inputs, dout, dstate)

    def call():
        out, state, ctx = lowbit.gated_delta_scan_forward(*inputs[:5], initial_state=inputs[5],
                                                          chunk_size=chunk)
        return out, state, lowbit.gated_delta_scan_backward(dout, dstate, ctx), \
            lowbit.gated_delta_scan(*inputs[:5], initial_state=inputs[5])

    sim = inputs[0].size if inputs[0].shape[1] <= SIM_TOKENS else 10**9
    rtol = RTOL[inputs[0].dtype.type]
    for name, (out, state, grads, (out2, state2)) in on_backends(
            call, sim, inputs=inputs, dout=dout, dstate=dstate).items():
        _check([f"{name} out", f"{name} state"], [ref_out, ref_state], [out, state], rtol)
        _check([f"{name} d{n}" for n in ("q", "k", "v", "log_decay", "beta", "initial_state")],
               ref_grads, grads, rtol)
        assert_equal(f"{name} inference out", out, out2)
        assert_equal(f"{name} inference state", state, state2)


@st.composite
def selective_inputs(draw):
    chunk = draw(CHUNKS)
    nb, nh = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    nt = draw(dims(chunk, low=0 if chunk > 1 else 1, high=chunk * 2 + 1 if chunk < 64 else 65))
    npp, nn = draw(dims(high=5)), draw(dims(high=5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    x = rng.normal(size=(nb, nt, nh, npp))
    B = rng.normal(size=(nb, nt, nh, nn))
    C = rng.normal(size=(nb, nt, nh, nn))
    mode = draw(st.sampled_from(["random", "one", "zero"]))
    # "one": softplus(-60) ~ 1e-26 makes the decay round to 1; "zero": a huge rate makes it 0.
    dt = {"random": rng.normal(size=(nb, nt, nh)), "one": np.full((nb, nt, nh), -60.0),
          "zero": np.full((nb, nt, nh), 2.0)}[mode]
    A_log = np.full(nh, 7.0) if mode == "zero" else rng.normal(scale=0.5, size=nh)
    dt_bias = rng.normal(scale=0.5, size=nh)
    D = rng.normal(size=nh)
    s0 = rng.normal(size=(nb, nh, npp, nn)) if draw(st.booleans()) else None
    layout = draw(st.sampled_from(LAYOUTS))
    arrays = [None if a is None else relayout(a.astype(dtype), layout)
              for a in (x, B, C, dt, dt_bias, A_log, D, s0)]
    dout = rng.normal(size=x.shape).astype(dtype)
    dstate = rng.normal(size=(nb, nh, npp, nn)).astype(dtype) if draw(st.booleans()) else None
    dt_floor = draw(st.sampled_from([0.0, 0.0, 0.7]))
    return arrays, dout, dstate, chunk, dt_floor


@given(case=selective_inputs())
@example(case=([np.full((1, 2, 1, 1), 0.1, np.float32), np.full((1, 2, 1, 1), 0.6, np.float32),
                np.full((1, 2, 1, 1), -0.5, np.float32), np.full((1, 2, 1), -60.0, np.float32),
                *(np.full(1, -0.5, np.float32),) * 3, None],
               np.ones((1, 2, 1, 1), np.float32), None, 1, 0.0)).via("vanishing dA_log")
def test_selective_scan_equals_reference(case):
    inputs, dout, dstate, chunk, dt_floor = case
    ref_out, ref_state = selective_scan_ref(*inputs, dt_floor)
    ref_grads = selective_scan_bwd_ref(*inputs, dout, dstate, dt_floor)

    def call():
        out, state, ctx = lowbit.selective_scan_forward(*inputs[:7], initial_state=inputs[7],
                                                        dt_floor=dt_floor, chunk_size=chunk)
        return out, state, lowbit.selective_scan_backward(dout, dstate, ctx), \
            lowbit.selective_scan(*inputs[:7], initial_state=inputs[7], dt_floor=dt_floor)

    sim = inputs[0].size if inputs[0].shape[1] <= SIM_TOKENS else 10**9
    rtol = RTOL[inputs[0].dtype.type]
    names = ("x", "B", "C", "dt", "dt_bias", "A_log", "D", "initial_state")
    for name, (out, state, grads, (out2, state2)) in on_backends(
            call, sim, inputs=inputs, dout=dout, dstate=dstate).items():
        _check([f"{name} out", f"{name} state"], [ref_out, ref_state], [out, state], rtol)
        _check([f"{name} d{n}" for n in names], ref_grads, grads, rtol)
        assert_equal(f"{name} inference out", out, out2)
        assert_equal(f"{name} inference state", state, state2)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_initial_state_is_rejected(bad):
    q = np.ones((1, 2, 1, 2))
    s0 = np.ones((1, 1, 2, 2))
    s0[0, 0, 1, 1] = bad
    with pytest.raises(ValueError, match="initial_state"):
        lowbit.gated_delta_scan(q, q, q, np.zeros((1, 2, 1)), np.ones((1, 2, 1)),
                                initial_state=s0)
    h = np.ones(1)
    with pytest.raises(ValueError, match="initial_state"):
        lowbit.selective_scan(q, q, q, np.ones((1, 2, 1)), h, h, h, initial_state=s0)


@given(which=st.sampled_from(["k", "v", "log_decay", "beta"]),
       dtype=st.sampled_from([np.float32, np.int64, np.float16]))
@example(which="beta", dtype=np.float32)
def test_mixed_dtypes_are_rejected(which, dtype):
    arrays = {"q": np.ones((1, 2, 1, 2)), "k": np.ones((1, 2, 1, 2)), "v": np.ones((1, 2, 1, 3)),
              "log_decay": np.zeros((1, 2, 1)), "beta": np.ones((1, 2, 1))}
    arrays[which] = arrays[which].astype(dtype)
    with pytest.raises(TypeError, match=which):
        lowbit.gated_delta_scan(**arrays)
