"""Tests of ``lowbit/ops/packed_matmul``: packed matmul and the straight-through linear layer.

Every backend against ``reference/packed_matmul.py`` (forward, both gradients, and the backward
with ``grad_format="int8"`` bit for bit), the reference backward against central finite
differences, ctx byte accounting, bad input. Kernels: ``cuda/packed_matmul.cu`` (GEMV,
tensor-core GEMM twin, dx, dw under cudasim; their edges: ``tests/test_packed_matmul_cuda.py``);
numba's float products (table lookups, FMA tiles, BLAS blocks) at their edges:
``tests/test_packed_matmul_float.py``.
"""

import numpy as np
import pytest
from helpers import Backend
from helpers import assert_close, assert_equal, numerical_grad, to_numpy

import lowbit
from lowbit.reference.packed_matmul import (linear_bwd_int8_ref, linear_bwd_ref, linear_ref,
                                            packed_matmul_ref)
from lowbit.reference.quantize import quantize_weight_ref

FORMATS = ("ternary", "sign", "int8")
# (M, K, N): one row and few rows (GEMV kernels), more rows than a GEMM tile in both directions
# (tiled GEMM, two block rows and columns), long odd K.
SHAPES = [(1, 37, 3), (3, 113, 37), (37, 75, 45), (9, 4097, 3)]
# cudasim runs each CUDA thread as an OS thread: the same kernel paths on fewer blocks.
SIM_SHAPES = [(1, 37, 3), (3, 45, 11), (33, 40, 33)]


def _shapes(backend):
    return SIM_SHAPES if backend.name == "cudasim" else SHAPES


def _data(rng, M, K, N):
    x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    return x, w


def _packed(backend, w, format):
    data, scale = quantize_weight_ref(w, format)
    return lowbit.PackedWeight(format, w.shape, backend.to(data), backend.to(scale))


@pytest.mark.parametrize("act_format", ["int8", "int4"])
@pytest.mark.parametrize("format", FORMATS)
def test_packed_matmul_int_matches_reference_exactly(backend, rng, format, act_format):
    for M, K, N in _shapes(backend):
        x, w = _data(rng, M, K, N)
        pw = _packed(backend, w, format)
        y = lowbit.packed_matmul(backend.to(x), pw, act_format)
        ref = packed_matmul_ref(x, to_numpy(pw.data), to_numpy(pw.scale), format, K, act_format)
        assert_equal(f"y {M}x{K}x{N}", ref, y)


@pytest.mark.parametrize("format", FORMATS)
def test_packed_matmul_float_matches_reference(backend, rng, format):
    for M, K, N in [(1, 37, 3), (3, 45, 11) if backend.name == "cudasim" else (2, 4097, 3)]:
        x, w = _data(rng, M, K, N)
        pw = _packed(backend, w, format)
        y = lowbit.packed_matmul(backend.to(x), pw, None)
        ref = packed_matmul_ref(x, to_numpy(pw.data), to_numpy(pw.scale), format, K, None)
        assert_close(f"y {M}x{K}x{N}", ref, y, rtol=1e-5)
        assert y.dtype == np.float32


def test_packed_matmul_leading_axes(backend, rng):
    x = rng.standard_normal((2, 3, 37)).astype(np.float32)
    w = rng.standard_normal((37, 5)).astype(np.float32)
    pw = _packed(backend, w, "ternary")
    y = lowbit.packed_matmul(backend.to(x), pw)
    assert y.shape == (2, 3, 5)
    assert_equal("y", packed_matmul_ref(x, to_numpy(pw.data), to_numpy(pw.scale), "ternary", 37),
                 y)


@pytest.mark.parametrize("format", ["ternary", "int8"])
def test_exact_at_largest_codes(backend, format):
    """Every code at its largest magnitude: int32 sums up to 127 * 127 * K (> 2^24), exact."""
    M, K, N = 9, 1025 if backend.name == "cudasim" else 4097, 3
    x = np.ones((M, K), dtype=np.float32)
    x[1::2] *= -1
    w = np.ones((K, N), dtype=np.float32)
    w[:, 1] *= -1
    pw = _packed(backend, w, format)
    y = lowbit.packed_matmul(backend.to(x), pw, "int8")
    assert_equal("y", packed_matmul_ref(x, to_numpy(pw.data), to_numpy(pw.scale), format, K), y)


def use_kernel(monkeypatch, kernel):
    """Run the numba packed matmul on one kernel family: "vnni" (AVX-512 VNNI), "avx2" (AVX2 or
    AVX-VNNI, ``_avx2.py`` and ``_avx2_gemm.py``) or "portable"; skip where this CPU lacks it.
    The GEMV of both SIMD families is ``_avx2.gemv``, on 512-bit vectors where the CPU has
    AVX-512 VNNI (its 256-bit variants run in ``tests/test_packed_matmul_targets.py``)."""
    from lowbit.ops.packed_matmul import _numba
    from lowbit.ops.packed_matmul._numba import _avx2, _vnni

    if kernel == "vnni" and not _vnni.AVAILABLE:
        pytest.skip("this CPU has no AVX-512 VNNI")
    if kernel == "avx2" and not _avx2.AVAILABLE:
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setattr(_numba, "USE_VNNI", kernel == "vnni")
    monkeypatch.setattr(_numba, "USE_AVX2", kernel == "avx2")


KERNELS = ["vnni", "avx2", "portable"]


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("saturated", [None, "all", "half"])
@pytest.mark.parametrize("name,kernel", [("numpy", None)] + [("numba", k) for k in KERNELS],
                         ids=["numpy"] + [f"numba-{k}" for k in KERNELS])
def test_gemm_rows_of_mixed_magnitude(monkeypatch, name, kernel, rng, format, saturated):
    """GEMM rows (M = 38, past both GEMV thresholds) with one row of largest codes, over all of K
    or its second half only.

    The portable numba GEMM plans its exact float64 fields from the row L1 norms of the
    activation codes per K chunk: typical rows fit one chunk over K, a saturated row forces
    shorter chunks or fewer fields. N = 3 p + 1 and 3 p + 2 leave a partly filled field group
    (N = 1: one column only). The VNNI GEMM sees M = 38 = six whole 6-row tiles and a
    2-row one, and a partial 64-column panel; K = 2499 is not a multiple of 4.
    """
    if kernel is not None:
        use_kernel(monkeypatch, kernel)
    M, K = 38, 2499
    for N in (1, 2, 7, 8, 9):
        x = rng.standard_normal((M, K)).astype(np.float32)
        if saturated == "all":
            x[5] = np.where(np.arange(K) % 2, 1.0, -1.0)
        elif saturated == "half":
            x[5, : K // 2] = 1e-3
            x[5, K // 2:] = 1.0
        w = rng.standard_normal((K, N)).astype(np.float32)
        w[:, N - 1] = np.sign(x[5])  # its sum with row 5 reaches the plan's bound
        pw = _packed(Backend(name), w, format)
        with lowbit.use_backend(name):
            y = lowbit.packed_matmul(x, pw, "int8")
        ref = packed_matmul_ref(x, to_numpy(pw.data), to_numpy(pw.scale), format, K)
        assert_equal(f"y {format} {saturated} N={N}", ref, y)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_numba_gemv_kernels(monkeypatch, rng, format, kernel):
    """Every numba GEMV kernel (AVX-512 VNNI, AVX2 / AVX-VNNI, the portable loops) against the
    reference.

    K is chosen around the GEMV blocks (32 to 128 packed bytes a loop iteration) so that whole
    blocks, tails and rows shorter than one block all occur; the last case has every code
    at its largest magnitude with alternating signs.
    """
    use_kernel(monkeypatch, kernel)
    cases = [(1, 1, 3), (3, 37, 5), (8, 511, 4), (2, 513, 3), (1, 1031, 7), (5, 4096, 2),
             (16, 300, 9), (32, 515, 5), (1, 4096 + 257, 3)]
    for i, (M, K, N) in enumerate(cases):
        x, w = _data(rng, M, K, N)
        if i == len(cases) - 1:
            x = np.repeat(np.where(np.arange(K) % 2, 1.0, -1.0).astype(np.float32)[None], 5, 0)
            w = np.ones((K, N), dtype=np.float32)
        pw = _packed(Backend("numba"), w, format)
        with lowbit.use_backend("numba"):
            y = lowbit.packed_matmul(x, pw, "int8")
        ref = packed_matmul_ref(x, to_numpy(pw.data), to_numpy(pw.scale), format, K)
        assert_equal(f"y {M}x{K}x{N}", ref, y)


@pytest.mark.parametrize("format", FORMATS)
def test_weight_data_in_any_memory_order(backend, rng, format):
    """A PackedWeight whose data array is Fortran-ordered gives the same result (GEMV and GEMM)."""
    for M, K, N in [(1, 75, 5), (9, 75, 5)]:
        x, w = _data(rng, M, K, N)
        data, scale = quantize_weight_ref(w, format)
        pw = lowbit.PackedWeight(format, w.shape, backend.to(np.asfortranarray(data)),
                                 backend.to(scale))
        y = lowbit.packed_matmul(backend.to(x), pw)
        assert_equal(f"y {M}x{K}x{N}", packed_matmul_ref(x, data, scale, format, K), y)


def test_deterministic(backend, rng):
    x, w = _data(rng, *_shapes(backend)[-1])
    pw = _packed(backend, w, "sign")
    for act in ("int8", None):
        first = lowbit.packed_matmul(backend.to(x), pw, act)
        assert_equal(f"rerun {act}", first, lowbit.packed_matmul(backend.to(x), pw, act))


# (weight_format, act_format, M, K, N)
LINEAR_CASES = [
    ("ternary", "int8", 6, 37, 5),
    ("sign", "int4", 33, 40, 33),
    ("int8", "int8", 33, 40, 33),
    ("ternary", None, 3, 45, 11),
    ("sign", None, 12, 1031, 9),  # dx from field-major tiles: K past one tile, not whole bytes
    ("ternary", "int8", 12, 1031, 9),
    ("int8", None, 6, 37, 5),
    (None, "int8", 6, 37, 5),
    (None, None, 6, 37, 5),
]


@pytest.mark.parametrize("weight_format,act_format,M,K,N", LINEAR_CASES)
def test_linear_matches_reference(backend, rng, weight_format, act_format, M, K, N):
    x, w = _data(rng, M, K, N)
    x = x.reshape((2, M // 2, K)) if M % 2 == 0 else x
    dy = rng.standard_normal(x.shape[:-1] + (N,)).astype(np.float32)
    keep = (x.copy(), w.copy(), dy.copy())
    y, ctx = lowbit.linear_forward(backend.to(x), backend.to(w), weight_format, act_format)
    assert_close("y", linear_ref(x, w, weight_format, act_format), y, rtol=1e-6)
    dx, dw = lowbit.linear_backward(backend.to(dy), ctx)
    rdx, rdw = linear_bwd_ref(dy, x, w, weight_format, act_format)
    assert_close("dx", rdx, dx, rtol=1e-5)
    assert_close("dw", rdw, dw, rtol=1e-5)
    assert dx.shape == x.shape and dw.shape == w.shape
    assert dx.dtype == np.float32 and dw.dtype == np.float32
    for name, before, arr in zip(("x", "w", "dy"), keep, (x, w, dy)):
        np.testing.assert_array_equal(before, arr, err_msg=name)


# (weight_format, act_format, M, K, N): one row (the GEMV kernels forward), 6-row tiles with a
# remainder, K and N past one 64-column panel, N not a multiple of 4 (the VNNI groups)
INT8_GRAD_CASES = [
    ("ternary", "int8", 1, 37, 5),
    ("ternary", "int8", 20, 70, 67),
    ("sign", "int4", 33, 40, 33),
    ("int8", "int8", 13, 65, 30),
]


@pytest.mark.parametrize("weight_format,act_format,M,K,N", INT8_GRAD_CASES)
def test_int8_gradients_match_reference_exactly(backend, rng, weight_format, act_format, M, K,
                                                N):
    x, w = _data(rng, M, K, N)
    x = x.reshape((2, M // 2, K)) if M % 2 == 0 else x
    dy = rng.standard_normal(x.shape[:-1] + (N,)).astype(np.float32)
    keep = (x.copy(), w.copy(), dy.copy())
    _, ctx = lowbit.linear_forward(backend.to(x), backend.to(w), weight_format, act_format)
    dx, dw = lowbit.linear_backward(backend.to(dy), ctx, grad_format="int8")
    rdx, rdw = linear_bwd_int8_ref(dy, x, w, weight_format, act_format)
    assert_equal("dx", rdx, dx)
    assert_equal("dw", rdw, dw)
    assert dx.shape == x.shape and dw.shape == w.shape
    # an approximation of the exact gradients, and a close one
    edx, edw = linear_bwd_ref(dy, x, w, weight_format, act_format)
    assert_close("dx against the exact gradient", edx, dx, rtol=2e-2)
    assert_close("dw against the exact gradient", edw, dw, rtol=2e-2)
    for name, before, arr in zip(("x", "w", "dy"), keep, (x, w, dy)):
        np.testing.assert_array_equal(before, arr, err_msg=name)
    again = lowbit.linear_backward(backend.to(dy), ctx, grad_format="int8")
    assert_equal("dx rerun", dx, again[0])
    assert_equal("dw rerun", dw, again[1])


def test_int8_gradients_at_largest_codes(backend):
    """Every gradient and weight code at its largest magnitude: dx sums 127 * 127 * N (past 2^24,
    so the float32 rounding of the exact sum is what is compared; under cudasim, whose dw kernel
    runs an OS thread per CUDA thread, a short N)."""
    M, K, N = 3, 5, 37 if backend.name == "cudasim" else 4099
    x = np.ones((M, K), np.float32)
    w = np.ones((K, N), np.float32)
    w[1] *= -1
    dy = np.ones((M, N), np.float32)
    dy[2] *= -1
    _, ctx = lowbit.linear_forward(backend.to(x), backend.to(w), "int8", "int8")
    dx, dw = lowbit.linear_backward(backend.to(dy), ctx, grad_format="int8")
    rdx, rdw = linear_bwd_int8_ref(dy, x, w, "int8", "int8")
    assert_equal("dx", rdx, dx)
    assert_equal("dw", rdw, dw)


def test_linear_int_forward_equals_packed_matmul(backend, rng):
    x, w = _data(rng, 33, 40, 33)
    y, _ = lowbit.linear_forward(backend.to(x), backend.to(w), "ternary", "int8")
    pw = _packed(backend, w, "ternary")
    assert_equal("y", packed_matmul_ref(x, to_numpy(pw.data), to_numpy(pw.scale), "ternary", 40),
                 y)


def test_reference_backward_matches_finite_differences(rng):
    x = rng.standard_normal((2, 3, 4))
    w = rng.standard_normal((4, 5))
    dy = rng.standard_normal((2, 3, 5))
    dx, dw = linear_bwd_ref(dy, x, w, None, None)
    loss = lambda: float((linear_ref(x, w, None, None) * dy).sum())  # noqa: E731
    assert_close("dx", numerical_grad(loss, x), dx, rtol=1e-8)
    assert_close("dw", numerical_grad(loss, w), dw, rtol=1e-8)


def test_backward_unquantized_matches_finite_differences(backend, rng):
    x = rng.standard_normal((3, 7))
    w = rng.standard_normal((7, 4))
    dy = rng.standard_normal((3, 4))
    _, ctx = lowbit.linear_forward(backend.to(x), backend.to(w), None, None)
    dx, dw = lowbit.linear_backward(backend.to(dy), ctx)
    loss = lambda: float((linear_ref(x, w, None, None) * dy).sum())  # noqa: E731
    assert_close("dx", numerical_grad(loss, x), dx, rtol=1e-5)
    assert_close("dw", numerical_grad(loss, w), dw, rtol=1e-5)


def test_ctx_saves_int8_codes_exactly(rng):
    x, w = _data(rng, 6, 40, 5)
    _, ctx = lowbit.linear_forward(x, w, "ternary", "int8")
    q = lowbit.quantize_activation(x, "int8")
    assert_equal("codes", q.codes, ctx.act_codes.unpack())
    assert_equal("scale", q.scale, ctx.act_scale.unpack())
    assert ctx.nbytes == 6 * 40 + 4 * 6
    assert ctx.dense_nbytes == 4 * 6 * 40 + 4 * 6
    assert ctx.nbytes * 4 <= ctx.dense_nbytes + 3 * 4 * 6
    report = lowbit.memory_report(ctx)
    assert report.nbytes == ctx.nbytes and len(report.rows) == 2
    _, ctx = lowbit.linear_forward(x, w, "ternary", None)
    assert ctx.nbytes == ctx.dense_nbytes == 4 * 6 * 40


def test_saved_int8_policy(rng):
    x, w = _data(rng, 6, 40, 5)
    dy = rng.standard_normal((6, 5)).astype(np.float32)
    _, ctx = lowbit.linear_forward(x, w, "ternary", None, saved="int8")
    assert ctx.nbytes < ctx.dense_nbytes / 3
    dx, dw = lowbit.linear_backward(dy, ctx)
    rdx, rdw = linear_bwd_ref(dy, x, w, "ternary", None)
    assert_close("dx", rdx, dx, rtol=1e-5)
    assert_close("dw (int8-saved x)", rdw, dw, rtol=2e-2)


# ---- bad input: one test per rule --------------------------------------------------------------


def _pw():
    return lowbit.quantize_weight(np.ones((4, 3), np.float32), "ternary")


def test_x_not_array():
    with pytest.raises(TypeError, match="x must be a numpy or cupy array"):
        lowbit.packed_matmul([[1.0] * 4], _pw())


def test_x_dtype():
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        lowbit.packed_matmul(np.ones((2, 4), np.int32), _pw())


def test_x_rank():
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        lowbit.packed_matmul(np.array(1.0, np.float32), _pw())


def test_k_mismatch():
    with pytest.raises(ValueError, match="x has K = 5.*pw has K = 4"):
        lowbit.packed_matmul(np.ones((2, 5), np.float32), _pw())


def test_pw_type():
    with pytest.raises(TypeError, match="pw must be a lowbit.PackedWeight"):
        lowbit.packed_matmul(np.ones((2, 4), np.float32), np.ones((4, 3), np.float32))


@pytest.mark.parametrize("change,error,message", [
    (dict(format="int4"), ValueError, "pw.format must be one of"),
    (dict(shape=(4, 0)), ValueError, r"pw.shape must be \(K, N\)"),
    (dict(shape=[4, 3]), ValueError, r"pw.shape must be \(K, N\)"),
    (dict(data=[[0]]), TypeError, "pw.data must be a numpy or cupy array"),
    (dict(data=np.zeros((3, 1), np.int8)), ValueError, r"pw.data must be uint8 of shape \(3, 1\)"),
    (dict(data=np.zeros((3, 2), np.uint8)), ValueError, r"pw.data must be uint8 of shape"),
    (dict(data=np.zeros((2, 1), np.uint8)), ValueError, r"pw.data must be uint8 of shape"),
    (dict(scale=np.ones(2, np.float32)), ValueError, "pw.scale must be float32 with 1 or N"),
    (dict(scale=np.ones((), np.float64)), ValueError, "pw.scale must be float32"),
])
def test_pw_fields_checked_before_any_kernel(change, error, message):
    """A hand-built PackedWeight whose fields disagree with its format and shape (which would
    send the kernels past its data) is rejected, naming the field."""
    import dataclasses

    pw = dataclasses.replace(_pw(), **change)
    with pytest.raises(error, match=message):
        lowbit.packed_matmul(np.ones((2, 4), np.float32), pw)


def test_unknown_act_format(never_runs):
    with never_runs.paused():
        pw = _pw()
    with pytest.raises(ValueError, match="act_format must be one of"):
        lowbit.packed_matmul(np.ones((2, 4), np.float32), pw, "int2")


@pytest.mark.parametrize("act_format", ["int8", None])
def test_non_finite_x(backend, act_format):
    x = np.ones((3, 4), np.float32)
    x[2, 1] = np.nan
    pw = _packed(backend, np.ones((4, 3), np.float32), "sign")
    with pytest.raises(ValueError, match="x must be finite"):
        lowbit.packed_matmul(backend.to(x), pw, act_format)


def test_linear_w_rank():
    with pytest.raises(ValueError, match="w must have shape"):
        lowbit.linear_forward(np.ones((2, 4), np.float32), np.ones(4, np.float32), "ternary")


def test_linear_k_mismatch():
    with pytest.raises(ValueError, match="x has K = 4.*w has K = 5"):
        lowbit.linear_forward(np.ones((2, 4), np.float32), np.ones((5, 3), np.float32), "sign")


def test_linear_unknown_weight_format():
    with pytest.raises(ValueError, match="weight_format must be one of"):
        lowbit.linear_forward(np.ones((2, 4), np.float32), np.ones((4, 3), np.float32), "int4")


def test_linear_non_finite_w():
    w = np.ones((4, 3), np.float32)
    w[0, 0] = np.inf
    with pytest.raises(ValueError, match="w must be finite"):
        lowbit.linear_forward(np.ones((2, 4), np.float32), w, None, None)


def test_backward_dy_shape():
    _, ctx = lowbit.linear_forward(np.ones((2, 4), np.float32), np.ones((4, 3), np.float32),
                                   "ternary")
    with pytest.raises(ValueError, match="dy must have the forward output's shape"):
        lowbit.linear_backward(np.ones((2, 4), np.float32), ctx)


def test_backward_ctx_type():
    with pytest.raises(TypeError, match="ctx must be the LinearCtx"):
        lowbit.linear_backward(np.ones((2, 3), np.float32), object())


@pytest.mark.parametrize("weight_format,act_format,grad_format,message", [
    ("ternary", "int8", "int4", "grad_format must be None or one of"),
    ("ternary", "int8", 8, "grad_format must be None or one of"),
    (None, "int8", "int8", "grad_format='int8' needs a weight_format and an act_format"),
    ("ternary", None, "int8", "grad_format='int8' needs a weight_format and an act_format"),
])
def test_backward_grad_format(never_runs, weight_format, act_format, grad_format, message):
    with never_runs.paused():
        _, ctx = lowbit.linear_forward(np.ones((2, 4), np.float32), np.ones((4, 3), np.float32),
                                       weight_format, act_format)
    with pytest.raises(ValueError, match=message):
        lowbit.linear_backward(np.ones((2, 3), np.float32), ctx, grad_format=grad_format)


def test_int8_gradients_non_finite_dy():
    _, ctx = lowbit.linear_forward(np.ones((2, 4), np.float32), np.ones((4, 3), np.float32),
                                   "ternary")
    dy = np.ones((2, 3), np.float32)
    dy[1, 2] = np.inf
    with pytest.raises(ValueError, match="dy must be finite"):
        lowbit.linear_backward(dy, ctx, grad_format="int8")
