"""oneMKL's integer GEMM in the numba packed matmul (``lowbit/ops/packed_matmul/_numba/_mkl.py``).

It runs where the CPU has AMX; MKL computes the same exact int32 products without AMX, so every
case here runs the module on any x86-64 CPU with the ``mkl`` extra installed and checks it bit
for bit against the reference codes (``reference/quantize.py``'s unpacking, int64 products):
every weight format, shapes around its blocks (``BLOCK_N``, K not a multiple of a byte's codes),
the offsets at their edges (codes -128 / 127, every stored field at its largest), the GEMM and
the dx of int8 gradients, and the dispatch in ``_numba/__init__.py`` with ``USE_MKL`` forced on
(the straight-through backward's int8 gradients end to end against their float64 reference).
"""

import numpy as np
import pytest

import lowbit
from lowbit.reference.packed_matmul import linear_bwd_int8_ref
from lowbit.reference.quantize import (quantize_activation_ref, quantize_weight_ref,
                                       unpack_weight_ref)

_mkl = pytest.importorskip("lowbit.ops.packed_matmul._numba._mkl",
                           reason="the numba backend is not available")
pytestmark = pytest.mark.skipif(not _mkl.available(),
                                reason="oneMKL is not installed: pip install lowbit[mkl]")

FORMATS = ("ternary", "sign", "int8")
# (M, K, N): below and above BLOCK_N output features, K odd and not a multiple of 4 or 8
SHAPES = [(17, 37, 5), (33, 301, 520), (64, 1031, 1030)]


def _scaled(acc, sx, scale):
    sw = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (acc.shape[1],))
    return (acc.astype(np.float32) * sx.astype(np.float32)[:, None]) * sw


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_gemm_and_dx_match_the_reference(format, M, K, N):
    rng = np.random.default_rng(M + K + N)
    data, scale = quantize_weight_ref(rng.standard_normal((K, N)), format)
    codes_w = unpack_weight_ref(data, format, K).astype(np.int64)  # [K, N]
    cx, sx = quantize_activation_ref(rng.standard_normal((M, K)) * 2, "int8")
    sw = np.asarray(scale, np.float32).reshape(-1)
    y = _mkl.gemm(cx, sx, data, sw, lowbit.ops.quantize.WEIGHT_FORMATS[format], K,
                  np.empty((M, N), np.float32))
    np.testing.assert_array_equal(y, _scaled(cx.astype(np.int64) @ codes_w, sx, scale))
    cg, sg = quantize_activation_ref(rng.standard_normal((M, N)), "int8")
    dx = _mkl.gemm_dx(cg, sg, data, lowbit.ops.quantize.WEIGHT_FORMATS[format], K,
                      np.float32(0.375), np.empty((M, K), np.float32))
    np.testing.assert_array_equal(dx, _scaled(cg.astype(np.int64) @ codes_w.T, sg,
                                              np.float32(0.375)))


@pytest.mark.parametrize("format", FORMATS)
def test_offsets_at_their_edges(format):
    """Codes -128 and 127 against every stored field at its largest (ternary 3 in the 2-bit
    field, sign 1, int8 -128): the u8 offsets stay exact."""
    M, K, N = 20, 203, 17
    cx = np.full((M, K), -128, np.int8)
    cx[1] = 127
    nbytes = K if format == "int8" else -(-K * {"ternary": 2, "sign": 1}[format] // 8)
    data = np.full((N, nbytes), 0x80 if format == "int8" else 0xFF, np.uint8)
    if format == "int8":
        data = data.view(np.int8)
    codes_w = unpack_weight_ref(data, format, K).astype(np.int64)
    sx = np.full(M, 0.5, np.float32)
    bits = lowbit.ops.quantize.WEIGHT_FORMATS[format]
    y = _mkl.gemm(cx, sx, data, np.full(1, 0.25, np.float32), bits, K,
                  np.empty((M, N), np.float32))
    np.testing.assert_array_equal(y, _scaled(cx.astype(np.int64) @ codes_w, sx, 0.25))
    cg = np.full((M, N), -128, np.int8)
    dx = _mkl.gemm_dx(cg, sx, data, bits, K, np.float32(0.25), np.empty((M, K), np.float32))
    np.testing.assert_array_equal(dx, _scaled(cg.astype(np.int64) @ codes_w.T, sx, 0.25))


def test_dispatch_with_mkl_forced_on(monkeypatch):
    """USE_MKL on: more rows than MKL_MIN_ROWS go to MKL, fewer stay on lowbit's GEMV, and the
    int8-gradient backward equals its reference."""
    from lowbit.ops.packed_matmul import _numba

    calls = []
    for name in ("gemm", "gemm_dx"):
        def spy(*args, _f=getattr(_mkl, name), _name=name):
            calls.append(_name)
            return _f(*args)
        monkeypatch.setattr(_mkl, name, spy)
    monkeypatch.setattr(_numba, "USE_MKL", True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 75)).astype(np.float32)
    w = rng.standard_normal((75, 45)).astype(np.float32)
    dy = rng.standard_normal((40, 45)).astype(np.float32)
    with lowbit.use_backend("numba"):
        pw = lowbit.quantize_weight(w, "ternary")
        y_few = lowbit.packed_matmul(x[:_numba.MKL_MIN_ROWS], pw)
        assert calls == []
        _, ctx = lowbit.linear_forward(x, w, "ternary", "int8")
        dx, dw = lowbit.linear_backward(dy, ctx, grad_format="int8")
    assert "gemm" in calls and "gemm_dx" in calls
    with lowbit.use_backend("numpy"):
        np.testing.assert_array_equal(y_few, lowbit.packed_matmul(x[:_numba.MKL_MIN_ROWS], pw))
    rdx, rdw = linear_bwd_int8_ref(dy, x, w, "ternary", "int8")
    np.testing.assert_array_equal(dx, rdx)
    np.testing.assert_array_equal(dw, rdw)
