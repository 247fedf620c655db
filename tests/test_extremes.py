"""Extreme values and sizes: quantizer ties, the scale floor and constant inputs; attention scores
of +-1e4 and one-token segments; scans with decays of exactly 0 and 1; and one tensor of more
than 2**31 elements through ``pack_bits`` (64-bit indexing).

Every case runs on every CPU backend against the float64 references in ``reference/``. The
large case (``slow``) needs ~2.6 GiB and ~8-15 s on two cores; ``unpack_bits`` of the same
size (another 2 GiB, ~10 s) is left out to keep within the suite's time budget. Property tests
of the same ops: ``tests/properties/``.
"""

import numpy as np
import pytest
from helpers import assert_close, assert_equal

import lowbit
from lowbit import _dispatch
from lowbit.reference.gated_delta_scan import gated_delta_scan_bwd_ref, gated_delta_scan_ref
from lowbit.reference.pack_bits import pack_bits_ref
from lowbit.reference.quantize import quantize_activation_ref, quantize_weight_ref
from lowbit.reference.segmented_attention import (segmented_attention_bwd_ref,
                                                  segmented_attention_ref)
from lowbit.reference.selective_scan import selective_scan_ref

CPU = [b for b in ("numpy", "numba", "cudasim") if _dispatch.backend_unavailable_reason(b) is None]


@pytest.fixture(params=CPU)
def cpu(request):
    with lowbit.use_backend(request.param):
        yield request.param


@pytest.mark.parametrize("case", ["ties", "floor", "constant", "subnormal", "huge"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantizers_at_extremes(cpu, case, dtype):
    w = {
        # mean |w| = 1 and max |w| = 127: the quotients are the values, .5 are exact ties
        "ties": np.array([[0.5, -0.5, 127], [1.5, -2.5, 126.5], [0, 3.5, -126.5]]),
        "floor": np.zeros((3, 3)),  # every statistic below eps: the scale is the floor
        "constant": np.full((3, 3), -0.75),
        "subnormal": np.full((3, 3), np.finfo(dtype).smallest_subnormal),
        "huge": np.array([[1e30, -1e30, 1], [0, 5e29, -3e29], [1, 1, 1]]),
    }[case].astype(dtype)
    for format in ("ternary", "sign", "int8"):
        data, scale = quantize_weight_ref(w, format)
        pw = lowbit.quantize_weight(w, format)
        assert_equal(f"{format} data", data, pw.data)
        assert_equal(f"{format} scale", scale, pw.scale)
    for format in ("int8", "int4"):
        codes, scale = quantize_activation_ref(w, format)
        q = lowbit.quantize_activation(w, format)
        assert_equal(f"{format} codes", codes, q.codes)
        assert_equal(f"{format} scale", scale, q.scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_scores_of_1e4(cpu, dtype, causal):
    """Scores of +-1e4 (q . k = +-1e4 at scale 1): no overflow, the softmax one-hot."""
    T = 6
    q = np.full((T, 1, 1), 100.0, dtype)
    k = (100.0 * np.array([1, -1, 1, -1, -1, 1])).reshape(T, 1, 1).astype(dtype)
    v = np.arange(T, dtype=dtype).reshape(T, 1, 1)
    dout = np.ones((T, 1, 1), dtype)
    lengths = [1, 3, 2]  # a one-token segment among them
    out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths, scale=1.0, causal=causal)
    grads = lowbit.segmented_attention_backward(dout, ctx)
    ref_out, ref_lse = segmented_attention_ref(q, k, v, lengths, 1.0, causal)
    ref_grads = segmented_attention_bwd_ref(dout, q, k, v, lengths, 1.0, causal)
    rtol = {np.float32: 1e-4, np.float64: 1e-10}[dtype]
    assert_close("out", ref_out, out, rtol, rtol)
    assert_close("lse", ref_lse, ctx.lse.unpack(), rtol, rtol)
    for name, ref, got in zip(("dq", "dk", "dv"), ref_grads, grads):
        assert_close(name, ref, got, rtol, rtol)


@pytest.mark.parametrize("log_decay", [0.0, -np.inf, -800.0], ids=["one", "zero", "underflow"])
def test_gated_delta_scan_decay_exactly_0_and_1(cpu, log_decay):
    rng = np.random.default_rng(5)
    q, k = rng.normal(size=(2, 1, 5, 1, 3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, dout = rng.normal(size=(2, 1, 5, 1, 2))
    decay = np.full((1, 5, 1), log_decay)
    beta = np.ones((1, 5, 1))
    s0 = rng.normal(size=(1, 1, 3, 2))
    out, state, ctx = lowbit.gated_delta_scan_forward(q, k, v, decay, beta, initial_state=s0,
                                                        chunk_size=2)
    grads = lowbit.gated_delta_scan_backward(dout, None, ctx)
    finite = -800.0 if log_decay == -np.inf else log_decay  # exp gives exactly 0 either way
    ref_out, ref_state = gated_delta_scan_ref(q, k, v, np.full_like(decay, finite), beta, s0)
    ref_grads = gated_delta_scan_bwd_ref(q, k, v, np.full_like(decay, finite), beta, s0, dout)
    assert_close("out", ref_out, out, 1e-10)
    assert_close("state", ref_state, state, 1e-10)
    names = ("dq", "dk", "dv", "dlog_decay", "dbeta", "dinitial_state")
    for name, ref, got in zip(names, ref_grads, grads):
        if name in ("dlog_decay", "dinitial_state") and log_decay != 0.0:
            # Both carry the factor exp(log_decay) = 0: exactly zero, and never NaN.
            assert_equal(name, np.zeros_like(got), got)
        else:
            assert_close(name, ref, got, 1e-10, 1e-10)


@pytest.mark.parametrize("mode", ["one", "zero"])
def test_selective_scan_decay_exactly_0_and_1(cpu, mode):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(1, 5, 1, 2))
    B, C = rng.normal(size=(2, 1, 5, 1, 3))
    # "one": softplus(-60 + 0) = 9e-27, so exp(-dt * e^0) rounds to 1; "zero": dt * e^8 > 800.
    dt = np.full((1, 5, 1), -60.0 if mode == "one" else 2.0)
    A_log = np.array([0.0 if mode == "one" else 8.0])
    D, dt_bias = np.array([0.5]), np.array([0.0])
    s0 = rng.normal(size=(1, 1, 2, 3))
    out, state = lowbit.selective_scan(x, B, C, dt, dt_bias, A_log, D, initial_state=s0)
    ref_out, ref_state = selective_scan_ref(x, B, C, dt, dt_bias, A_log, D, s0)
    assert_close("out", ref_out, out, 1e-10)
    assert_close("state", ref_state, state, 1e-10)
    if mode == "one":
        assert_close("state (s0 carried unchanged plus inputs)", ref_state, state, 1e-12)


@pytest.mark.slow
@pytest.mark.skipif(_dispatch.backend_unavailable_reason("numba") is not None,
                    reason="numba unavailable")
def test_pack_bits_beyond_2_to_the_31():
    n = 2**31 + 7
    codes = np.zeros(n, np.uint8)
    tail = np.array([1, 2, 3, 1, 2, 3, 3, 0, 1, 2, 1], np.uint8)
    codes[-tail.size:] = tail
    codes[:4] = [3, 2, 1, 0]
    with lowbit.use_backend("numba"):
        packed = lowbit.pack_bits(codes, 2)
    del codes
    assert packed.shape == (-(-n // 4),)
    # Codes n - 11 .. n - 1 start at byte (n - 11) // 4; compare the bytes they fill.
    first = (n - tail.size) // 4
    lead = (n - tail.size) % 4
    want = pack_bits_ref(np.concatenate([np.zeros(lead, np.uint8), tail]), 2)
    assert_equal("tail bytes", want, packed[first:])
    assert_equal("head byte", pack_bits_ref(np.array([3, 2, 1, 0], np.uint8), 2), packed[:1])
    assert int(packed[1:first].max()) == 0
