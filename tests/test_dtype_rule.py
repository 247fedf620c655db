"""One dtype rule for every op: results follow the inputs' dtype, as in NumPy.

float32 inputs give float32 outputs and gradients, float64 inputs float64 (also when a packed
``saved=`` policy held the activations in float32), and a backward's incoming gradient (``dout``,
``dy``, ``dstate``, ``dnext``, ``dloss``) of another dtype than the output it pairs with is a
``TypeError`` naming that argument, raised before any kernel runs.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, lowrank_inputs

import lowbit
from lowbit import _dispatch

DTYPES = (np.float32, np.float64)
OTHER = {np.float32: np.float64, np.float64: np.float32}


@pytest.fixture(params=["numpy", "numba"])
def cpu(request):
    reason = _dispatch.backend_unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"backend {request.param} unavailable: {reason}")
    with lowbit.use_backend(request.param):
        yield request.param


def _f(rng, dtype, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


# Each builder runs a forward on inputs of ``dtype`` and returns ``(outputs, backward, names)``:
# the forward outputs the backward takes gradients of, a function of those gradients returning
# the input gradients, and the gradients' argument names.

def _linear(rng, dtype, saved):
    x, w = _f(rng, dtype, 4, 8), _f(rng, dtype, 8, 3)
    act = "int8" if saved is None else None  # saved= applies to the float input only
    y, ctx = lowbit.linear_forward(x, w, "ternary", act, saved=saved)
    return (y,), lambda g: lowbit.linear_backward(g[0], ctx), ("dy",)


def _linear_plain(rng, dtype, saved):
    x, w = _f(rng, dtype, 4, 8), _f(rng, dtype, 8, 3)
    y, ctx = lowbit.linear_forward(x, w, None, None, saved=saved)
    return (y,), lambda g: lowbit.linear_backward(g[0], ctx), ("dy",)


def _layer_norm(rng, dtype, saved):
    y, ctx = lowbit.layer_norm_forward(_f(rng, dtype, 3, 5), saved=saved)
    return (y,), lambda g: (lowbit.layer_norm_backward(g[0], ctx),), ("dy",)


def _rms_norm(rng, dtype, saved):
    y, ctx = lowbit.rms_norm_forward(_f(rng, dtype, 3, 5), _f(rng, dtype, 5), saved=saved)
    return (y,), lambda g: lowbit.rms_norm_backward(g[0], ctx), ("dy",)


def _rotary(rng, dtype, saved):
    y, ctx = lowbit.rotary_forward(_f(rng, dtype, 3, 2, 4), np.array([4, 0, 57]))
    return (y,), lambda g: (lowbit.rotary_backward(g[0], ctx),), ("dy",)


def _embedding(rng, dtype, saved):
    out, ctx = lowbit.embedding_forward(_f(rng, dtype, 6, 4), np.array([[0, 5, 2], [2, 2, 1]]))
    return (out,), lambda g: (lowbit.embedding_backward(g[0], ctx),), ("dout",)


def _cross_entropy(rng, dtype, saved):
    loss, ctx = lowbit.cross_entropy_forward(_f(rng, dtype, 5, 4), np.array([0, 3, 1, 1, 2]),
                                             saved=saved)
    return (loss,), lambda g: (lowbit.cross_entropy_backward(g[0], ctx),), ("dloss",)


def _attention(rng, dtype, saved):
    q, k, v = (_f(rng, dtype, 5, 2, 4) for _ in range(3))
    out, ctx = lowbit.segmented_attention_forward(q, k, v, [2, 3], causal=True, saved=saved)
    return (out,), lambda g: lowbit.segmented_attention_backward(g[0], ctx), ("dout",)


def _gated_delta(rng, dtype, saved):
    q, k, v = (_f(rng, dtype, 1, 5, 2, 3, scale=0.5) for _ in range(3))
    log_decay = -np.abs(_f(rng, dtype, 1, 5, 2, scale=0.3))
    beta = np.abs(_f(rng, dtype, 1, 5, 2, scale=0.3))
    out, state, ctx = lowbit.gated_delta_scan_forward(
        q, k, v, log_decay, beta, initial_state=_f(rng, dtype, 1, 2, 3, 3), chunk_size=2,
        saved=saved)
    return ((out, state), lambda g: lowbit.gated_delta_scan_backward(g[0], g[1], ctx),
            ("dout", "dstate"))


def _selective(rng, dtype, saved):
    x, B, C = _f(rng, dtype, 1, 5, 2, 3), _f(rng, dtype, 1, 5, 2, 2), _f(rng, dtype, 1, 5, 2, 2)
    heads = [_f(rng, dtype, 2, scale=0.5) for _ in range(3)]
    out, state, ctx = lowbit.selective_scan_forward(
        x, B, C, _f(rng, dtype, 1, 5, 2), *heads, initial_state=_f(rng, dtype, 1, 2, 3, 2),
        chunk_size=2, saved=saved)
    return ((out, state), lambda g: lowbit.selective_scan_backward(g[0], g[1], ctx),
            ("dout", "dstate"))


def _lowrank(rng, dtype, saved):
    out, ctx = lowbit.lowrank_residual_forward(*lowrank_inputs(rng, 1, 5, 4, 2, 6, dtype),
                                               saved=saved)
    return (out,), lambda g: lowbit.lowrank_residual_backward(g[0], ctx), ("dnext",)


OPS = {"linear": _linear, "linear_unquantized": _linear_plain, "layer_norm": _layer_norm,
       "embedding": _embedding, "cross_entropy": _cross_entropy, "segmented_attention": _attention,
       "gated_delta_scan": _gated_delta, "selective_scan": _selective,
       "lowrank_residual": _lowrank, "rotary": _rotary, "rms_norm": _rms_norm}
#: Ops with a ``saved=`` policy (the packed policy unpacks float32: the gradients must not).
SAVED = [name for name in OPS if name not in ("embedding", "rotary")]


def _grads_of(outputs):
    return [np.ones_like(o) for o in outputs]


def _check_dtypes(outputs, grads, dtype):
    for i, out in enumerate(outputs):
        assert out.dtype == dtype, f"output {i}: {out.dtype}, expected {np.dtype(dtype)}"
    got = [g for g in grads if g is not None]
    assert got, "the backward returned no gradient"
    for i, g in enumerate(got):
        assert g.dtype == dtype, f"gradient {i}: {g.dtype}, expected {np.dtype(dtype)}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_outputs_and_gradients_follow_the_inputs(cpu, rng, op, dtype):
    outputs, backward, _ = OPS[op](rng, dtype, None)
    _check_dtypes(outputs, backward(_grads_of(outputs)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", SAVED)
def test_a_packed_policy_keeps_the_dtype(rng, op, dtype):
    with lowbit.use_backend("numpy"):
        outputs, backward, _ = OPS[op](rng, dtype, "int8")
        _check_dtypes(outputs, backward(_grads_of(outputs)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_a_gradient_of_another_dtype_is_a_type_error_naming_it(never_runs, rng, op, dtype):
    with never_runs.paused():
        outputs, backward, names = OPS[op](rng, dtype, None)
    for i, name in enumerate(names):
        grads = _grads_of(outputs)
        grads[i] = grads[i].astype(OTHER[dtype])
        with pytest.raises(TypeError, match=rf"^{name} must have"):
            backward(grads)  # armed: no kernel may run before the check


@pytest.mark.parametrize("dtype", DTYPES)
def test_inference_forms_follow_the_inputs(cpu, rng, dtype):
    x, w = _f(rng, dtype, 3, 8), _f(rng, dtype, 8, 5)
    pw = lowbit.quantize_weight(w, "ternary")
    for act in ("int8", None):
        assert lowbit.packed_matmul(x, pw, act).dtype == dtype
    assert lowbit.fake_quantize_weight(w, "int8").dtype == dtype
    assert lowbit.fake_quantize_activation(x, "int4").dtype == dtype
    assert lowbit.lowrank_residual(*lowrank_inputs(rng, 1, 4, 4, 2, 6, dtype)).dtype == dtype
    q = _f(rng, dtype, 4, 2, 3)
    assert lowbit.segmented_attention(q, q, q, [4]).dtype == dtype
    assert lowbit.rotary(q[..., :2], np.arange(4)).dtype == dtype
    heads = lowbit.expand_heads(q, 1, 4)
    assert heads.dtype == dtype
    assert lowbit.expand_heads_backward(np.ones_like(heads), 1, 2).dtype == dtype


def test_mixed_linear_follows_numpy_promotion(cpu, rng):
    """y has ``result_type(x, w)``; each gradient the dtype of its input."""
    x, w = _f(rng, np.float32, 4, 8), _f(rng, np.float64, 8, 3)
    for formats in (("ternary", "int8"), (None, None)):
        y, ctx = lowbit.linear_forward(x, w, *formats)
        assert y.dtype == np.float64
        dx, dw = lowbit.linear_backward(np.ones_like(y), ctx)
        assert (dx.dtype, dw.dtype) == (np.float32, np.float64)
        with pytest.raises(TypeError, match="dy must have"):
            lowbit.linear_backward(np.ones(y.shape, np.float32), ctx)


def test_unquantized_float64_linear_is_computed_in_float64(cpu, rng):
    x, w, dy = _f(rng, np.float64, 4, 8), _f(rng, np.float64, 8, 3), _f(rng, np.float64, 4, 3)
    y, ctx = lowbit.linear_forward(x, w, None, None)
    dx, dw = lowbit.linear_backward(dy, ctx)
    # float32 products would be off by ~1e-7: these agree to float64 rounding.
    assert_close("y", x @ w, y, 1e-12)
    assert_close("dx", dy @ w.T, dx, 1e-12)
    assert_close("dw", x.T @ dy, dw, 1e-12)


def test_float64_lowrank_accumulates_into_float64_buffers(rng):
    inputs = lowrank_inputs(rng, 1, 5, 4, 2, 6, np.float64)
    with lowbit.use_backend("numpy"):
        out, ctx = lowbit.lowrank_residual_forward(*inputs)
        dnext = _f(rng, np.float64, *out.shape)
        fresh = lowbit.lowrank_residual_backward(dnext, ctx)
        start = [np.full(w.shape, 0.5) for w in inputs[1:]]
        buffers = tuple(s.copy() for s in start)
        summed = lowbit.lowrank_residual_backward(dnext, ctx, accumulate=buffers)
        with pytest.raises(ValueError, match="accumulate dencoder must be float64"):
            lowbit.lowrank_residual_backward(
                dnext, ctx, accumulate=tuple(b.astype(np.float32) for b in buffers))
    assert [g.dtype for g in summed] == [np.float64] * 4
    for name, s, f, got, buf in zip(("dencoder", "dencoder_v", "ddecoder"), start, fresh[1:],
                                    summed[1:], buffers):
        assert got is buf, f"{name}: the accumulate buffer is returned"
        assert_close(name, s + f, got, 1e-12)
