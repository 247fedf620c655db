"""Tests of ``lowbit.segmented_attention`` with key segments of their own (``k_lengths``): decoding
against a KV cache, chunked prefill, more queries than keys, empty segments; every backend,
forward, logsumexp, inference form and backward against the float64 reference.

Op: ``lowbit/ops/segmented_attention/`` (numba's short-query path: ``_numba_decode.py``);
kernels ``cuda/segmented_attention.cu``; reference ``reference/segmented_attention.py`` (checked
against central finite differences here). The tests without ``k_lengths``:
``tests/test_segmented_attention.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_equal, numerical_grad, to_numpy

import lowbit
from lowbit.reference.segmented_attention import (segmented_attention_bwd_ref,
                                                  segmented_attention_ref)

RTOL = {np.float32: 1e-4, np.float64: 1e-10}

# (lengths, k_lengths, H, Hkv, D, Dv): small enough for cudasim.
CASES = [
    pytest.param([5, 9], [5, 9], 2, 1, 8, 8, id="equal"),
    pytest.param([1, 1, 1], [7, 1, 40], 4, 2, 8, 6, id="decode-grouped"),
    # 300 keys: five splits of 64 keys of the numba decode path (33 keys: two of 32, in the same
    # call), ten key tiles of the CUDA kernels.
    pytest.param([1, 2], [300, 33], 4, 1, 16, 16, id="decode-group4-splits"),
    pytest.param([3, 5], [10, 6], 4, 2, 8, 6, id="chunked"),
    # numba's float32 score tiles (D a multiple of 16): groups of 4 query heads (a tile of four
    # rows) and of 2 (single rows), several queries in a segment, odd key counts.
    pytest.param([1, 3, 1], [45, 19, 6], 8, 2, 32, 80, id="decode-tiles"),
    pytest.param([2, 1], [37, 3], 6, 3, 16, 16, id="decode-tiles-group2"),
    pytest.param([6, 4], [2, 4], 2, 2, 5, 3, id="more-queries-than-keys"),
    pytest.param([0, 3, 2, 1], [4, 0, 5, 1], 2, 1, 8, 4, id="empty-segments"),
    # The CUDA kernels' float32 tiles (64-row blocks, 32-key tiles) with odd D and Dv: two query
    # blocks against four key blocks, then a segment with more queries than keys.
    pytest.param([70, 5], [100, 37], 2, 1, 37, 19, id="chunked-multi-block"),
    pytest.param([100], [40], 1, 1, 32, 32, id="more-queries-multi-block"),
]
CASES_FLOAT64 = [
    pytest.param([1, 1, 1], [7, 1, 40], 4, 2, 8, 6, id="decode-grouped"),
    pytest.param([3, 5], [10, 6], 3, 1, 9, 5, id="chunked"),
    pytest.param([0, 3, 2, 1], [4, 0, 5, 1], 2, 1, 8, 4, id="empty-segments"),
    # float64 tiles: 32-row blocks, 16-key tiles.
    pytest.param([40, 1], [70, 20], 2, 2, 9, 5, id="multi-block"),
]


def _inputs(rng, lengths, k_lengths, heads, kv_heads, dim, dim_v, dtype):
    tq, tk = sum(lengths), sum(k_lengths)
    q = rng.standard_normal((tq, heads, dim)).astype(dtype)
    k = rng.standard_normal((tk, kv_heads, dim)).astype(dtype)
    v = rng.standard_normal((tk, kv_heads, dim_v)).astype(dtype)
    dout = rng.standard_normal((tq, heads, dim_v)).astype(dtype)
    return q, k, v, dout


def _check(backend, rng, lengths, k_lengths, heads, kv_heads, dim, dim_v, causal, dtype):
    q, k, v, dout = _inputs(rng, lengths, k_lengths, heads, kv_heads, dim, dim_v, dtype)
    dq_, dk_, dv_ = (backend.to(x) for x in (q, k, v))
    out, ctx = lowbit.segmented_attention_forward(dq_, dk_, dv_, lengths, k_lengths=k_lengths,
                                                  causal=causal)
    grads = lowbit.segmented_attention_backward(backend.to(dout), ctx)
    ref_out, ref_lse = segmented_attention_ref(q, k, v, lengths, None, causal, k_lengths)
    ref_grads = segmented_attention_bwd_ref(dout, q, k, v, lengths, None, causal, k_lengths)
    rtol = RTOL[dtype]
    for name, x in (("out", out), ("lse", ctx.lse.unpack())) + tuple(zip(("dq", "dk", "dv"),
                                                                           grads)):
        assert x.dtype == dtype, f"{name}: dtype {x.dtype}, expected {np.dtype(dtype)}"
    assert_close("out", ref_out, out, rtol, rtol)
    lse = to_numpy(ctx.lse.unpack())
    # Rows that see no key: lse exactly -inf (and out exactly 0, checked by assert_close).
    hidden = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), hidden), "lse: -inf rows differ from the reference"
    assert_close("lse", np.where(hidden, 0, ref_lse), np.where(hidden, 0, lse), rtol, rtol)
    for name, ref, got in zip(("dq", "dk", "dv"), ref_grads, grads):
        assert_close(name, ref, got, rtol, rtol)
    inference = lowbit.segmented_attention(dq_, dk_, dv_, lengths, k_lengths=k_lengths,
                                           causal=causal)
    assert_equal("inference out", out, inference)
    return out, ctx, grads


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths, k_lengths, heads, kv_heads, dim, dim_v", CASES)
def test_matches_reference(backend, rng, lengths, k_lengths, heads, kv_heads, dim, dim_v,
                           causal):
    _check(backend, rng, lengths, k_lengths, heads, kv_heads, dim, dim_v, causal, np.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths, k_lengths, heads, kv_heads, dim, dim_v", CASES_FLOAT64)
def test_matches_reference_float64(backend, rng, lengths, k_lengths, heads, kv_heads, dim,
                                   dim_v, causal):
    _check(backend, rng, lengths, k_lengths, heads, kv_heads, dim, dim_v, causal, np.float64)


@pytest.mark.parametrize("fma", [False, True], ids=["blas", "fma"])
def test_numba_blocked_kernels_match_reference(backend, rng, monkeypatch, fma):
    # Short query segments run numba's decode path; force the blocked kernels on them (through
    # BLAS, and the FMA tiles, 512- or 256-bit by the CPU), with block edges: 257
    # queries against 300 keys (two causal query blocks, key chunks and backward key blocks).
    if backend.name != "numba":
        pytest.skip("the numba backend's kernel choice")
    from lowbit.ops.segmented_attention import _numba, _numba_decode

    monkeypatch.setattr(_numba_decode, "SHORT_ROWS", 0)
    monkeypatch.setattr(_numba, "USE_FMA", fma)
    for causal in (False, True):
        _check(backend, rng, [1, 257, 9, 0], [7, 300, 3, 2], 2, 1, 24, 16, causal, np.float32)


def test_equal_k_lengths_is_the_old_path_bitwise(backend, rng):
    lengths = [5, 1, 12]
    q, k, v, dout = (backend.to(x) for x in _inputs(rng, lengths, lengths, 4, 2, 8, 6,
                                                    np.float32))
    for causal in (False, True):
        runs = []
        for k_lengths in (None, list(lengths)):
            out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths, k_lengths=k_lengths,
                                                          causal=causal)
            runs.append((out, ctx.lse.unpack()) + lowbit.segmented_attention_backward(dout, ctx))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
            assert_equal(name, a, b)


def test_decode_sees_every_key_and_is_deterministic(backend, rng):
    # One query per sequence: causal (bottom-right) sees its whole cache, so it equals the full
    # mask bit for bit; and repeated calls agree bit for bit.
    lengths, k_lengths = [1, 1, 1], [130, 1, 17]
    q, k, v, _ = (backend.to(x) for x in _inputs(rng, lengths, k_lengths, 4, 1, 16, 8,
                                                 np.float32))
    causal = lowbit.segmented_attention(q, k, v, lengths, k_lengths=k_lengths, causal=True)
    assert_equal("causal vs full", lowbit.segmented_attention(q, k, v, lengths,
                                                              k_lengths=k_lengths), causal)
    assert_equal("rerun", lowbit.segmented_attention(q, k, v, lengths, k_lengths=k_lengths,
                                                     causal=True), causal)


def test_numba_decode_does_not_depend_on_thread_count(rng):
    if "numba" not in lowbit.available_backends():
        pytest.skip("numba is not installed")
    import numba

    lengths, k_lengths = [1, 2], [700, 40]
    q, k, v, _ = _inputs(rng, lengths, k_lengths, 4, 2, 16, 8, np.float32)
    threads = numba.get_num_threads()
    results = []
    try:
        for n in sorted({1, threads}):
            numba.set_num_threads(n)
            with lowbit.use_backend("numba"):
                out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths,
                                                              k_lengths=k_lengths, causal=True)
            results.append((out, ctx.lse.unpack()))
    finally:
        numba.set_num_threads(threads)
    for out, lse in results[1:]:
        assert_equal("out", results[0][0], out)
        assert_equal("lse", results[0][1], lse)


def test_numba_decode_splits_per_segment(rng):
    # Each key segment is split by its own length (``split_keys``: 1100 keys in items of the
    # largest size, 128; 300 in items of 64; 40 in items of 32): a sequence's result matches the
    # reference and is the same bits alone as beside others of other lengths.
    if "numba" not in lowbit.available_backends():
        pytest.skip("numba is not installed")
    from lowbit.ops.segmented_attention import _numba_decode

    assert _numba_decode.split_keys(np.array([1100, 300, 40])).tolist() == [
        _numba_decode.MAX_SPLIT_KEYS, 64, _numba_decode.SPLIT_KEYS]
    q, k, v, _ = _inputs(rng, [1, 1, 1], [1100, 300, 40], 4, 2, 16, 8, np.float32)
    with lowbit.use_backend("numba"):
        out = lowbit.segmented_attention(q, k, v, [1, 1, 1], k_lengths=[1100, 300, 40],
                                         causal=True)
        first = lowbit.segmented_attention(q[:1], k[:1100], v[:1100], [1], k_lengths=[1100],
                                           causal=True)
        last = lowbit.segmented_attention(q[2:], k[1400:], v[1400:], [1], k_lengths=[40],
                                          causal=True)
    ref, _ = segmented_attention_ref(q, k, v, [1, 1, 1], None, True, [1100, 300, 40])
    assert_close("out", ref, out, RTOL[np.float32], RTOL[np.float32])
    assert_equal("the first alone vs in the batch", first, out[:1])
    assert_equal("the last alone vs in the batch", last, out[2:])


def test_reference_backward_matches_finite_differences(rng):
    # Chunked, more queries than keys (rows without keys: zero gradient), an empty segment.
    lengths, k_lengths = [2, 4, 0, 2], [5, 2, 3, 2]
    for causal in (False, True):
        q, k, v, dout = _inputs(rng, lengths, k_lengths, 2, 1, 3, 2, np.float64)

        def loss():
            return float(np.sum(segmented_attention_ref(q, k, v, lengths, 0.8, causal,
                                                        k_lengths)[0] * dout))

        grads = segmented_attention_bwd_ref(dout, q, k, v, lengths, 0.8, causal, k_lengths)
        for name, x, grad in zip(("dq", "dk", "dv"), (q, k, v), grads):
            assert_close(name, numerical_grad(loss, x), grad, 1e-7, 1e-9)


def test_reference_mask_is_bottom_right(rng):
    # Lq = 2 queries, Lk = 4 keys: query 0 sees keys 0..2, query 1 all four.
    q, k, v, _ = _inputs(rng, [2], [4], 1, 1, 3, 2, np.float64)
    out, lse = segmented_attention_ref(q, k, v, [2], 1.0, True, [4])
    for i, seen in ((0, 3), (1, 4)):
        s = k[:seen, 0] @ q[i, 0]
        assert_close(f"lse[{i}]", np.log(np.exp(s).sum(keepdims=True)), lse[0, i:i + 1], 1e-12)
        assert_close(f"out[{i}]", np.exp(s - lse[0, i]) @ v[:seen, 0], out[i, 0], 1e-12)


def test_ctx_keeps_key_offsets(rng):
    q, k, v, _ = _inputs(rng, [1, 2], [3, 4], 2, 1, 4, 4, np.float32)
    with lowbit.use_backend("numpy"):
        _, ctx = lowbit.segmented_attention_forward(q, k, v, [1, 2], k_lengths=[3, 4])
    assert ctx.offsets.tolist() == [0, 1, 3]
    assert ctx.k_offsets.tolist() == [0, 3, 7]


# ---- validation: one test per rule; the message names the argument ----

def _valid(rng):
    q, k, v, _ = _inputs(rng, [1, 2], [3, 4], 4, 2, 3, 5, np.float32)
    return q, k, v


@pytest.mark.parametrize("k_lengths, error, match", [
    ([7], ValueError, r"k_lengths must have one entry per segment of lengths \(2\), got 1"),
    ([3, 4, 0], ValueError, "k_lengths must have one entry per segment"),
    ([3, 3], ValueError, "k_lengths must sum to the token count of k and v 7, got 6"),
    ([3, 5], ValueError, "k_lengths must sum to the token count of k and v 7; the running"),
    ([-1, 8], ValueError, r"k_lengths must all be non-negative.*k_lengths\[0\]"),
    ([], ValueError, "k_lengths must be non-empty"),
    ([3.0, 4.0], TypeError, "k_lengths must hold integers"),
    ([3, True], TypeError, "k_lengths must hold integers"),
    (np.array([[3, 4]]), ValueError, "k_lengths must be 1-D"),
    ("34", TypeError, "k_lengths"),
    (7, TypeError, "k_lengths"),
], ids=["too-few", "too-many", "sum-under", "sum-over", "negative", "empty", "floats", "bool",
        "2d", "string", "scalar"])
def test_bad_k_lengths(rng, never_runs, k_lengths, error, match):
    q, k, v = _valid(rng)
    with pytest.raises(error, match=match):
        lowbit.segmented_attention_forward(q, k, v, [1, 2], k_lengths=k_lengths)
    with pytest.raises(error, match=match):
        lowbit.segmented_attention(q, k, v, [1, 2], k_lengths=k_lengths)


@pytest.mark.parametrize("lengths, match", [
    ([1, -1, 2], r"lengths must all be non-negative.*lengths\[1\]"),
    ([1, 1], "lengths must sum to the token count of q 3, got 2"),
], ids=["negative", "sum"])
def test_bad_lengths_with_k_lengths(rng, never_runs, lengths, match):
    q, k, v = _valid(rng)
    with pytest.raises(ValueError, match=match):
        lowbit.segmented_attention_forward(q, k, v, lengths, k_lengths=[3, 4][:len(lengths)]
                                           + [0] * (len(lengths) - 2))


def test_k_and_v_token_counts_must_agree(rng, never_runs):
    q, k, v = _valid(rng)
    with pytest.raises(ValueError, match="k and v must share their token count"):
        lowbit.segmented_attention_forward(q, k, v[:6], [1, 2], k_lengths=[3, 4])


def test_other_token_count_needs_k_lengths(rng, never_runs):
    q, k, v = _valid(rng)
    with pytest.raises(ValueError, match="token count of q.*k_lengths"):
        lowbit.segmented_attention_forward(q, k, v, [1, 2])


def test_empty_segments_need_k_lengths(rng, never_runs):
    # Without k_lengths the lengths stay positive, as before.
    q, k, v = _valid(rng)
    with pytest.raises(ValueError, match="lengths must all be positive"):
        lowbit.segmented_attention_forward(q, q[:, :2], q[:, :2], [3, 0])
