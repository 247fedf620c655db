"""Properties of ``lowbit/ops/quantize`` and ``lowbit/ops/packed_matmul`` on every CPU backend.

Codes, scales and integer-path products equal ``reference/quantize.py`` and
``reference/packed_matmul.py`` exactly; the float path and the straight-through linear layer
within the tolerances of ``tests/test_packed_matmul.py``. Shapes cross the numba kernels' row
switches (``GEMV_MAX_ROWS``, ``VNNI_GEMV_MAX_ROWS``, the VNNI ``TILE_ROWS``), the GEMV block
widths and ``TILE_N``, with the AVX-512 kernels on and off (``_portable``). Example-based
tests: ``tests/test_quantize.py``, ``tests/test_packed_matmul.py``.
"""

import contextlib

import numpy as np
import pytest
from helpers import assert_close, assert_equal
from hypothesis import assume, example, given, strategies as st
from strategies import LAYOUTS, arrays, boundaries, dims, on_backends, relayout, unchanged

import lowbit
from lowbit.ops.packed_matmul import _numba as pm_numba
from lowbit.ops.packed_matmul._numba import _avx2, _vnni
from lowbit.reference.packed_matmul import linear_bwd_ref, linear_ref, packed_matmul_ref
from lowbit.reference.quantize import (ACT_QMAX, quantize_activation_ref, quantize_weight_ref,
                                       weight_codes_ref)

FORMATS = ("ternary", "sign", "int8")
ROWS = dims(*boundaries(pm_numba, "GEMV_MAX_ROWS", "VNNI_GEMV_MAX_ROWS"),
            *boundaries(_vnni, "TILE_ROWS"), high=33)
# K one past each GEMV block (in codes: bytes x codes per byte) and a GEMM k-block.
K_DIMS = dims(64, *{_avx2.BLOCK_BYTES[b] * (8 // b) for b in _avx2.BLOCK_BYTES}, high=513)
N_DIMS = dims(*boundaries(pm_numba, "TILE_N"), high=1025)
# Products of the reference's explicit loops stay below this many multiply-adds.
REF_WORK = 20_000


def _matmul_oracle(x, pw, act):
    """``packed_matmul_ref`` vectorized (same rounding order), for shapes whose explicit loops
    would take too long; checked against it on small shapes. The weight codes are ``pw.codes()``,
    which ``test_quantize_weight_equals_reference`` holds to the reference."""
    K, N = pw.shape
    cw = pw.codes().astype(np.int64)
    sw = np.broadcast_to(np.asarray(pw.scale, np.float32), (N,))
    rows = x.reshape(-1, K)
    if act is None:
        return ((rows.astype(np.float64) @ cw) * sw.astype(np.float64)).astype(np.float32)
    cx, sx = quantize_activation_ref(rows, act)
    acc = cx.astype(np.int64) @ cw
    return (acc.astype(np.float32) * sx[:, None]).astype(np.float32) * sw[None, :]


@given(K=K_DIMS, N=dims(high=37), format=st.sampled_from(FORMATS),
       dtype=st.sampled_from([np.float32, np.float64]), layout=st.sampled_from(LAYOUTS),
       data=st.data())
@example(K=4, N=2, format="ternary", dtype=np.float32, layout="C", data=None).via("ties")
def test_quantize_weight_equals_reference(K, N, format, dtype, layout, data):
    assume(K * N <= 4096)
    if data is None:  # ties: mean |w| is 1, so 0.5 and 1.5 are exact ties of the quotient
        w = np.array([[0.5, -0.5], [1.5, -1.5], [0.0, 0.0], [2.0, -2.0]], dtype)
    else:
        w = relayout(data.draw(arrays((K, N), dtype)), layout)
    ref_data, ref_scale = quantize_weight_ref(w, format)
    codes, _ = weight_codes_ref(w, format)
    out = on_backends(lambda: (lowbit.quantize_weight(w, format),
                               lowbit.fake_quantize_weight(w, format)), w.size, w=w)
    for name, (pw, fq) in out.items():
        assert_equal(f"{name} data", ref_data, pw.data)
        assert_equal(f"{name} scale", ref_scale, pw.scale)
        assert_equal(f"{name} codes", codes, pw.codes())
        assert fq.dtype == w.dtype and fq.shape == w.shape
        assert_equal(f"{name} fake", pw.dequantize().astype(w.dtype), fq)


@given(lead=st.lists(dims(high=13), max_size=2), K=K_DIMS, format=st.sampled_from(sorted(ACT_QMAX)),
       dtype=st.sampled_from([np.float32, np.float64]), layout=st.sampled_from(LAYOUTS),
       constant=st.booleans(), data=st.data())
def test_quantize_activation_equals_reference(lead, K, format, dtype, layout, constant, data):
    shape = (*lead, K)
    x = data.draw(arrays(shape, dtype))
    if constant:  # every value equal: one level, or the scale floor at zero
        x[...] = x.reshape(-1)[0]
    x = relayout(x, layout)
    codes, scale = quantize_activation_ref(x, format)
    for name, q in on_backends(lambda: lowbit.quantize_activation(x, format), x.size,
                               x=x).items():
        assert_equal(f"{name} codes", codes, q.codes)
        assert_equal(f"{name} scale", scale, q.scale)


@contextlib.contextmanager
def _portable(active):
    """Turn off the numba backend's AVX-512 kernels (VNNI GEMV/GEMM, FMA dx) inside the block, so
    that the portable GEMV, the float64-field BLAS GEMM and the tiled dx run on this CPU too."""
    saved = pm_numba.USE_VNNI, pm_numba.USE_FMA
    if active:
        pm_numba.USE_VNNI, pm_numba.USE_FMA = False, False
    try:
        yield
    finally:
        pm_numba.USE_VNNI, pm_numba.USE_FMA = saved


@given(M=ROWS, K=K_DIMS, N=N_DIMS, format=st.sampled_from(FORMATS),
       act=st.sampled_from(["int8", "int4", None]), layout=st.sampled_from(LAYOUTS),
       dtype=st.sampled_from([np.float32, np.float64]), portable=st.booleans(), data=st.data())
def test_packed_matmul_equals_reference(M, K, N, format, act, layout, dtype, portable, data):
    assume(M * K * N <= 600_000)
    draw = data.draw
    w = draw(arrays((K, N), np.float32, elements=st.floats(-4, 4, width=32)))
    x = relayout(draw(arrays((M, K), dtype, elements=st.floats(-100, 100, width=32))), layout)
    pw = lowbit.quantize_weight(w, format)
    want = _matmul_oracle(x, pw, act)
    if M * K * N <= REF_WORK:
        ref = packed_matmul_ref(x, pw.data, pw.scale, format, K, act)
        if act is None:
            assert_close("oracle", ref, want, rtol=1e-12)
        else:
            assert_equal("oracle", ref, want)
    with _portable(portable):
        out = on_backends(lambda: lowbit.packed_matmul(x, pw, act), x.size + w.size, x=x,
                          data_=pw.data, scale=pw.scale)
    for name, y in out.items():
        # computed in float32, returned in x's dtype
        assert y.dtype == dtype and y.shape == (M, N)
        if act is None:
            assert_close(f"{name} y", want, y, rtol=1e-5)
        else:
            assert_equal(f"{name} y", want.astype(dtype), y)


@given(lead=st.lists(dims(high=7), min_size=1, max_size=2), K=dims(high=37), N=dims(high=13),
       weight_format=st.sampled_from([*FORMATS, None]),
       act=st.sampled_from(["int8", "int4", None]), layout=st.sampled_from(LAYOUTS),
       dtype=st.sampled_from([np.float32, np.float64]), portable=st.booleans(), data=st.data())
def test_linear_equals_reference(lead, K, N, weight_format, act, layout, dtype, portable, data):
    x = relayout(data.draw(arrays((*lead, K), dtype, elements=st.floats(-8, 8, width=32))),
                 layout)
    w = relayout(data.draw(arrays((K, N), dtype, elements=st.floats(-2, 2, width=32))), layout)
    dy = data.draw(arrays((*lead, N), np.float32, elements=st.floats(-2, 2, width=32)))
    dy = dy.astype(dtype)  # the output's dtype (x and w share dtype here)
    y_ref = linear_ref(x, w, weight_format, act)
    dx_ref, dw_ref = linear_bwd_ref(dy, x, w, weight_format, act)

    def call():
        y, ctx = lowbit.linear_forward(x, w, weight_format, act)
        return (y, *lowbit.linear_backward(dy, ctx))

    with _portable(portable):
        out = on_backends(call, x.size + w.size, x=x, w=w, dy=dy)
    for name, (y, dx, dw) in out.items():
        assert_close(f"{name} y", y_ref, y, rtol=1e-5, atol=1e-5)
        assert_close(f"{name} dx", dx_ref, dx, rtol=1e-5, atol=1e-5)
        assert_close(f"{name} dw", dw_ref, dw, rtol=1e-5, atol=1e-5)


BAD = st.sampled_from([np.nan, np.inf, -np.inf])


@given(bad=BAD, where=st.integers(0, 20), format=st.sampled_from(FORMATS))
@example(bad=np.nan, where=0, format="int8").via("numba int8 column absmax dropped the NaN")
def test_non_finite_input_is_rejected(bad, where, format):
    w = np.ones((7, 3), np.float32)
    w.flat[where] = bad
    x = np.ones((2, 7), np.float32)
    x.flat[where % x.size] = bad
    pw = lowbit.quantize_weight(np.ones((7, 3), np.float32), format)
    for name in on_backends(lambda: 0):
        with lowbit.use_backend(name), unchanged(w=w, x=x):
            with pytest.raises(ValueError, match="w must be finite"):
                lowbit.quantize_weight(w, format)
            with pytest.raises(ValueError, match="x must be finite"):
                lowbit.quantize_activation(x)
            for act in ("int8", None):
                with pytest.raises(ValueError, match="x must be finite"):
                    lowbit.packed_matmul(x, pw, act)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.bool_, np.complex64, np.float16])
def test_non_float_dtypes_are_rejected(dtype):
    w = np.ones((4, 3), dtype)
    pw = lowbit.quantize_weight(np.ones((4, 3), np.float32), "ternary")
    with pytest.raises(TypeError, match="w"):
        lowbit.quantize_weight(w, "ternary")
    with pytest.raises(TypeError, match="x"):
        lowbit.quantize_activation(w)
    with pytest.raises(TypeError, match="x"):
        lowbit.packed_matmul(np.ones((2, 4), dtype), pw)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0)])
def test_empty_weight_is_rejected(shape):
    with pytest.raises(ValueError, match="w must have K >= 1"):
        lowbit.quantize_weight(np.zeros(shape, np.float32), "sign")


@given(M=st.sampled_from([0, 1, 9]), lead=st.sampled_from([(), (0,), (2, 0)]))
def test_zero_rows_give_empty_outputs(M, lead):
    pw = lowbit.quantize_weight(np.ones((5, 3), np.float32), "ternary")
    x = np.ones((*lead, M, 5), np.float32)
    for name, y in on_backends(lambda: lowbit.packed_matmul(x, pw), x=x).items():
        assert y.shape == (*lead, M, 3), name
        assert_equal(name, packed_matmul_ref(x, pw.data, pw.scale, "ternary", 5), y)
