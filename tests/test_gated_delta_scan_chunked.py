"""The chunked (WY / UT) form of the gated delta rule against reference/gated_delta_scan.py:
the numpy backend's (``_numpy.use_chunked``) and the numba one's (``_numba_chunked.py``, its
products on the FMA tiles or BLAS, ``_numba.use_chunked``), and the rules that pick them.

Siblings: ``tests/test_gated_delta_scan.py`` (every backend through the public op; its input
maker is shared here).
"""

import functools

import numpy as np
import pytest
from helpers import assert_close
from test_gated_delta_scan import GRAD_NAMES, make_inputs

import lowbit
from lowbit.reference.gated_delta_scan import gated_delta_scan_bwd_ref, gated_delta_scan_ref


# -- the chunked (WY / UT) form of both backends, and numpy's rule (use_chunked) -------------

@pytest.fixture(params=["numba", "numpy"])
def chunked(request):
    """The chunked form's module: ``_numba_chunked`` (called directly), or ``_numpy`` (whose
    ``forward``/``backward`` take it for the shapes below, by its ``use_chunked`` rule)."""
    if request.param == "numba":
        if "numba" not in lowbit.available_backends():
            pytest.skip("backend numba unavailable")
        from lowbit.ops.gated_delta_scan import _numba_chunked as module
    else:
        from lowbit.ops.gated_delta_scan import _numpy as module
    return module


def _chunked_run(module, inputs, dout, dstate, chunk_size):
    """module.forward / backward on the contiguous working arrays that ``__init__`` passes."""
    q, k, v, log_decay, beta, s0 = inputs
    work = (q, k, v, np.ascontiguousarray(log_decay[..., None]), beta)
    s0 = np.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), q.dtype) if s0 is None else s0
    out, state, checkpoints = module.forward(*work, s0, chunk_size, True)
    grads = module.backward(dout, dstate, *work, checkpoints, chunk_size)
    return out, state, grads[:3] + (grads[3][..., 0],) + grads[4:]


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 3e-5)])
@pytest.mark.parametrize("shape,chunk_size,init", [
    ((2, 45, 2, 5, 7), 16, True),    # T not a multiple of the chunk: 16 + 16 + 13
    ((1, 20, 3, 4, 3), 64, False),   # T < chunk (one padded block), no initial state
    ((1, 150, 1, 3, 6), 100, True),  # chunks longer than BLOCK: 64 + 36 tokens in each
])
def test_chunked_matches_reference(chunked, rng, dtype, rtol, shape, chunk_size, init):
    inputs = make_inputs(rng, *shape, dtype=dtype, init=init)
    dout = rng.normal(size=inputs[2].shape).astype(dtype)
    nb, _, nh, nk, nv = shape
    dstate = rng.normal(size=(nb, nh, nk, nv)).astype(dtype)
    out, state, grads = _chunked_run(chunked, inputs, dout, dstate, chunk_size)
    ref_out, ref_state = gated_delta_scan_ref(*inputs)
    assert_close("out", ref_out, out, rtol)
    assert_close("state", ref_state, state, rtol)
    ref_grads = gated_delta_scan_bwd_ref(*inputs, dout, dstate)
    if not init:  # the reference returns None; the kernel's gradient of the zero state
        ref_grads = ref_grads[:5] + (gated_delta_scan_bwd_ref(
            *inputs[:5], np.zeros_like(dstate), dout, dstate)[5],)
    for name, ref, got in zip(GRAD_NAMES, ref_grads, grads):
        assert got.dtype == dtype, name
        assert_close(name, ref, got, rtol)


@pytest.mark.parametrize("decay", [0.0, 1.0])
def test_chunked_decays_of_exactly_zero_and_one(chunked, rng, decay):
    # A decay of 0 (log-decay -inf) on every third token resets the state; 1 keeps it whole.
    inputs = make_inputs(rng, 1, 40, 2, 4, 3)
    inputs[3][:, ::3] = np.log(decay) if decay else -np.inf
    dout = rng.normal(size=inputs[2].shape)
    dstate = rng.normal(size=inputs[5].shape)
    out, state, grads = _chunked_run(chunked, inputs, dout, dstate, 17)
    ref_out, ref_state = gated_delta_scan_ref(*inputs)
    assert_close("out", ref_out, out, 1e-10)
    assert_close("state", ref_state, state, 1e-10)
    for name, ref, got in zip(GRAD_NAMES, gated_delta_scan_bwd_ref(*inputs, dout, dstate), grads):
        assert_close(name, ref, got, 1e-10)


def test_chunked_is_deterministic(chunked, rng):
    inputs = make_inputs(rng, 2, 70, 2, 4, 5, dtype=np.float32)
    dout = rng.normal(size=inputs[2].shape).astype(np.float32)
    dstate = rng.normal(size=inputs[5].shape).astype(np.float32)
    first = _chunked_run(chunked, inputs, dout, dstate, 32)
    second = _chunked_run(chunked, inputs, dout, dstate, 32)
    for a, b in zip((first[0], first[1], *first[2]), (second[0], second[1], *second[2])):
        np.testing.assert_array_equal(a, b)


def test_chunked_checkpoints_drive_the_recurrent_backward(chunked, rng):
    # Both forms save the same ctx: the state entering each checkpoint chunk.
    if "numba" not in lowbit.available_backends():
        pytest.skip("backend numba unavailable")
    from lowbit.ops.gated_delta_scan import _numba

    inputs = make_inputs(rng, 1, 40, 2, 4, 3)
    q, k, v, log_decay, beta, s0 = inputs
    work = (q, k, v, np.ascontiguousarray(log_decay[..., None]), beta)
    dout = rng.normal(size=v.shape)
    dstate = rng.normal(size=s0.shape)
    _, _, checkpoints = chunked.forward(*work, s0, 16, True)
    _, _, expected = _numba.recurrent_forward(*work, s0, 16, True)
    assert_close("checkpoints", expected, checkpoints, 1e-12)
    grads = _numba.recurrent_backward(dout, dstate, *work, checkpoints, 16)
    grads = grads[:3] + (grads[3][..., 0],) + grads[4:]
    for name, ref, got in zip(GRAD_NAMES, gated_delta_scan_bwd_ref(*inputs, dout, dstate), grads):
        assert_close(name, ref, got, 1e-10)


def test_numpy_chunked_rule():
    from lowbit.ops.gated_delta_scan import _numpy

    rule, least = _numpy.use_chunked, _numpy.MIN_BLOCK
    assert rule(2048, False) and rule(least, False)
    assert not rule(least - 1, False)   # too few tokens: token by token
    assert not rule(2048, True)         # per-key decays stay token by token


@pytest.mark.parametrize("nt", [3, 4])
def test_numpy_takes_the_path_of_the_rule(rng, nt):
    from lowbit.ops.gated_delta_scan import _numpy

    q, k, v, log_decay, beta, s0 = make_inputs(rng, 1, nt, 2, 4, 3, dtype=np.float32)
    work = (q, k, v, np.ascontiguousarray(log_decay[..., None]), beta)
    picked = _numpy.forward(*work, s0, 2, True)
    chunked = _numpy._forward_chunked(*work, s0, 2, True)
    same = all(np.array_equal(a, b) for a, b in zip(picked, chunked))
    assert same == _numpy.use_chunked(nt, False)


def test_numpy_chunked_inference_equals_training_bitwise(rng):
    # The blocks do not depend on chunk_size: checkpoints inside a block come from its algebra.
    inputs = make_inputs(rng, 1, 70, 2, 4, 3, dtype=np.float32)
    with lowbit.use_backend("numpy"):
        out, state = lowbit.gated_delta_scan(*inputs[:5], initial_state=inputs[5])
        out2, state2, _ = lowbit.gated_delta_scan_forward(*inputs[:5], initial_state=inputs[5],
                                                          chunk_size=5)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(state, state2)


# -- the numba chunked kernels at K = V = 64: FMA tiles or BLAS, and the rule that runs them

@pytest.fixture(params=["tiles", "blas"])
def chunked_products(request, monkeypatch):
    """``_numba_chunked`` with its products on the FMA tiles (where the CPU has them) or
    forced onto BLAS (``USE_FMA`` off)."""
    if "numba" not in lowbit.available_backends():
        pytest.skip("backend numba unavailable")
    from lowbit.ops.gated_delta_scan import _numba_chunked as module

    if request.param == "tiles":
        if not module.USE_FMA:
            pytest.skip("no AVX-512 on this CPU")
    else:
        monkeypatch.setattr(module, "USE_FMA", False)
    assert module._tiles(np.dtype(np.float32), 64, 64) == module.USE_FMA
    return module


@functools.lru_cache(maxsize=None)
def _k64_case():
    """float32 inputs at K = V = 64 (T = 150 in chunks of 100: blocks of 64 + 36 and 50 tokens,
    states recomputed inside a chunk) with their reference results, built once for both paths
    (the float64 reference takes seconds here)."""
    rng = np.random.default_rng(18)
    inputs = make_inputs(rng, 1, 150, 1, 64, 64, dtype=np.float32)
    dout = rng.normal(size=inputs[2].shape).astype(np.float32)
    dstate = rng.normal(size=inputs[5].shape).astype(np.float32)
    refs = (*gated_delta_scan_ref(*inputs), *gated_delta_scan_bwd_ref(*inputs, dout, dstate))
    return inputs, dout, dstate, refs


def test_chunked_products_at_k64_v64(chunked_products):
    inputs, dout, dstate, refs = _k64_case()
    out, state, grads = _chunked_run(chunked_products, inputs, dout, dstate, 100)
    for name, ref, got in zip(("out", "state", *GRAD_NAMES), refs, (out, state, *grads)):
        assert_close(name, ref, got, 3e-5)
    again = _chunked_run(chunked_products, inputs, dout, dstate, 100)
    for a, b in zip((out, state, *grads), (again[0], again[1], *again[2])):
        np.testing.assert_array_equal(a, b)


def test_chunked_forward_forgets_at_a_zero_decay_k64(chunked_products, rng):
    # A decay of exactly 0 at token 100 (inside a block) leaves nothing of what came before: the
    # output from token 100 on and the final state must not change, bit for bit, when the
    # earlier tokens and the initial state do (every term through the zero decay an exact zero).
    inputs = make_inputs(rng, 1, 150, 1, 64, 64, dtype=np.float32)
    inputs[3][:, 100] = -np.inf
    other = [a.copy() for a in inputs]
    for a in other[:3]:
        a[:, :100] = rng.normal(size=a[:, :100].shape)
    other[5] = rng.normal(size=other[5].shape).astype(np.float32)
    runs = []
    for q, k, v, log_decay, beta, s0 in (inputs, other):
        runs.append(chunked_products.forward(q, k, v, np.ascontiguousarray(log_decay[..., None]),
                                             beta, s0, 64, True))
    ref_out, ref_state = gated_delta_scan_ref(*inputs)
    assert_close("out", ref_out, runs[0][0], 3e-5)
    assert_close("state", ref_state, runs[0][1], 3e-5)
    np.testing.assert_array_equal(runs[0][0][:, 100:], runs[1][0][:, 100:])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


def test_numba_chunked_rule(monkeypatch):
    from lowbit.ops.gated_delta_scan import _numba, _numba_chunked

    monkeypatch.setattr(_numba_chunked, "USE_FMA", True)
    rule, least, f32 = _numba.use_chunked, _numba.CHUNKED_MIN_TOKENS, np.dtype(np.float32)
    for backward in (False, True):
        assert rule(backward, f32, 2048, 64, 64, False, 64)
        assert not rule(backward, f32, least - 1, 64, 64, False, 64)     # mostly padding
        assert not rule(backward, f32, 2048, 64, 64, False, 32)          # blocks cut by chunks
        assert not rule(backward, np.dtype(np.float64), 2048, 64, 64, False, 64)
        assert not rule(backward, f32, 2048, 128, 64, False, 64)         # tiles need K = V = 64
        assert not rule(backward, f32, 2048, 64, 64, True, 64)           # per-key decays
    assert rule(False, f32, least, 64, 64, False, 100)    # a forward chunk of 64 + 36 tokens
    assert not rule(True, f32, 2048, 64, 64, False, 128)  # the backward would recompute states
    monkeypatch.setattr(_numba_chunked, "USE_FMA", False)
    assert not rule(False, f32, 2048, 64, 64, False, 64)  # no tiles: BLAS is slower


@pytest.mark.parametrize("nt", [127, 128])
def test_numba_takes_the_path_of_the_rule(rng, nt):
    if "numba" not in lowbit.available_backends():
        pytest.skip("backend numba unavailable")
    from lowbit.ops.gated_delta_scan import _numba, _numba_chunked as chunked

    q, k, v, log_decay, beta, s0 = make_inputs(rng, 1, nt, 1, 64, 64, dtype=np.float32)
    work = (q, k, v, np.ascontiguousarray(log_decay[..., None]), beta)
    fwd = (*work, s0, 64, True)
    bwd = (rng.normal(size=v.shape).astype(np.float32), s0, *work,
           _numba.recurrent_forward(*fwd)[2], 64)
    for backward, args, picked, fast, slow in (
            (False, fwd, _numba.forward, chunked.forward, _numba.recurrent_forward),
            (True, bwd, _numba.backward, chunked.backward, _numba.recurrent_backward)):
        rule = _numba.use_chunked(backward, q.dtype, nt, 64, 64, False, 64)
        assert rule == (nt >= _numba.CHUNKED_MIN_TOKENS and chunked.USE_FMA)
        for a, b in zip(picked(*args), (fast if rule else slow)(*args)):
            np.testing.assert_array_equal(a, b)
