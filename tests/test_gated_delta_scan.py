"""gated_delta_scan on every backend against reference/gated_delta_scan.py.

Op: lowbit/ops/gated_delta_scan; kernels: cuda/gated_delta_scan.cu. The reference backward is
checked against central finite differences; every backend's forward, final state and gradients
(dinitial_state and a nonzero dstate included) against the reference. The chunked (WY / UT)
kernels and the rules that pick them: ``tests/test_gated_delta_scan_chunked.py``.
"""

import math
import tracemalloc

import numpy as np
import pytest

import lowbit
from helpers import assert_close, numerical_grad, to_numpy
from lowbit.reference.gated_delta_scan import gated_delta_scan_bwd_ref, gated_delta_scan_ref

GRAD_NAMES = ("dq", "dk", "dv", "dlog_decay", "dbeta", "dinitial_state")


def make_inputs(rng, nb, nt, nh, nk, nv, *, per_key=False, dtype=np.float64, init=True,
                log_decay=None, beta=None):
    """Inputs of a stable scan: unit-norm keys, decays in (0, 1], beta in [0, 1]."""
    q = rng.normal(size=(nb, nt, nh, nk))
    k = rng.normal(size=(nb, nt, nh, nk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(nb, nt, nh, nv))
    decay_shape = (nb, nt, nh, nk) if per_key else (nb, nt, nh)
    if log_decay is None:
        log_decay = -rng.uniform(0.0, 0.5, decay_shape)
    else:
        log_decay = np.full(decay_shape, float(log_decay))
    beta = rng.uniform(0.0, 1.0, (nb, nt, nh)) if beta is None else np.full((nb, nt, nh), beta)
    s0 = rng.normal(size=(nb, nh, nk, nv)) if init else None
    arrays = [q, k, v, log_decay, beta, s0]
    return [None if a is None else a.astype(dtype) for a in arrays]


def run_backend(backend, inputs, dout, dstate, chunk_size):
    dev = [backend.to(a) for a in inputs]
    out, state, ctx = lowbit.gated_delta_scan_forward(*dev[:5], initial_state=dev[5],
                                                      chunk_size=chunk_size)
    grads = lowbit.gated_delta_scan_backward(backend.to(dout), backend.to(dstate), ctx)
    return out, state, grads, ctx


def check_against_reference(backend, rng, inputs, chunk_size, rtol, with_dstate=True):
    q, k, v, log_decay, beta, s0 = inputs
    dout = rng.normal(size=v.shape).astype(q.dtype)
    nb, _, nh, nk = q.shape
    dstate = (rng.normal(size=(nb, nh, nk, v.shape[3])).astype(q.dtype) if with_dstate
              else None)
    out, state, grads, _ = run_backend(backend, inputs, dout, dstate, chunk_size)
    ref_out, ref_state = gated_delta_scan_ref(*inputs)
    ref_grads = gated_delta_scan_bwd_ref(*inputs, dout, dstate)
    assert out.dtype == q.dtype and state.dtype == q.dtype
    assert_close("out", ref_out, out, rtol)
    assert_close("state", ref_state, state, rtol)
    for name, ref, got in zip(GRAD_NAMES, ref_grads, grads):
        if ref is None:
            assert got is None, f"{name} must be None without an initial state"
        else:
            assert got.dtype == q.dtype, name
            assert_close(name, ref, got, rtol)
    return out, state


@pytest.mark.parametrize("per_key", [False, True])
def test_reference_backward_matches_finite_differences(rng, per_key):
    inputs = make_inputs(rng, 1, 4, 2, 3, 2, per_key=per_key)
    q, k, v, log_decay, beta, s0 = inputs
    dout = rng.normal(size=v.shape)
    dstate = rng.normal(size=s0.shape)

    def loss():
        out, state = gated_delta_scan_ref(q, k, v, log_decay, beta, s0)
        return float((out * dout).sum() + (state * dstate).sum())

    grads = gated_delta_scan_bwd_ref(q, k, v, log_decay, beta, s0, dout, dstate)
    for name, x, grad in zip(GRAD_NAMES, inputs, grads):
        assert_close(name, numerical_grad(loss, x), grad, 1e-7)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 3e-5)])
@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("shape,chunk_size", [
    ((2, 7, 3, 5, 3), 3),    # T not a multiple of chunk_size, odd sizes
    ((1, 1, 1, 4, 6), 64),   # T = 1
    ((1, 6, 2, 3, 5), 1),    # chunk_size = 1
    ((1, 9, 1, 4, 37), 4),   # one (batch, head): the numba and CUDA kernels split V into slices
])
def test_matches_reference(backend, rng, dtype, rtol, per_key, shape, chunk_size):
    inputs = make_inputs(rng, *shape, per_key=per_key, dtype=dtype)
    check_against_reference(backend, rng, inputs, chunk_size, rtol)


def test_no_initial_state_and_no_dstate(backend, rng):
    inputs = make_inputs(rng, 2, 5, 2, 4, 3, init=False)
    check_against_reference(backend, rng, inputs, 2, 1e-10, with_dstate=False)


@pytest.mark.parametrize("log_decay,beta", [(-30.0, 0.0), (-30.0, 1.0), (0.0, 0.0), (0.0, 1.0)])
@pytest.mark.parametrize("per_key", [False, True])
def test_extreme_decay_and_beta(backend, rng, log_decay, beta, per_key):
    # Decay near 0 (log_decay = -30) and exactly 1 (log_decay = 0); beta 0 (no write) and 1.
    inputs = make_inputs(rng, 1, 6, 2, 4, 3, per_key=per_key, log_decay=log_decay, beta=beta)
    out, state = check_against_reference(backend, rng, inputs, 4, 1e-10)
    s0 = inputs[5]
    if log_decay == 0.0 and beta == 0.0:
        # Nothing decays and nothing is written: the state passes through untouched.
        assert_close("state", s0, state, 1e-14)


def test_inference_equals_training_forward(backend, rng):
    inputs = [backend.to(a) for a in make_inputs(rng, 2, 5, 2, 3, 4, dtype=np.float32)]
    out, state = lowbit.gated_delta_scan(*inputs[:5], initial_state=inputs[5])
    out2, state2, _ = lowbit.gated_delta_scan_forward(*inputs[:5], initial_state=inputs[5],
                                                      chunk_size=2)
    assert_close("out", to_numpy(out2), out, 1e-6)
    assert_close("state", to_numpy(state2), state, 1e-6)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-11), (np.float32, 2e-5)])
def test_continuation_forward_and_backward(backend, rng, dtype, rtol):
    q, k, v, log_decay, beta, s0 = make_inputs(rng, 2, 11, 2, 4, 5, per_key=True, dtype=dtype)
    dout = rng.normal(size=v.shape).astype(dtype)
    dstate = rng.normal(size=s0.shape).astype(dtype)
    whole = run_backend(backend, (q, k, v, log_decay, beta, s0), dout, dstate, 3)
    cut = 6
    first_in = [a[:, :cut] for a in (q, k, v, log_decay, beta)]
    second_in = [a[:, cut:] for a in (q, k, v, log_decay, beta)]
    out1, state1, ctx1 = lowbit.gated_delta_scan_forward(
        *(backend.to(a) for a in first_in), initial_state=backend.to(s0), chunk_size=4)
    out2, state2, ctx2 = lowbit.gated_delta_scan_forward(
        *(backend.to(a) for a in second_in), initial_state=state1, chunk_size=4)
    assert_close("out", to_numpy(whole[0]), np.concatenate([to_numpy(out1), to_numpy(out2)], 1),
                 rtol)
    assert_close("state", to_numpy(whole[1]), state2, rtol)
    grads2 = lowbit.gated_delta_scan_backward(backend.to(dout[:, cut:]), backend.to(dstate), ctx2)
    grads1 = lowbit.gated_delta_scan_backward(backend.to(dout[:, :cut]), grads2[5], ctx1)
    for i, name in enumerate(GRAD_NAMES[:5]):
        joined = np.concatenate([to_numpy(grads1[i]), to_numpy(grads2[i])], axis=1)
        assert_close(name, to_numpy(whole[2][i]), joined, rtol)
    assert_close("dinitial_state", to_numpy(whole[2][5]), grads1[5], rtol)


def test_ctx_saves_checkpoints_not_states(rng):
    nb, nt, nh, nk, nv, chunk = 2, 50, 3, 4, 5, 8
    inputs = make_inputs(rng, nb, nt, nh, nk, nv, dtype=np.float32)
    _, _, ctx = lowbit.gated_delta_scan_forward(*inputs[:5], initial_state=inputs[5],
                                                chunk_size=chunk)
    checkpoint_bytes = nb * nh * math.ceil(nt / chunk) * nk * nv * 4
    assert ctx.checkpoints.nbytes == checkpoint_bytes
    input_bytes = sum(a.nbytes for a in inputs[:5])
    assert ctx.nbytes == input_bytes + checkpoint_bytes
    assert lowbit.memory_report(ctx).nbytes == ctx.nbytes


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_backward_peak_memory_at_4096_tokens(rng, name):
    if name not in lowbit.available_backends():
        pytest.skip(f"backend {name} unavailable")
    nb, nt, nh, nk, nv = 1, 4096, 2, 64, 64
    inputs = make_inputs(rng, nb, nt, nh, nk, nv, dtype=np.float32)
    dout = rng.normal(size=(nb, nt, nh, nv)).astype(np.float32)
    with lowbit.use_backend(name):
        _, _, ctx = lowbit.gated_delta_scan_forward(*inputs[:5], initial_state=inputs[5])
        lowbit.gated_delta_scan_backward(dout, None, ctx)  # compile outside the measurement
        tracemalloc.start()
        try:
            grads = lowbit.gated_delta_scan_backward(dout, None, ctx)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    input_bytes = sum(a.nbytes for a in inputs if a is not None)
    every_state = nt * nb * nh * nk * nv * 4
    assert peak <= 3 * input_bytes, (peak, input_bytes)
    assert peak <= every_state / 8, (peak, every_state)
    assert grads[0].shape == inputs[0].shape


def test_inputs_unchanged(backend, rng):
    inputs = make_inputs(rng, 1, 5, 2, 3, 4)
    keep = [a.copy() for a in inputs]
    dout = rng.normal(size=inputs[2].shape)
    dstate = rng.normal(size=inputs[5].shape)
    dout_keep, dstate_keep = dout.copy(), dstate.copy()
    run_backend(backend, inputs, dout, dstate, 2)
    for a, b in zip(inputs + [dout, dstate], keep + [dout_keep, dstate_keep]):
        np.testing.assert_array_equal(a, b)


# -- validation: one test per rule; the message names the argument -----------------------------

def _valid(rng):
    return dict(zip(("q", "k", "v", "log_decay", "beta", "initial_state"),
                    make_inputs(rng, 2, 3, 2, 4, 5, dtype=np.float32)))


@pytest.mark.parametrize("name", ["q", "k", "v", "log_decay", "beta", "initial_state"])
def test_rejects_non_array(rng, never_runs, name):
    args = _valid(rng)
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=name):
        lowbit.gated_delta_scan(**args)


@pytest.mark.parametrize("name", ["q", "k", "v", "log_decay", "beta", "initial_state"])
def test_rejects_non_float_dtype(rng, never_runs, name):
    args = _valid(rng)
    args[name] = args[name].astype(np.int32)
    with pytest.raises(TypeError, match=name):
        lowbit.gated_delta_scan(**args)


@pytest.mark.parametrize("name", ["k", "v", "log_decay", "beta", "initial_state"])
def test_rejects_dtype_other_than_q(rng, never_runs, name):
    args = _valid(rng)
    args[name] = args[name].astype(np.float64)
    with pytest.raises(TypeError, match=name):
        lowbit.gated_delta_scan(**args)


@pytest.mark.parametrize("name,shape", [
    ("q", (2, 3, 2)), ("k", (2, 3, 2, 3)), ("v", (2, 3, 1, 5)), ("v", (2, 3, 2)),
    ("log_decay", (2, 3, 2, 5)), ("log_decay", (2, 3)), ("beta", (2, 3, 1)),
    ("initial_state", (2, 2, 5, 4)),
])
def test_rejects_bad_shape(rng, never_runs, name, shape):
    args = _valid(rng)
    args[name] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=name):
        lowbit.gated_delta_scan(**args)


def test_rejects_non_finite_initial_state(rng, never_runs):
    args = _valid(rng)
    args["initial_state"][0, 1, 2, 3] = np.inf
    with pytest.raises(ValueError, match="initial_state"):
        lowbit.gated_delta_scan(**args)


@pytest.mark.parametrize("chunk_size,error", [(0, ValueError), (-3, ValueError),
                                              (2.0, TypeError), (True, TypeError)])
def test_rejects_bad_chunk_size(rng, never_runs, chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        lowbit.gated_delta_scan_forward(**_valid(rng), chunk_size=chunk_size)


@pytest.mark.parametrize("name", ["dout", "dstate"])
def test_backward_rejects_bad_gradient_shape(rng, never_runs, name):
    args = _valid(rng)
    with never_runs.paused():
        _, _, ctx = lowbit.gated_delta_scan_forward(**args)
    grads = {"dout": np.zeros(args["v"].shape, np.float32),
             "dstate": np.zeros(args["initial_state"].shape, np.float32)}
    grads[name] = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match=name):
        lowbit.gated_delta_scan_backward(grads["dout"], grads["dstate"], ctx)


def test_backward_rejects_foreign_ctx(rng, never_runs):
    with pytest.raises(TypeError, match="ctx"):
        lowbit.gated_delta_scan_backward(np.zeros((2, 3, 2, 5), np.float32), None, object())


# -- CUDA kernels: several blocks along V -----
# The launcher (lowbit/ops/gated_delta_scan/_cuda.py) splits each column of the state over a
# group of threads and V over blocks; MAX_THREADS is lowered here so that small shapes, which
# cudasim runs quickly, still take several blocks along V, the last one partly idle.

@pytest.fixture(params=["cudasim", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernels(request, monkeypatch):
    """(launcher module with ``MAX_THREADS`` lowered to 64, ``helpers.Backend``), under a
    forced cudasim or cuda backend."""
    from helpers import Backend
    from lowbit import _dispatch
    from lowbit.ops.gated_delta_scan import _cuda

    reason = _dispatch.backend_unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"backend {request.param} unavailable: {reason}")
    monkeypatch.setattr(_cuda, "MAX_THREADS", 64)
    with lowbit.use_backend(request.param):
        yield _cuda, Backend(request.param)


@pytest.mark.parametrize("shape,chunk_size,per_key,dtype,rtol", [
    # group 4, 16 columns per block: blocks of 16, 16, 5 columns
    ((1, 9, 2, 20, 37), 4, True, np.float64, 1e-10),
    ((1, 9, 2, 20, 37), 4, False, np.float32, 3e-5),
    # group 8 (K = 64), 8 columns per block: 8 + 3
    ((2, 5, 1, 64, 11), 2, False, np.float64, 1e-10),
    ((2, 5, 1, 64, 11), 2, True, np.float32, 3e-5),
    # group 2, 32 + 5 columns; tiles of 16 tokens forward, 2 + 2 + 1 in each chunk backward
    ((1, 37, 1, 12, 37), 5, True, np.float64, 1e-10),
    ((1, 37, 1, 12, 37), 5, False, np.float32, 3e-5),
    # groups of 16 and 32 threads (K = 100, 130): 4 + 1 and 2 + 1 columns
    ((1, 3, 1, 100, 5), 2, True, np.float64, 1e-10),
    ((1, 3, 1, 130, 3), 2, False, np.float64, 1e-10),
])
def test_kernels_with_several_blocks_along_v(kernels, rng, shape, chunk_size, per_key, dtype,
                                             rtol):
    launcher, backend = kernels
    nk, nv = shape[3], shape[4]
    group, cols = launcher._layout(nk, nv)
    assert group * launcher.ROWS >= nk and nv % cols and nv > cols
    inputs = make_inputs(rng, *shape, per_key=per_key, dtype=dtype)
    check_against_reference(backend, rng, inputs, chunk_size, rtol)


def test_kernels_are_deterministic_across_blocks(kernels, rng):
    inputs = make_inputs(rng, 1, 5, 1, 20, 37, per_key=True, dtype=np.float32)
    dout = rng.normal(size=inputs[2].shape).astype(np.float32)
    dstate = rng.normal(size=inputs[5].shape).astype(np.float32)
    backend = kernels[1]
    first = run_backend(backend, inputs, dout, dstate, 3)
    second = run_backend(backend, inputs, dout, dstate, 3)
    for a, b in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2])):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_kernel_layout_fills_a_gpu_at_b16_h8_k64_v64():
    from lowbit.ops.gated_delta_scan import _cuda

    group, cols = _cuda._layout(64, 64)
    blocks = 16 * 8 * -(-64 // cols)
    assert (group, cols) == (8, 32)
    assert blocks * group * cols // 32 == 2048  # warps: 16 per SM of a 132-SM GPU


def test_kernels_refuse_k_past_the_register_layout(kernels, rng):
    launcher, backend = kernels
    nk = launcher.ROWS * launcher.MAX_GROUP + 1
    inputs = make_inputs(rng, 1, 2, 1, nk, 3, dtype=np.float32)
    with pytest.raises(ValueError, match="K=257"):
        lowbit.gated_delta_scan(*(backend.to(a) for a in inputs[:5]),
                                initial_state=backend.to(inputs[5]))
