"""Properties of ``lowbit/ops/segmented_attention`` and ``lowbit/ops/expand_heads``.

Forward, logsumexp and every gradient on every CPU backend equal
``reference/segmented_attention.py`` within the tolerances of
``tests/test_segmented_attention.py``; segments cross the numba kernels' query and key blocks
(its ``BLOCK_*``, ``CHUNK_*`` and ``BACKWARD_*`` sizes); ``expand_heads`` and its backward are
exact. Example-based tests: ``tests/test_segmented_attention.py``, ``tests/test_expand_heads.py``.
"""

import numpy as np
import pytest
from helpers import assert_close, assert_equal
from hypothesis import example, given, strategies as st
from strategies import LAYOUTS, boundaries, dims, on_backends, relayout

import lowbit
from lowbit.ops.segmented_attention import _numba as sa_numba
from lowbit.reference.segmented_attention import (expand_heads_bwd_ref, expand_heads_ref,
                                                  segmented_attention_bwd_ref,
                                                  segmented_attention_ref)

RTOL = {np.float32: 1e-4, np.float64: 1e-10}
SEGMENT = dims(*boundaries(sa_numba, "BLOCK", "CHUNK", "BACKWARD"), high=600)
# Tokens x query heads above which the float64 reference's row loop takes too long.
MAX_ROWS = 600
SIM_TOKENS = 8


@st.composite
def attention_inputs(draw):
    lengths = draw(st.lists(SEGMENT, min_size=1, max_size=4))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    tokens = sum(lengths)
    while tokens * heads > MAX_ROWS and len(lengths) > 1:
        lengths.pop()
        tokens = sum(lengths)
    if tokens * heads > MAX_ROWS:
        heads = kv
    dim, dim_v = draw(dims(high=65)), draw(dims(high=33))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.0, 1.0, 3.0]))  # 0: every score equal
    q = (rng.standard_normal((tokens, heads, dim)) * spread).astype(dtype)
    k = (rng.standard_normal((tokens, kv, dim)) * spread).astype(dtype)
    v = rng.standard_normal((tokens, kv, dim_v)).astype(dtype)
    dout = rng.standard_normal((tokens, heads, dim_v)).astype(dtype)
    layout = draw(st.sampled_from(LAYOUTS))
    q, k, v = (relayout(a, layout) for a in (q, k, v))
    scale = draw(st.sampled_from([None, 0.01, 1.0]))
    return lengths, q, k, v, dout, scale, draw(st.booleans())


@given(case=attention_inputs())
@example(case=([1, 1, 1], *(np.ones((3, 1, 2)),) * 3, np.ones((3, 1, 2)), None, True))
def test_segmented_attention_equals_reference(case):
    lengths, q, k, v, dout, scale, causal = case
    ref_out, ref_lse = segmented_attention_ref(q, k, v, lengths, scale, causal)
    ref_grads = segmented_attention_bwd_ref(dout, q, k, v, lengths, scale, causal)

    def call():
        out, ctx = lowbit.segmented_attention_forward(q, k, v, lengths, scale=scale, causal=causal)
        grads = lowbit.segmented_attention_backward(dout, ctx)
        inference = lowbit.segmented_attention(q, k, v, lengths, scale=scale, causal=causal)
        return out, ctx.lse.unpack(), grads, inference

    # cudasim runs a thread per (row, lane) with barriers: only at a handful of tokens.
    tiny = q.shape[0] <= SIM_TOKENS and max(q.shape[2], v.shape[2]) <= SIM_TOKENS
    out = on_backends(call, q.size if tiny else 10**9, q=q, k=k, v=v, dout=dout)
    rtol = RTOL[q.dtype.type]
    for name, (y, lse, grads, inference) in out.items():
        assert_close(f"{name} out", ref_out, y, rtol, rtol)
        assert_close(f"{name} lse", ref_lse, lse, rtol, rtol)
        for g, ref, got in zip(("dq", "dk", "dv"), ref_grads, grads):
            assert got.dtype == q.dtype
            assert_close(f"{name} {g}", ref, got, rtol, rtol)
        assert_equal(f"{name} inference", y, inference)


@given(lengths=st.sampled_from([[0, 3], [4], [1, 1], [-1, 4], [1.5, 1.5]]),
       scale=st.sampled_from([1.0, 0.0, -1.0, float("nan"), float("inf")]))
def test_bad_lengths_and_scale_are_rejected(lengths, scale):
    q = np.ones((3, 1, 2), np.float32)
    if sum(lengths) == 3 and min(lengths) > 0 and all(isinstance(n, int) for n in lengths):
        if scale > 0 and np.isfinite(scale):
            return
        with pytest.raises(ValueError, match="scale"):
            lowbit.segmented_attention(q, q, q, lengths, scale=scale)
        return
    with pytest.raises((TypeError, ValueError), match="lengths"):
        lowbit.segmented_attention(q, q, q, lengths, scale=scale)


@pytest.mark.parametrize("dtypes", [(np.float32, np.float64, np.float32),
                                    (np.int32, np.int32, np.int32),
                                    (np.float16, np.float16, np.float16)])
def test_bad_dtypes_are_rejected(dtypes):
    q, k, v = (np.ones((3, 1, 2), d) for d in dtypes)
    with pytest.raises(TypeError, match="q|k|v"):
        lowbit.segmented_attention(q, k, v, [3])


@given(shape=st.lists(dims(low=1, high=5), min_size=1, max_size=3), data=st.data(),
       dtype=st.sampled_from([np.float32, np.float64, np.int8, np.bool_]),
       repeat=st.sampled_from([1, 2, 3]), layout=st.sampled_from(LAYOUTS))
def test_expand_heads_equals_reference(shape, data, dtype, repeat, layout):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = relayout(np.random.default_rng(len(shape)).integers(0, 2, shape).astype(dtype), layout)
    target = x.shape[axis] * repeat
    for name, y in on_backends(lambda: lowbit.expand_heads(x, axis, target), x=x).items():
        assert_equal(f"{name} expand", expand_heads_ref(x, axis, target), y)
    if dtype in (np.float32, np.float64):
        dy = relayout(np.asarray(expand_heads_ref(x, axis, target)) * 1.5, layout)
        for name, dx in on_backends(lambda: lowbit.expand_heads_backward(dy, axis, x.shape[axis]),
                                    dy=dy).items():
            assert_close(f"{name} backward", expand_heads_bwd_ref(dy, axis, x.shape[axis]), dx,
                         1e-15)
