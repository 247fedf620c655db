"""selective_scan on every backend against reference/selective_scan.py.

Op: lowbit/ops/selective_scan; kernels: cuda/selective_scan.cu. The reference backward is checked
against central finite differences; every backend's forward, final state and gradients
(dinitial_state and a nonzero dstate included) against the reference.
"""

import math
import tracemalloc

import numpy as np
import pytest

import lowbit
from helpers import assert_close, numerical_grad, to_numpy
from lowbit.reference.selective_scan import selective_scan_bwd_ref, selective_scan_ref

GRAD_NAMES = ("dx", "dB", "dC", "ddt", "ddt_bias", "dA_log", "dD", "dinitial_state")
INPUT_NAMES = ("x", "B", "C", "dt", "dt_bias", "A_log", "D", "initial_state")


def make_inputs(rng, nb, nt, nh, npp, nn, *, dtype=np.float64, init=True, dt=None):
    """Inputs with steps around softplus(0) and decay rates around 1."""
    x = rng.normal(size=(nb, nt, nh, npp))
    B = rng.normal(size=(nb, nt, nh, nn))
    C = rng.normal(size=(nb, nt, nh, nn))
    dt = rng.normal(size=(nb, nt, nh)) if dt is None else np.full((nb, nt, nh), float(dt))
    dt_bias = rng.normal(scale=0.5, size=nh)
    A_log = rng.normal(scale=0.5, size=nh)
    D = rng.normal(size=nh)
    s0 = rng.normal(size=(nb, nh, npp, nn)) if init else None
    return [None if a is None else a.astype(dtype) for a in (x, B, C, dt, dt_bias, A_log, D, s0)]


def run_backend(backend, inputs, dout, dstate, dt_floor, chunk_size):
    dev = [backend.to(a) for a in inputs]
    out, state, ctx = lowbit.selective_scan_forward(*dev[:7], initial_state=dev[7],
                                                    dt_floor=dt_floor, chunk_size=chunk_size)
    grads = lowbit.selective_scan_backward(backend.to(dout), backend.to(dstate), ctx)
    return out, state, grads, ctx


def check_against_reference(backend, rng, inputs, chunk_size, rtol, dt_floor=0.0,
                            with_dstate=True):
    x = inputs[0]
    dout = rng.normal(size=x.shape).astype(x.dtype)
    nb, _, nh, npp = x.shape
    dstate = (rng.normal(size=(nb, nh, npp, inputs[1].shape[3])).astype(x.dtype) if with_dstate
              else None)
    out, state, grads, _ = run_backend(backend, inputs, dout, dstate, dt_floor, chunk_size)
    ref_out, ref_state = selective_scan_ref(*inputs, dt_floor)
    ref_grads = selective_scan_bwd_ref(*inputs, dout, dstate, dt_floor)
    assert out.dtype == x.dtype and state.dtype == x.dtype
    assert_close("out", ref_out, out, rtol)
    assert_close("state", ref_state, state, rtol)
    for name, ref, got in zip(GRAD_NAMES, ref_grads, grads):
        if ref is None:
            assert got is None, f"{name} must be None without an initial state"
        else:
            assert got.dtype == x.dtype, name
            assert_close(name, ref, got, rtol)
    return out, state, grads


@pytest.mark.parametrize("dt_floor", [0.0, 0.7])
def test_reference_backward_matches_finite_differences(rng, dt_floor):
    inputs = make_inputs(rng, 2, 4, 2, 3, 2)
    dout = rng.normal(size=inputs[0].shape)
    dstate = rng.normal(size=inputs[7].shape)

    def loss():
        out, state = selective_scan_ref(*inputs, dt_floor)
        return float((out * dout).sum() + (state * dstate).sum())

    grads = selective_scan_bwd_ref(*inputs, dout, dstate, dt_floor)
    for name, x, grad in zip(GRAD_NAMES, inputs, grads):
        assert_close(name, numerical_grad(loss, x), grad, 1e-7)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 3e-5)])
@pytest.mark.parametrize("dt_floor", [0.0, 0.7])
@pytest.mark.parametrize("shape,chunk_size", [
    ((2, 7, 3, 5, 3), 3),     # T not a multiple of chunk_size, odd sizes
    ((1, 1, 1, 4, 6), 64),    # T = 1
    ((1, 6, 2, 3, 5), 1),     # chunk_size = 1
    ((1, 5, 1, 37, 2), 2),    # P above one warp: several rows per CUDA lane
])
def test_matches_reference(backend, rng, dtype, rtol, dt_floor, shape, chunk_size):
    inputs = make_inputs(rng, *shape, dtype=dtype)
    check_against_reference(backend, rng, inputs, chunk_size, rtol, dt_floor)


def test_no_initial_state_and_no_dstate(backend, rng):
    inputs = make_inputs(rng, 2, 5, 2, 4, 3, init=False)
    check_against_reference(backend, rng, inputs, 2, 1e-10, with_dstate=False)


@pytest.mark.parametrize("dtype,dt", [(np.float64, 100.0), (np.float64, -100.0),
                                      (np.float32, 100.0), (np.float32, -80.0)])
def test_extreme_steps(backend, rng, dtype, dt):
    # dt + dt_bias far in either tail: softplus neither overflows nor loses its sign. (In float32
    # softplus(-100) ~ 4e-44 is subnormal, so its tail is tested at -80, still a normal number.)
    inputs = make_inputs(rng, 1, 4, 2, 3, 2, dtype=dtype, dt=dt)
    check_against_reference(backend, rng, inputs, 3, 1e-10 if dtype == np.float64 else 3e-5)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softplus_of_100_is_100(backend, dtype):
    # One token from a zero state with x = B = C = 1, D = 0: out = delta = softplus(100).
    ones = np.ones((1, 1, 1, 1), dtype)
    zero = np.zeros(1, dtype)
    out, state = lowbit.selective_scan(
        *(backend.to(a) for a in (ones, ones, ones, np.full((1, 1, 1), 100, dtype), zero, zero,
                                  zero)))
    assert float(to_numpy(out)[0, 0, 0, 0]) == 100.0
    assert float(to_numpy(state)[0, 0, 0, 0]) == 100.0


def test_floor_everywhere_active_gives_no_step_gradient(backend, rng):
    inputs = make_inputs(rng, 2, 5, 2, 3, 2)
    _, _, grads = check_against_reference(backend, rng, inputs, 2, 1e-10, dt_floor=50.0)
    assert not to_numpy(grads[3]).any() and not to_numpy(grads[4]).any()


def test_inference_equals_training_forward(backend, rng):
    inputs = [backend.to(a) for a in make_inputs(rng, 2, 5, 2, 3, 4, dtype=np.float32)]
    out, state = lowbit.selective_scan(*inputs[:7], initial_state=inputs[7], dt_floor=0.3)
    out2, state2, _ = lowbit.selective_scan_forward(*inputs[:7], initial_state=inputs[7],
                                                    dt_floor=0.3, chunk_size=2)
    assert_close("out", to_numpy(out2), out, 1e-6)
    assert_close("state", to_numpy(state2), state, 1e-6)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-11), (np.float32, 2e-5)])
def test_continuation_forward_and_backward(backend, rng, dtype, rtol):
    inputs = make_inputs(rng, 2, 11, 2, 4, 3, dtype=dtype)
    x, B, C, dt, dt_bias, A_log, D, s0 = inputs
    dout = rng.normal(size=x.shape).astype(dtype)
    dstate = rng.normal(size=s0.shape).astype(dtype)
    whole = run_backend(backend, inputs, dout, dstate, 0.0, 3)
    cut = 6
    params = [backend.to(a) for a in (dt_bias, A_log, D)]
    first = [backend.to(a[:, :cut]) for a in (x, B, C, dt)]
    second = [backend.to(a[:, cut:]) for a in (x, B, C, dt)]
    out1, state1, ctx1 = lowbit.selective_scan_forward(*first, *params,
                                                       initial_state=backend.to(s0),
                                                       chunk_size=4)
    out2, state2, ctx2 = lowbit.selective_scan_forward(*second, *params, initial_state=state1,
                                                       chunk_size=4)
    assert_close("out", to_numpy(whole[0]), np.concatenate([to_numpy(out1), to_numpy(out2)], 1),
                 rtol)
    assert_close("state", to_numpy(whole[1]), state2, rtol)
    grads2 = lowbit.selective_scan_backward(backend.to(dout[:, cut:]), backend.to(dstate), ctx2)
    grads1 = lowbit.selective_scan_backward(backend.to(dout[:, :cut]), grads2[7], ctx1)
    for i, name in enumerate(GRAD_NAMES[:4]):
        joined = np.concatenate([to_numpy(grads1[i]), to_numpy(grads2[i])], axis=1)
        assert_close(name, to_numpy(whole[2][i]), joined, rtol)
    for i, name in enumerate(GRAD_NAMES[4:7], start=4):
        assert_close(name, to_numpy(whole[2][i]), to_numpy(grads1[i]) + to_numpy(grads2[i]),
                     rtol)
    assert_close("dinitial_state", to_numpy(whole[2][7]), grads1[7], rtol)


def test_ctx_saves_checkpoints_not_states(rng):
    nb, nt, nh, npp, nn, chunk = 2, 50, 3, 4, 5, 8
    inputs = make_inputs(rng, nb, nt, nh, npp, nn, dtype=np.float32)
    _, _, ctx = lowbit.selective_scan_forward(*inputs[:7], initial_state=inputs[7],
                                              chunk_size=chunk)
    checkpoint_bytes = nb * nh * math.ceil(nt / chunk) * npp * nn * 4
    assert ctx.checkpoints.nbytes == checkpoint_bytes
    assert ctx.nbytes == sum(a.nbytes for a in inputs[:4]) + checkpoint_bytes
    assert lowbit.memory_report(ctx).nbytes == ctx.nbytes


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_backward_peak_memory_at_4096_tokens(rng, name):
    if name not in lowbit.available_backends():
        pytest.skip(f"backend {name} unavailable")
    nb, nt, nh, npp, nn = 1, 4096, 2, 64, 16
    inputs = make_inputs(rng, nb, nt, nh, npp, nn, dtype=np.float32, init=False)
    dout = rng.normal(size=(nb, nt, nh, npp)).astype(np.float32)
    with lowbit.use_backend(name):
        _, _, ctx = lowbit.selective_scan_forward(*inputs[:7], initial_state=inputs[7])
        lowbit.selective_scan_backward(dout, None, ctx)  # compile outside the measurement
        tracemalloc.start()
        try:
            grads = lowbit.selective_scan_backward(dout, None, ctx)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    input_bytes = sum(a.nbytes for a in inputs if a is not None)
    every_state = nt * nb * nh * npp * nn * 4
    assert peak <= 3 * input_bytes, (peak, input_bytes)
    assert peak <= every_state / 4, (peak, every_state)
    assert grads[0].shape == inputs[0].shape


def test_inputs_unchanged(backend, rng):
    inputs = make_inputs(rng, 1, 5, 2, 3, 4)
    keep = [a.copy() for a in inputs]
    dout = rng.normal(size=inputs[0].shape)
    dstate = rng.normal(size=inputs[7].shape)
    dout_keep, dstate_keep = dout.copy(), dstate.copy()
    run_backend(backend, inputs, dout, dstate, 0.2, 2)
    for a, b in zip(inputs + [dout, dstate], keep + [dout_keep, dstate_keep]):
        np.testing.assert_array_equal(a, b)


# -- validation: one test per rule; the message names the argument -----------------------------

def _valid(rng):
    return dict(zip(INPUT_NAMES, make_inputs(rng, 2, 3, 2, 4, 5, dtype=np.float32)))


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_rejects_non_array(rng, never_runs, name):
    args = _valid(rng)
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=name):
        lowbit.selective_scan(**args)


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_rejects_non_float_dtype(rng, never_runs, name):
    args = _valid(rng)
    args[name] = args[name].astype(np.int32)
    with pytest.raises(TypeError, match=name):
        lowbit.selective_scan(**args)


@pytest.mark.parametrize("name", INPUT_NAMES[1:])
def test_rejects_dtype_other_than_x(rng, never_runs, name):
    args = _valid(rng)
    args[name] = args[name].astype(np.float64)
    with pytest.raises(TypeError, match=name):
        lowbit.selective_scan(**args)


@pytest.mark.parametrize("name,shape", [
    ("x", (2, 3, 2)), ("B", (2, 3, 1, 5)), ("B", (2, 3, 2)), ("C", (2, 3, 2, 4)),
    ("dt", (2, 3, 1)), ("dt", (2, 3, 2, 1)), ("dt_bias", (3,)), ("A_log", (2, 1)), ("D", (1,)),
    ("initial_state", (2, 2, 5, 4)),
])
def test_rejects_bad_shape(rng, never_runs, name, shape):
    args = _valid(rng)
    args[name] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=name):
        lowbit.selective_scan(**args)


def test_rejects_non_finite_initial_state(rng, never_runs):
    args = _valid(rng)
    args["initial_state"][1, 0, 2, 3] = np.nan
    with pytest.raises(ValueError, match="initial_state"):
        lowbit.selective_scan(**args)


@pytest.mark.parametrize("dt_floor,error", [(-0.1, ValueError), (math.inf, ValueError),
                                            (math.nan, ValueError), ("0", TypeError)])
def test_rejects_bad_dt_floor(rng, never_runs, dt_floor, error):
    with pytest.raises(error, match="dt_floor"):
        lowbit.selective_scan(**_valid(rng), dt_floor=dt_floor)


@pytest.mark.parametrize("chunk_size,error", [(0, ValueError), (-3, ValueError),
                                              (2.0, TypeError), (True, TypeError)])
def test_rejects_bad_chunk_size(rng, never_runs, chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        lowbit.selective_scan_forward(**_valid(rng), chunk_size=chunk_size)


@pytest.mark.parametrize("name", ["dout", "dstate"])
def test_backward_rejects_bad_gradient_shape(rng, never_runs, name):
    args = _valid(rng)
    with never_runs.paused():
        _, _, ctx = lowbit.selective_scan_forward(**args)
    grads = {"dout": np.zeros(args["x"].shape, np.float32),
             "dstate": np.zeros(args["initial_state"].shape, np.float32)}
    grads[name] = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match=name):
        lowbit.selective_scan_backward(grads["dout"], grads["dstate"], ctx)


def test_backward_rejects_foreign_ctx(rng, never_runs):
    with pytest.raises(TypeError, match="ctx"):
        lowbit.selective_scan_backward(np.zeros((2, 3, 2, 4), np.float32), None, object())


# -- CUDA kernels: several blocks along P --------------------------------------------------------
# The launcher (lowbit/ops/selective_scan/_cuda.py) splits each row p of the state over a group
# of threads and P over blocks; MAX_THREADS is lowered here so that small shapes, which cudasim
# runs quickly, still take several blocks along P, the last one partly idle.

@pytest.fixture(params=["cudasim", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernels(request, monkeypatch):
    """(launcher module with ``MAX_THREADS`` lowered to 64, ``helpers.Backend``), under a
    forced cudasim or cuda backend."""
    from helpers import Backend
    from lowbit import _dispatch
    from lowbit.ops.selective_scan import _cuda

    reason = _dispatch.backend_unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"backend {request.param} unavailable: {reason}")
    monkeypatch.setattr(_cuda, "MAX_THREADS", 64)
    with lowbit.use_backend(request.param):
        yield _cuda, Backend(request.param)


@pytest.mark.parametrize("shape,chunk_size,dt_floor,dtype,rtol", [
    # group 4, 16 rows p per block: blocks of 16, 16, 5
    ((1, 9, 2, 37, 20), 4, 0.7, np.float64, 1e-10),
    ((1, 9, 2, 37, 20), 4, 0.0, np.float32, 3e-5),
    # group 8 (N = 64), 8 rows p per block: 8 + 3
    ((2, 5, 1, 11, 64), 2, 0.0, np.float64, 1e-10),
    ((2, 5, 1, 11, 64), 2, 0.7, np.float32, 3e-5),
    # group 2, 32 + 5 rows p; tiles of 16 tokens forward, 2 + 2 + 1 in each chunk backward
    ((1, 37, 1, 37, 12), 5, 0.7, np.float64, 1e-10),
    ((1, 37, 1, 37, 12), 5, 0.0, np.float32, 3e-5),
    # groups of 16 and 32 threads (N = 100, 130): 4 + 1 and 2 + 1 rows p
    ((1, 3, 1, 5, 100), 2, 0.7, np.float64, 1e-10),
    ((1, 3, 1, 3, 130), 2, 0.0, np.float64, 1e-10),
])
def test_kernels_with_several_blocks_along_p(kernels, rng, shape, chunk_size, dt_floor, dtype,
                                             rtol):
    launcher, backend = kernels
    npp, nn = shape[3], shape[4]
    group, cols = launcher._layout(npp, nn)
    assert group * launcher.STATES >= nn and npp % cols and npp > cols
    inputs = make_inputs(rng, *shape, dtype=dtype)
    check_against_reference(backend, rng, inputs, chunk_size, rtol, dt_floor)


def test_kernels_are_deterministic_across_blocks(kernels, rng):
    inputs = make_inputs(rng, 1, 5, 1, 37, 20, dtype=np.float32)
    dout = rng.normal(size=inputs[0].shape).astype(np.float32)
    dstate = rng.normal(size=inputs[7].shape).astype(np.float32)
    backend = kernels[1]
    first = run_backend(backend, inputs, dout, dstate, 0.1, 3)
    second = run_backend(backend, inputs, dout, dstate, 0.1, 3)
    for a, b in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2])):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_kernel_layout_fills_a_gpu_at_b16_h8_p64_n64():
    from lowbit.ops.selective_scan import _cuda

    group, cols = _cuda._layout(64, 64)
    blocks = 16 * 8 * -(-64 // cols)
    assert (group, cols) == (8, 32)
    assert blocks * group * cols // 32 == 2048  # warps: 16 per SM of a 132-SM GPU


def test_kernels_refuse_n_past_the_register_layout(kernels, rng):
    launcher, backend = kernels
    nn = launcher.STATES * launcher.MAX_GROUP + 1
    inputs = make_inputs(rng, 1, 2, 1, 3, nn, dtype=np.float32)
    with pytest.raises(ValueError, match="N=257"):
        lowbit.selective_scan(*(backend.to(a) for a in inputs[:7]),
                              initial_state=backend.to(inputs[7]))
