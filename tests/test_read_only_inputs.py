"""Read-only inputs on the numba backend: the kernels get read-only views of every input
(``lowbit._backend.read_only``), so an input a user froze (a read-only memory map, say) runs the
specializations already compiled for writable ones, with the same bits, and compiles nothing
new. One op of each kernel family: the scans, the segmented attention, the BDH layer's causal
linear attention, layer norm, RMS norm, embedding, the quantizers, bit packing, the sparse saver
and the straight-through linear. References: the ops' own tests compare these paths with
``reference/``."""

from __future__ import annotations

import numpy as np
import pytest

import lowbit

pytestmark = pytest.mark.skipif("numba" not in lowbit.available_backends(),
                                reason="numba backend unavailable")


def _frozen(arrays):
    out = []
    for a in arrays:
        a = a.copy()
        a.flags.writeable = False
        out.append(a)
    return out


def _compiled(*modules):
    """Signatures compiled so far by every Numba dispatcher of ``modules``."""
    return {(m.__name__, name): len(f.signatures) for m in modules
            for name, f in vars(m).items() if hasattr(f, "signatures")}


def _gated_delta(rng):
    from lowbit.ops.gated_delta_scan import _numba, _numba_chunked

    B, T, H, K, V = 1, 130, 2, 64, 64
    k = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    inputs = [rng.standard_normal((B, T, H, K)).astype(np.float32) / 8, k,
              rng.standard_normal((B, T, H, V)).astype(np.float32),
              -0.1 * rng.random((B, T, H)).astype(np.float32),
              rng.random((B, T, H)).astype(np.float32)]
    dout = rng.standard_normal((B, T, H, V)).astype(np.float32)

    def run(args, g):
        out, _, ctx = lowbit.gated_delta_scan_forward(*args)
        return (out, *lowbit.gated_delta_scan_backward(g, None, ctx))

    return inputs, dout, run, (_numba, _numba_chunked)


def _selective(rng):
    from lowbit.ops.selective_scan import _numba

    B, T, H, P, N = 1, 70, 2, 8, 4
    inputs = [rng.standard_normal((B, T, H, P)).astype(np.float32),
              rng.standard_normal((B, T, H, N)).astype(np.float32),
              rng.standard_normal((B, T, H, N)).astype(np.float32),
              rng.standard_normal((B, T, H)).astype(np.float32),
              rng.standard_normal(H).astype(np.float32),
              rng.standard_normal(H).astype(np.float32),
              rng.standard_normal(H).astype(np.float32)]
    dout = rng.standard_normal((B, T, H, P)).astype(np.float32)

    def run(args, g):
        out, _, ctx = lowbit.selective_scan_forward(*args)
        return (out, *lowbit.selective_scan_backward(g, None, ctx))

    return inputs, dout, run, (_numba,)


def _attention(rng):
    from lowbit.ops.segmented_attention import _numba

    T, H, D = 150, 2, 16
    inputs = [rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(3)]
    dout = rng.standard_normal((T, H, D)).astype(np.float32)

    def run(args, g):
        out, ctx = lowbit.segmented_attention_forward(*args, [100, 50], causal=True)
        return (out, *lowbit.segmented_attention_backward(g, ctx))

    return inputs, dout, run, (_numba,)


def _lowrank(rng):
    from lowbit.ops.lowrank_residual import _numba

    B, T, D, H, N = 1, 16, 8, 2, 32
    inputs = [rng.standard_normal((B, T, D)).astype(np.float32),
              rng.standard_normal((H, D, N)).astype(np.float32) / 3,
              rng.standard_normal((H, D, N)).astype(np.float32) / 3,
              rng.standard_normal((H * N, D)).astype(np.float32) / 8]
    dout = rng.standard_normal((B, T, D)).astype(np.float32)

    def run(args, g):
        out, ctx = lowbit.lowrank_residual_forward(*args, relu_threshold=0.1)
        return (out, *lowbit.lowrank_residual_backward(g, ctx))

    return inputs, dout, run, (_numba,)


def _forward_backward(forward, backward):
    """``run`` of an op whose forward returns (out, ctx) and whose backward one gradient."""
    def run(args, g):
        out, ctx = forward(*args)
        return out, backward(g, ctx)
    return run


def _layer_norm(rng):
    from lowbit.ops.layer_norm import _numba

    inputs = [rng.standard_normal((6, 40)).astype(np.float32)]
    dout = rng.standard_normal((6, 40)).astype(np.float32)
    return (inputs, dout, _forward_backward(lowbit.layer_norm_forward, lowbit.layer_norm_backward),
            (_numba,))


def _rms_norm(rng):
    from lowbit.ops.rms_norm import _numba

    inputs = [rng.standard_normal((6, 40)).astype(np.float32),
              rng.standard_normal(40).astype(np.float32)]
    dout = rng.standard_normal((6, 40)).astype(np.float32)

    def run(args, g):
        out, ctx = lowbit.rms_norm_forward(*args)
        return (out, *lowbit.rms_norm_backward(g, ctx))

    return inputs, dout, run, (_numba,)


def _embedding(rng):
    from lowbit.ops.embedding import _numba

    inputs = [rng.standard_normal((11, 8)).astype(np.float32),
              rng.integers(0, 11, 30).astype(np.int64)]
    dout = rng.standard_normal((30, 8)).astype(np.float32)
    return (inputs, dout, _forward_backward(lowbit.embedding_forward, lowbit.embedding_backward),
            (_numba,))


def _rotary(rng):
    from lowbit.ops.rotary import _numba

    inputs = [rng.standard_normal((6, 3, 8)).astype(np.float32)]
    dout = rng.standard_normal((6, 3, 8)).astype(np.float32)

    def run(args, g):
        out, ctx = lowbit.rotary_forward(args[0], np.array([0, 3, 1, 9, 57, 2]))
        return out, lowbit.rotary_backward(g, ctx)

    return inputs, dout, run, (_numba,)


def _codes(rng):
    """Weight and activation quantizers, bit packing and the sparse saver (no backward)."""
    from lowbit.ops.pack_bits import _numba as pack
    from lowbit.ops.quantize import _numba as quantize
    from lowbit.ops.saved_activation import _numba as saved
    from lowbit.ops.saved_activation._numba import _sparse

    inputs = [rng.standard_normal((40, 24)).astype(np.float32),
              rng.integers(0, 4, (5, 37)).astype(np.uint8),
              np.maximum(rng.standard_normal(3000), 0).astype(np.float32)]

    def run(args, g):
        w, codes, nonneg = args
        got = []
        for fmt in ("ternary", "sign", "int8"):
            pw = lowbit.quantize_weight(w, fmt)
            got += [pw.data, pw.scale]
        qa = lowbit.quantize_activation(w)
        packed = lowbit.pack_bits(codes, 2)
        sparse = lowbit.pack_activation(nonneg, "sparse", kind="nonneg")
        return (*got, qa.codes, qa.scale, packed, lowbit.unpack_bits(packed, 2, codes.shape[-1]),
                sparse.mask, sparse.codes, sparse.scales)

    return inputs, None, run, (quantize, pack, saved, _sparse)


@pytest.mark.parametrize("act_format", ["int8", None])
def test_read_only_linear_compiles_nothing_new(rng, act_format):
    """The straight-through linear (float activations kept as given: the dw tiles read them)."""
    from lowbit.ops.packed_matmul import _numba
    from lowbit.ops.packed_matmul._numba import _backward, _fma, _vnni

    x = rng.standard_normal((16, 48)).astype(np.float32)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    dy = rng.standard_normal((16, 64)).astype(np.float32)

    def run(x, dy):
        out, ctx = lowbit.linear_forward(x, w, "ternary", act_format)
        return (out, *lowbit.linear_backward(dy, ctx))

    with lowbit.use_backend("numba"):
        writable = run(x, dy)
        before = _compiled(_numba, _backward, _fma, _vnni)
        frozen = run(*_frozen([x, dy]))
        after = _compiled(_numba, _backward, _fma, _vnni)
    assert after == before
    for a, b in zip(writable, frozen):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", [_gated_delta, _selective, _attention, _lowrank, _layer_norm,
                                  _embedding, _codes, _rotary, _rms_norm])
def test_read_only_inputs_compile_nothing_new_and_give_the_same_bits(rng, case):
    inputs, dout, run, modules = case(rng)
    with lowbit.use_backend("numba"):
        writable = run(inputs, dout)
        before = _compiled(*modules)
        frozen = run(_frozen(inputs), None if dout is None else _frozen([dout])[0])
        after = _compiled(*modules)
    assert after == before
    for a, b in zip(writable, frozen):
        np.testing.assert_array_equal(a, b)
