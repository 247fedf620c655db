"""Tests of ``lowbit.segmented_attention`` (forward, logsumexp, backward) on every backend.

Op: ``lowbit/ops/segmented_attention/``; kernels ``cuda/segmented_attention.cu``; reference
``reference/segmented_attention.py`` (itself checked against central finite differences here).
Shapes under cudasim stay small (each CUDA thread is an OS thread).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import assert_close, assert_equal, numerical_grad, to_numpy

import lowbit
from lowbit.reference.segmented_attention import (segmented_attention_bwd_ref,
                                                  segmented_attention_ref)

RTOL = {np.float32: 1e-4, np.float64: 1e-10}

# (lengths, H, Hkv, D, Dv): small enough for cudasim.
SMALL = [
    pytest.param([1, 1, 1], 2, 2, 4, 4, id="singletons"),
    pytest.param([37], 1, 1, 3, 5, id="one-segment-Dv!=D"),
    pytest.param([3, 1, 9, 2, 1, 5, 4], 4, 2, 8, 8, id="many-short"),
    pytest.param([5, 6], 8, 2, 1, 1, id="grouped-8-2-dim1"),
    pytest.param([20, 3], 1, 1, 64, 64, id="dim64"),
    pytest.param([9, 8], 1, 1, 128, 96, id="dim128"),
    # The CUDA kernels' tiles in float32: 64 rows per block, 32 keys (or queries) per tile. Three
    # query blocks and five key tiles in the first segment, a second one starting mid-tile; D and
    # Dv not multiples of the 8-element feature step nor of the 32-element chunk.
    pytest.param([150, 45], 2, 1, 37, 19, id="multi-block-odd"),
    # The widest register tiles (D, Dv up to 128) over two query blocks and three key tiles.
    pytest.param([70], 1, 1, 100, 128, id="multi-block-dim128"),
]
# Too slow for the emulator: run on numpy, numba (and a real GPU).
LARGE = [
    pytest.param([113, 203], 8, 2, 16, 24, id="113-203-grouped"),
    pytest.param([1023, 1024], 1, 1, 64, 64, id="1023-1024"),
]


def _inputs(rng, lengths, heads, kv_heads, dim, dim_v, dtype):
    tokens = sum(lengths)
    q = rng.standard_normal((tokens, heads, dim)).astype(dtype)
    k = rng.standard_normal((tokens, kv_heads, dim)).astype(dtype)
    v = rng.standard_normal((tokens, kv_heads, dim_v)).astype(dtype)
    dout = rng.standard_normal((tokens, heads, dim_v)).astype(dtype)
    return q, k, v, dout


def _check_against_reference(backend, rng, lengths, heads, kv_heads, dim, dim_v, causal, dtype,
                             scale=None):
    q, k, v, dout = _inputs(rng, lengths, heads, kv_heads, dim, dim_v, dtype)
    out, ctx = lowbit.segmented_attention_forward(backend.to(q), backend.to(k), backend.to(v),
                                                  lengths, scale=scale, causal=causal)
    dq, dk, dv = lowbit.segmented_attention_backward(backend.to(dout), ctx)
    ref_out, ref_lse = segmented_attention_ref(q, k, v, lengths, scale, causal)
    ref_grads = segmented_attention_bwd_ref(dout, q, k, v, lengths, scale, causal)
    rtol = RTOL[dtype]
    # Inputs are O(1): an absolute floor of rtol covers gradients that vanish exactly (a segment
    # of one token has dq = dk = 0 in the reference and rounding-sized values elsewhere).
    atol = rtol
    for name, x in (("out", out), ("lse", ctx.lse.unpack()), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert x.dtype == dtype, f"{name}: dtype {x.dtype}, expected {np.dtype(dtype)}"
    assert_close("out", ref_out, out, rtol, atol)
    assert_close("lse", ref_lse, ctx.lse.unpack(), rtol, atol)
    for name, ref, got in zip(("dq", "dk", "dv"), ref_grads, (dq, dk, dv)):
        assert_close(name, ref, got, rtol, atol)
    inference = lowbit.segmented_attention(backend.to(q), backend.to(k), backend.to(v), lengths,
                                           scale=scale, causal=causal)
    assert_equal("inference out", out, inference)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths, heads, kv_heads, dim, dim_v", SMALL)
def test_matches_reference(backend, rng, lengths, heads, kv_heads, dim, dim_v, causal):
    _check_against_reference(backend, rng, lengths, heads, kv_heads, dim, dim_v, causal,
                             np.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference_float64_and_scale(backend, rng, causal):
    _check_against_reference(backend, rng, [7, 1, 12], 4, 2, 5, 3, causal, np.float64,
                             scale=0.37)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference_float64_multi_block(backend, rng, causal):
    # float64 tiles of the CUDA kernels: 32 rows per block, 16 keys per tile; odd D and Dv, a
    # head group of three.
    _check_against_reference(backend, rng, [70, 33], 3, 1, 9, 5, causal, np.float64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths, heads, kv_heads, dim, dim_v", LARGE)
def test_matches_reference_large(backend, rng, lengths, heads, kv_heads, dim, dim_v, causal):
    if backend.name == "cudasim":
        pytest.skip("thousands of tokens are too slow for the emulator; small shapes cover it")
    _check_against_reference(backend, rng, lengths, heads, kv_heads, dim, dim_v, causal,
                             np.float32)


# One past each block edge of the numba kernels (forward query blocks of 256 rows and key chunks
# of 512, backward blocks of 256 keys by 256 queries, 64-lane panels), under one block, and a
# one-token segment.
BLOCK_EDGES = [1, 129, 257, 513, 130]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference_at_block_edges(backend, rng, causal):
    if backend.name == "cudasim":
        pytest.skip("thousands of tokens are too slow for the emulator; small shapes cover it")
    _check_against_reference(backend, rng, BLOCK_EDGES, 2, 1, 64, 32, causal, np.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_numba_blas_path_matches_reference(backend, rng, monkeypatch, causal):
    # float32 runs the FMA tiles where the CPU has them: force the BLAS kernels that run
    # without them, so that both float32 paths are checked on every machine (block edges, a
    # head group, and D, Dv neither a multiple of 64 nor equal).
    if backend.name != "numba":
        pytest.skip("the numba backend's kernel choice")
    from lowbit.ops.segmented_attention import _numba

    monkeypatch.setattr(_numba, "USE_FMA", False)
    _check_against_reference(backend, rng, BLOCK_EDGES, 4, 2, 72, 40, causal, np.float32)


def test_causal_hides_large_later_scores(backend, rng):
    # The last key of each segment scores ~10^3 against every query: causal masking must keep
    # its overflowing exp out of the earlier rows, in the forward and in the recomputing backward.
    lengths = [6, 9]
    q, k, v, dout = _inputs(rng, lengths, 2, 1, 16, 8, np.float32)
    q = np.abs(q)
    for end in np.cumsum(lengths) - 1:
        k[end] = 30.0
    out, ctx = lowbit.segmented_attention_forward(backend.to(q), backend.to(k), backend.to(v),
                                                  lengths, causal=True)
    grads = lowbit.segmented_attention_backward(backend.to(dout), ctx)
    assert_close("out", segmented_attention_ref(q, k, v, lengths, causal=True)[0], out, 1e-4,
                 1e-4)
    for name, ref, got in zip(("dq", "dk", "dv"), segmented_attention_bwd_ref(
            dout, q, k, v, lengths, causal=True), grads):
        assert_close(name, ref, got, 1e-4, 1e-4)


def test_singleton_segments_return_v_exactly(backend, rng):
    q, k, v, _ = _inputs(rng, [1] * 5, 4, 2, 3, 6, np.float32)
    out = lowbit.segmented_attention(backend.to(q), backend.to(k), backend.to(v), [1] * 5)
    assert_equal("out", np.repeat(v, 2, axis=1), out)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic(backend, rng, causal):
    lengths = [9, 1, 14]
    q, k, v, dout = (backend.to(x) for x in _inputs(rng, lengths, 2, 1, 16, 8, np.float32))
    runs = []
    for _ in range(2):
        out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths, causal=causal)
        runs.append((out, ctx.lse.unpack()) + lowbit.segmented_attention_backward(dout, ctx))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert_equal(name, a, b)


def test_inputs_not_modified(backend, rng):
    lengths = [4, 7]
    host = _inputs(rng, lengths, 2, 1, 4, 4, np.float32)
    arrays = [backend.to(x.copy()) for x in host]
    out, ctx = lowbit.segmented_attention_forward(*arrays[:3], lengths, causal=True)
    lowbit.segmented_attention_backward(arrays[3], ctx)
    for name, before, after in zip(("q", "k", "v", "dout"), host, arrays):
        assert_equal(name, before, after)


def test_strided_inputs(backend, rng):
    lengths = [5, 2]
    q, k, v, dout = _inputs(rng, lengths, 4, 2, 4, 3, np.float32)
    # Head-major storage viewed token-major: valid inputs that are not C-contiguous.
    views = [np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2) for x in (q, k, v)]
    assert not any(x.flags.c_contiguous for x in views)
    out, ctx = lowbit.segmented_attention_forward(*(backend.to(x) for x in views), lengths)
    grads = lowbit.segmented_attention_backward(backend.to(dout), ctx)
    assert_close("out", segmented_attention_ref(q, k, v, lengths)[0], out, 1e-5, 1e-5)
    for name, ref, got in zip(("dq", "dk", "dv"),
                              segmented_attention_bwd_ref(dout, q, k, v, lengths), grads):
        assert_close(name, ref, got, 1e-5, 1e-5)


def test_reference_backward_matches_finite_differences(rng):
    lengths = [3, 1, 4]
    for causal in (False, True):
        q, k, v, dout = _inputs(rng, lengths, 2, 1, 3, 2, np.float64)

        def loss():
            return float(np.sum(segmented_attention_ref(q, k, v, lengths, 0.8, causal)[0] * dout))

        grads = segmented_attention_bwd_ref(dout, q, k, v, lengths, 0.8, causal)
        for name, x, grad in zip(("dq", "dk", "dv"), (q, k, v), grads):
            assert_close(name, numerical_grad(loss, x), grad, 1e-7)


def test_reference_logsumexp_is_log_of_normalizer(rng):
    q, k, v, _ = _inputs(rng, [6], 1, 1, 3, 2, np.float64)
    _, lse = segmented_attention_ref(q, k, v, [6], 1.0)
    scores = q[:, 0] @ k[:, 0].T
    assert_close("lse", np.log(np.exp(scores).sum(axis=1)), lse[0], 1e-12)


def test_ctx_holds_no_square_matrix(rng):
    lengths = [40, 24]
    q, k, v, _ = _inputs(rng, lengths, 4, 2, 8, 6, np.float32)
    out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths)
    report = lowbit.memory_report(ctx)
    names = [row.name.rsplit(".", 1)[-1] for row in report.rows]
    assert names == ["q", "k", "v", "out", "lse"]
    assert ctx.lse.shape == (4, 64)
    assert ctx.nbytes == sum(x.nbytes for x in (q, k, v, out)) + 4 * 64 * 4
    assert ctx.nbytes == ctx.dense_nbytes


def _peak_rss_delta(fn):
    """Peak resident memory added while ``fn`` runs (Linux: VmHWM after a clear_refs reset)."""
    def field(name):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(name)

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS
    before = field("VmRSS")
    fn()
    return field("VmHWM") - before


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="peak RSS reset needs Linux /proc/self/clear_refs")
def test_long_segment_memory_stays_linear_numba(rng):
    if "numba" not in lowbit.available_backends():
        pytest.skip("numba is not installed")
    length, heads, dim = 16384, 2, 16
    q, k, v, dout = _inputs(rng, [length], heads, 1, dim, dim, np.float32)
    result = {}

    def run():
        with lowbit.use_backend("numba"):
            out, ctx = lowbit.segmented_attention_forward(q, k, v, [length], causal=True)
            result["out"], result["lse"] = out, ctx.lse.unpack()
            result["grads"] = lowbit.segmented_attention_backward(dout, ctx)

    with lowbit.use_backend("numba"):  # compile (or load the cache) outside the measurement
        small = _inputs(rng, [8], heads, 1, dim, dim, np.float32)
        lowbit.segmented_attention_backward(
            small[3], lowbit.segmented_attention_forward(*small[:3], [8], causal=True)[1])
    peak = _peak_rss_delta(run)
    assert peak < length**2 * 4 // 16, f"peak memory grew by {peak:,} bytes"
    # Spot-check rows across the segment against a direct float64 computation.
    rows = np.array([0, 1, 4097, length - 1])
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for h in range(heads):
        for i in rows:
            s = (k64[:i + 1, 0] @ q64[i, h]) / np.sqrt(dim)
            lse = np.log(np.exp(s - s.max()).sum()) + s.max()
            assert_close(f"lse[{h}, {i}]", np.array([lse]), result["lse"][h, i:i + 1], 1e-5)
            assert_close(f"out[{i}, {h}]", np.exp(s - lse) @ v64[:i + 1, 0], result["out"][i, h],
                         1e-4)
    assert all(np.isfinite(g).all() for g in result["grads"])


# ---- validation: one test per rule; the message names the argument ----

def _valid(rng):
    q, k, v, _ = _inputs(rng, [3, 2], 4, 2, 3, 5, np.float32)
    return q, k, v, [3, 2]


def _bad(rng, **changes):
    q, k, v, lengths = _valid(rng)
    args = dict(q=q, k=k, v=v, lengths=lengths)
    args.update(changes)
    return args


@pytest.mark.parametrize("change, error, word", [
    (lambda q, k, v: dict(q=q.tolist()), TypeError, "q"),
    (lambda q, k, v: dict(k=q[:, :, 0]), ValueError, "k"),
    (lambda q, k, v: dict(v=v[:, :0]), ValueError, "v"),
    (lambda q, k, v: dict(q=q.astype(np.int32)), TypeError, "q"),
    (lambda q, k, v: dict(v=v.astype(np.float64)), TypeError, "v"),
    (lambda q, k, v: dict(k=k[:4], v=v[:4]), ValueError, "token count"),
    (lambda q, k, v: dict(v=np.concatenate([v, v], axis=1)), ValueError, "head counts"),
    (lambda q, k, v: dict(k=k[:, :1].repeat(3, 1), v=v[:, :1].repeat(3, 1)), ValueError,
     "divide"),
    (lambda q, k, v: dict(k=k[:, :, :2]), ValueError, "key dimension"),
], ids=["q-not-array", "k-rank", "v-zero-dim", "q-int-dtype", "dtypes-differ",
        "token-counts", "kv-heads-differ", "kv-heads-divide", "key-dims"])
def test_bad_tensors(rng, never_runs, change, error, word):
    q, k, v, lengths = _valid(rng)
    args = dict(q=q, k=k, v=v)
    args.update(change(q, k, v))
    with pytest.raises(error, match=word):
        lowbit.segmented_attention_forward(args["q"], args["k"], args["v"], lengths)


@pytest.mark.parametrize("lengths, error, match", [
    ([], ValueError, "lengths must be non-empty"),
    ([3, 0, 2], ValueError, r"lengths must all be positive.*lengths\[1\]"),
    ([3, -1, 3], ValueError, "lengths must all be positive"),
    ([3, 3], ValueError, "lengths must sum to the token count 5"),
    ([2, 2], ValueError, "lengths must sum to the token count 5, got 4"),
    (np.array([2**31 - 1, 2**31 - 1, 7], dtype=np.int32), ValueError, "lengths must sum"),
    (np.array([[3, 2]]), ValueError, "lengths must be 1-D"),
    ([3.0, 2.0], TypeError, "lengths must hold integers"),
    ([3, True], TypeError, "lengths must hold integers"),
    (np.array([True, True]), TypeError, "lengths must hold integers"),
    ("32", TypeError, "lengths"),
], ids=["empty", "zero", "negative", "sum-over", "sum-under", "int32-wrap", "2d", "floats",
        "bool", "bool-array", "string"])
def test_bad_lengths(rng, never_runs, lengths, error, match):
    q, k, v, _ = _valid(rng)
    with pytest.raises(error, match=match):
        lowbit.segmented_attention_forward(q, k, v, lengths)


def test_lengths_wrapping_in_int32_are_rejected(rng, never_runs):
    # Summed in int32 these wrap to exactly 5 = T; the Python-int running total does not.
    lengths = np.array([2**31 - 1, 2**31 - 1, 7], dtype=np.int32)
    assert int(lengths.sum(dtype=np.int32)) == 5
    q, k, v, _ = _valid(rng)
    with pytest.raises(ValueError, match="lengths"):
        lowbit.segmented_attention(q, k, v, lengths)


@pytest.mark.parametrize("scale, error", [
    (float("nan"), ValueError), (float("inf"), ValueError), (0.0, ValueError),
    (-1.0, ValueError), ("1", TypeError)], ids=["nan", "inf", "zero", "negative", "string"])
def test_bad_scale(rng, never_runs, scale, error):
    q, k, v, lengths = _valid(rng)
    with pytest.raises(error, match="scale"):
        lowbit.segmented_attention_forward(q, k, v, lengths, scale=scale)


def test_bad_causal(rng, never_runs):
    q, k, v, lengths = _valid(rng)
    with pytest.raises(TypeError, match="causal"):
        lowbit.segmented_attention_forward(q, k, v, lengths, causal="yes")


def test_bad_backward_arguments(rng):
    q, k, v, lengths = _valid(rng)
    with lowbit.use_backend("numpy"):
        out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths)
    with pytest.raises(TypeError, match="ctx"):
        lowbit.segmented_attention_backward(out, object())
    with pytest.raises(ValueError, match="dout"):
        lowbit.segmented_attention_backward(out[:, :1], ctx)
    with pytest.raises(TypeError, match="dout"):
        lowbit.segmented_attention_backward(out.astype(np.float64), ctx)
    with pytest.raises(TypeError, match="dout"):
        lowbit.segmented_attention_backward(to_numpy(out).tolist(), ctx)
