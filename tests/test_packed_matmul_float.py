"""Tests of the numba packed matmul's float32 products: the exact straight-through backward's dx
and dw, and the forward with float activations (``lowbit/ops/packed_matmul/_numba/``).

The table-lookup products of ternary and sign weights (``_lut.py``: ``matmul_float``, and
``matmul_dx`` from ``LUT_MIN_ROWS`` rows) are checked twice: against
``reference/packed_matmul.py``'s float64 products (float32 tolerance), and bit for bit against
``_lut_oracle`` below, a NumPy statement of the summation order the kernels document (each group
of four codes summed as two pairs, the groups added in order, then scaled), independent
of how the kernels lay out their tables, tiles and threads. Shapes cross the kernels' edges: row
tiles of 16 with remainders, fewer row tiles than threads (columns shared), column tiles of 6,
blocks of tables, reductions not a multiple of 4, dx over weight rows not a multiple of 4. Also:
per-row scales, a ternary field of 3 (the other path runs, as the reference reads it), the thread
count not changing a bit, and (in ``tests/test_packed_matmul_targets.py``) the Haswell build
giving the host's bits.

Few rows of float activations times rows stored narrower (``_f32_gemv.py``: int8, bfloat16,
float16, float32) bit for bit against ``_f32_gemv_oracle``, its documented lane order with every
fused multiply-add rounded once in exact rationals. The FMA tiles (``_fma.py``) and the BLAS
blocks (``_backward.py``), with the tables held off (they still run for int8 weights and wherever
a table cannot), at their edges against the reference.
"""

from fractions import Fraction

import numba
import numpy as np
import pytest
from helpers import assert_close, assert_equal

import lowbit
from lowbit.ops.packed_matmul import _numba
from lowbit.ops.packed_matmul._numba import _f32_gemv, _lut, _lut_gemv
from lowbit.reference.packed_matmul import linear_bwd_int8_ref, linear_bwd_ref, packed_matmul_ref
from lowbit.reference.quantize import quantize_weight_ref, unpack_weight_ref

FORMATS = ("ternary", "sign")
ALL_FORMATS = ("ternary", "sign", "int8")
# (M, K, N): one row (dx's transposed GEMV), two (dx's tables), few rows (the forward's
# ``_lut_gemv``), one row tile shared by column ranges, 16-row tiles and a remainder, reductions
# across blocks of tables both ways, one output column, a long K.
SHAPES = [(1, 37, 5), (2, 9, 70), (4, 1, 1), (5, 13, 7), (17, 70, 53), (33, 29, 130),
          (20, 9, 1030), (6, 4097, 3)]


def _lut_oracle(a, codes, scale):
    """``sum_j T_j * scale`` in float32, ``T_j = (c0 a0 + c1 a1) + (c2 a2 + c3 a3)`` over the
    four codes of group j (a [M, R] float32, codes [R, C] in {-1, 0, 1, 2}, zeros past R)."""
    M, R = a.shape
    G = -(-R // 4)
    a4 = np.zeros((M, 4 * G), np.float32)
    a4[:, :R] = a
    c4 = np.zeros((4 * G, codes.shape[1]), np.float32)
    c4[:R] = codes
    acc = np.zeros((M, codes.shape[1]), np.float32)
    for j in range(G):
        v = [a4[:, 4 * j + i, None] * c4[4 * j + i] for i in range(4)]
        acc = acc + ((v[0] + v[1]) + (v[2] + v[3]))
    return acc * np.asarray(scale, np.float32)


@pytest.fixture
def lut_calls(monkeypatch):
    """The number of ``_lut.gemm`` and ``_lut_gemv.gemv`` calls so far, in a list."""
    calls = [0]
    for module, name in ((_lut, "gemm"), (_lut_gemv, "gemv")):
        def spy(*args, _f=getattr(module, name)):
            calls[0] += 1
            return _f(*args)

        monkeypatch.setattr(module, name, spy)
    return calls


def _weight(rng, format, K, N, per_row=False):
    data, scale = quantize_weight_ref(rng.standard_normal((K, N)), format)
    if per_row:
        scale = rng.uniform(0.5, 2, N).astype(np.float32)
    return data, np.asarray(scale, np.float32)


@pytest.mark.parametrize("format", FORMATS)
def test_lut_forward_and_dx(rng, lut_calls, format):
    for M, K, N in SHAPES:
        for per_row in (False, True):
            data, scale = _weight(rng, format, K, N, per_row)
            codes = unpack_weight_ref(data, format, K).astype(np.float32)  # [K, N]
            x = rng.standard_normal((M, K)).astype(np.float32)
            dy = rng.standard_normal((M, N)).astype(np.float32)
            name = f"{format} {M}x{K}x{N}{' per-row' if per_row else ''}"
            calls = lut_calls[0]
            y = _numba.matmul_float(x, data, scale, format, K)
            dx = _numba.matmul_dx(dy, data, scale, format, K)
            tables = M >= _numba.LUT_MIN_ROWS
            assert lut_calls[0] == calls + 1 + tables, name
            assert_close(f"y {name}", packed_matmul_ref(x, data, scale, format, K, None), y,
                         rtol=1e-5)
            assert_equal(f"y oracle {name}", _lut_oracle(x, codes, scale), y)
            w = codes * scale
            assert_close(f"dx {name}", dy.astype(np.float64) @ w.T, dx, rtol=1e-5)
            if tables:
                g = dy * scale if per_row else dy
                assert_equal(f"dx oracle {name}",
                             _lut_oracle(g, codes.T, 1 if per_row else scale), dx)


# (K, N) of ``_lut_gemv``: rows of fewer than four bytes (scalar tables only), a few words
# (gathered) and a byte tail, a block of 16 (or 8) rows' words transposed with words and a tail
# after it, one output, row tiles of 64 (or 32) with a remainder, a long row of blocks.
GEMV_SHAPES = [(9, 20), (37, 5), (70, 130), (333, 70), (2053, 1), (1000, 257)]


@pytest.mark.parametrize("format", FORMATS)
def test_lut_gemv_kernels_against_the_oracle(rng, format):
    """Both kernels of ``_lut_gemv.gemv``, the lookups in registers (where the CPU has AVX2 or
    AVX-512, else not run) and the scalar tables, at their edges, three rows each: bit for bit
    ``_lut_oracle``, with a per-tensor or per-row scale and (ternary) fields of 3, which both
    read as code 2, as the reference does."""
    kernels = (False, True) if _lut_gemv.LANES else (False,)
    for K, N in GEMV_SHAPES:
        for per_row in (False, True):
            data, scale = _weight(rng, format, K, N, per_row)
            if format == "ternary":
                data[::3, ::5] |= 0xC0
            codes = unpack_weight_ref(data, format, K).astype(np.float32)
            x = rng.standard_normal((3, K)).astype(np.float32)
            want = _lut_oracle(x, codes, scale)
            s, cs = (np.float32(1), scale) if per_row else (scale, np.empty(0, np.float32))
            for simd in kernels:
                if simd and data.shape[1] < 4:
                    continue
                y = np.empty((3, N), np.float32)
                _lut_gemv.gemv(x, data, _numba._BITS[format], s, cs, y, simd)
                assert_equal(f"{format} {K}x{N} per-row {per_row} simd {simd}", want, y)


def _fma32(a, b, c):
    """float32 ``a * b + c`` rounded once, to nearest with ties to even (exact rationals)."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    candidates = (near, np.nextafter(near, np.float32(-np.inf)),
                  np.nextafter(near, np.float32(np.inf)))
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact),
                                          int(np.float32(v).view(np.int32)) & 1))


def _f32_gemv_oracle(x, codes, scale):
    """The order ``_f32_gemv`` documents: lane ``l`` fuses ``x[k] * w[k]`` for ``k = l, l + 16,
    ...``; lanes ``l`` and ``l + 8`` added, then ``l`` and ``l + 4``, ``l + 2``, ``l + 1``; times
    the row's scale."""
    M, K = x.shape
    out = np.empty((M, codes.shape[0]), np.float32)
    for m in range(M):
        for n in range(codes.shape[0]):
            lanes = [np.float32(0)] * 16
            for k in range(K):
                lanes[k % 16] = _fma32(x[m, k], codes[n, k], lanes[k % 16])
            while len(lanes) > 1:
                half = len(lanes) // 2
                lanes = [lanes[i] + lanes[i + half] for i in range(half)]
            out[m, n] = lanes[0] * scale[n]
    return out


def _stored(rng, dtype, K, N):
    """Rows [N, K] in ``dtype`` (16-bit floats as their bits), their float32 values, scales."""
    if dtype == "int8":
        data, scale = quantize_weight_ref(rng.standard_normal((K, N)), "int8")
        return data, data.astype(np.float32), scale
    w = rng.standard_normal((N, K)).astype(np.float32)
    if dtype == "bfloat16":
        data = (w.view(np.uint32) >> 16).astype(np.uint16)
        values = (data.astype(np.uint32) << 16).view(np.float32)
    else:
        data = w.astype(np.float16) if dtype == "float16" else w
        values = data.astype(np.float32)
    return data, values, rng.random(N).astype(np.float32) + 0.5


@pytest.mark.parametrize("dtype", ["int8", "bfloat16", "float16", "float32"])
def test_f32_gemv_against_the_oracle(rng, monkeypatch, dtype):
    """Few rows of float activations times rows stored narrower (``_f32_gemv``: int8 weights'
    forward, the BitNet head) bit for bit against ``_f32_gemv_oracle``: rows ending inside a
    vector (int8: read on into the next row; the last ones, and float rows, from a padded copy),
    rows shorter than a vector, whole vectors; one activation row and a group of four with one
    more; tiles of several stored rows and, as for a matrix read from memory (``STREAM_BYTES``),
    of one. A float row's infinity reaches no other row."""
    if not _f32_gemv.ready(dtype):
        pytest.skip(f"no {dtype} GEMV on this CPU")
    for K, N in [(37, 3), (5, 9), (128, 5), (333, 7)]:
        data, values, scale = _stored(rng, dtype, K, N)
        for M in (1, 5):
            x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
            want = _f32_gemv_oracle(x, values, scale)
            for stream in (False, True):
                monkeypatch.setattr(_f32_gemv, "STREAM_BYTES", 0 if stream else 1 << 62)
                what = f"{dtype} {M}x{K}x{N}{', streamed' if stream else ''}"
                y = _f32_gemv.gemv(x, data, scale, np.empty((M, N), np.float32), dtype)
                assert_equal(what, want, y)
                if dtype != "int8":
                    kept = data[1, 0]
                    data[1, 0] = 0x7F80 if dtype == "bfloat16" else np.inf
                    y = _f32_gemv.gemv(x, data, scale, np.empty((M, N), np.float32), dtype)
                    assert_equal(f"{what}, inf in row 1", want[:, [0, 2]], y[:, [0, 2]])
                    data[1, 0] = kept


@pytest.mark.parametrize("format", FORMATS)
def test_lut_through_the_linear_layer(rng, lut_calls, format):
    """``linear_forward`` without activation quantization and ``linear_backward`` reach the
    tables on the numba backend."""
    x = rng.standard_normal((2, 9, 70)).astype(np.float32)
    w = rng.standard_normal((70, 45)).astype(np.float32)
    dy = rng.standard_normal((2, 9, 45)).astype(np.float32)
    with lowbit.use_backend("numba"):
        y, ctx = lowbit.linear_forward(x, w, format, None)
        dx, _ = lowbit.linear_backward(dy, ctx)
    assert lut_calls[0] == 2
    data, scale = quantize_weight_ref(w, format)
    codes = unpack_weight_ref(data, format, 70).astype(np.float64)
    assert_close("y", x.reshape(18, 70) @ codes * scale, y.reshape(18, 45), rtol=1e-5)
    assert_close("dx", dy.reshape(18, 45) @ (codes * scale).T, dx.reshape(18, 70), rtol=1e-5)


def test_lut_ternary_field_of_three_takes_the_other_path(rng, lut_calls):
    """A hand-packed ternary byte with a field of 3 has no table slot: the decoded-BLAS paths
    run and read it as the reference does (code 2); so do the one-row forward's tables, which
    hold an entry for every byte."""
    M, K, N = 8, 37, 11
    data, scale = _weight(rng, "ternary", K, N)
    data[3, 2] |= 0xC0
    codes = unpack_weight_ref(data, "ternary", K).astype(np.float64)
    x = rng.standard_normal((M, K)).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    y = _numba.matmul_float(x, data, scale, "ternary", K)
    dx = _numba.matmul_dx(dy, data, scale, "ternary", K)
    assert lut_calls[0] == 0  # the offsets reported the field: no table ran
    assert_close("y", packed_matmul_ref(x, data, scale, "ternary", K, None), y, rtol=1e-5)
    assert_close("dx", dy @ (codes * scale).T, dx, rtol=1e-5)
    _, ok = _lut.offsets_rows(data, 2)
    assert not ok and not _lut.offsets_cols(data, 2, K)[1]
    y = _numba.matmul_float(x[:1], data, scale, "ternary", K)
    assert lut_calls[0] == 1
    assert_close("y one row", packed_matmul_ref(x[:1], data, scale, "ternary", K, None), y,
                 rtol=1e-5)


@pytest.mark.parametrize("format", ["ternary", "int8"])
def test_one_scale_as_an_array_of_one(rng, format):
    """A weight's single scale given as a [1] array applies to every column: the tables
    (ternary) and the decoded BLAS tiles (int8 weights, N past one tile of columns)."""
    K, N = 70, 700
    data, scale = _weight(rng, format, K, N)
    scale = np.float32(scale.reshape(-1)[0])
    for M in (1, 9):
        x = rng.standard_normal((M, K)).astype(np.float32)
        y = _numba.matmul_float(x, data, np.full(1, scale), format, K)
        assert_close(f"y {M} rows", packed_matmul_ref(x, data, scale, format, K, None), y,
                     rtol=1e-5)


@pytest.mark.parametrize("format", FORMATS)
def test_lut_thread_count_changes_no_bit(rng, format):
    """One thread against all of them (tasks share the columns of few row tiles differently)."""
    threads = numba.get_num_threads()
    for M, K, N in [(5, 70, 53), (40, 130, 70)]:
        data, scale = _weight(rng, format, K, N)
        x = rng.standard_normal((M, K)).astype(np.float32)
        dy = rng.standard_normal((M, N)).astype(np.float32)
        many = (_numba.matmul_float(x, data, scale, format, K),
                _numba.matmul_dx(dy, data, scale, format, K))
        numba.set_num_threads(1)
        try:
            one = (_numba.matmul_float(x, data, scale, format, K),
                   _numba.matmul_dx(dy, data, scale, format, K))
        finally:
            numba.set_num_threads(threads)
        assert_equal(f"y {M}x{K}x{N}", one[0], many[0])
        assert_equal(f"dx {M}x{K}x{N}", one[1], many[1])


def _data(rng, M, K, N):
    x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    return x, w


@pytest.mark.parametrize("weight_format", ALL_FORMATS)
def test_backward_tiles_at_their_edges(monkeypatch, backend, rng, weight_format):
    """Shapes around the numba FMA tiles of dx and dw (6 rows, 64 columns, 256 reduction
    steps a panel block), which run here wherever the CPU has AVX-512 (whatever ``USE_FMA``
    chose from NumPy's BLAS): 9 and 13 rows, K and N across 64 and past 256, M past one dw
    block; dw from codes and from float activations. Ternary and sign dx tables held off: they
    would take those rows (tested above)."""
    monkeypatch.setattr(_numba, "USE_FMA", _numba._fma.AVAILABLE)
    monkeypatch.setattr(_numba, "LUT_MIN_ROWS", 1 << 30)
    cases = ([(9, 45, 11)] if backend.name == "cudasim"
             else [(9, 1, 1), (9, 65, 257), (257, 7, 65)])
    for M, K, N in cases:
        x, w = _data(rng, M, K, N)
        dy = rng.standard_normal((M, N)).astype(np.float32)
        _, ctx = lowbit.linear_forward(backend.to(x), backend.to(w), weight_format, "int8")
        dx, dw = lowbit.linear_backward(backend.to(dy), ctx)
        rdx, rdw = linear_bwd_ref(dy, x, w, weight_format, "int8")
        assert_close(f"dx {M}x{K}x{N}", rdx, dx, rtol=1e-5)
        assert_close(f"dw {M}x{K}x{N}", rdw, dw, rtol=1e-5)
        _, ctx = lowbit.linear_forward(backend.to(x), backend.to(w), weight_format, None)
        _, dw = lowbit.linear_backward(backend.to(dy), ctx)
        assert_close(f"dw float x {M}x{K}x{N}", linear_bwd_ref(dy, x, w, weight_format, None)[1],
                     dw, rtol=1e-5)


@pytest.mark.parametrize("act_format", ["int8", None])
def test_numba_dw_from_transposed_activations(monkeypatch, rng, act_format):
    """numba's dw tiles (where the CPU has AVX-512) on activations transposed first (what large
    ones get), at the edges of the tiles and past one reduction block."""
    monkeypatch.setattr(_numba, "DW_TRANSPOSE_MIN", 1)
    monkeypatch.setattr(_numba, "USE_FMA", _numba._fma.AVAILABLE)
    for M, K, N in [(9, 65, 70), (257, 7, 65)]:
        x, w = _data(rng, M, K, N)
        dy = rng.standard_normal((M, N)).astype(np.float32)
        with lowbit.use_backend("numba"):
            _, ctx = lowbit.linear_forward(x, w, "ternary", act_format)
            _, dw = lowbit.linear_backward(dy, ctx)
        assert_close(f"dw {M}x{K}x{N}", linear_bwd_ref(dy, x, w, "ternary", act_format)[1], dw,
                     rtol=1e-5)


@pytest.mark.parametrize("weight_format", ALL_FORMATS)
def test_numba_backward_without_avx512(monkeypatch, rng, weight_format):
    """The numba backward where the CPU has neither AVX-512 kernel family: BLAS on decoded tiles
    (exact gradients) and float64 BLAS on the codes (int8 gradients)."""
    monkeypatch.setattr(_numba, "USE_FMA", False)
    monkeypatch.setattr(_numba, "USE_VNNI", False)
    monkeypatch.setattr(_numba, "USE_AVX2", False)
    x, w = _data(rng, 9, 70, 67)
    dy = rng.standard_normal((9, 67)).astype(np.float32)
    with lowbit.use_backend("numba"):
        _, ctx = lowbit.linear_forward(x, w, weight_format, "int8")
        dx, dw = lowbit.linear_backward(dy, ctx)
        idx, idw = lowbit.linear_backward(dy, ctx, grad_format="int8")
    rdx, rdw = linear_bwd_ref(dy, x, w, weight_format, "int8")
    assert_close("dx", rdx, dx, rtol=1e-5)
    assert_close("dw", rdw, dw, rtol=1e-5)
    rdx, rdw = linear_bwd_int8_ref(dy, x, w, weight_format, "int8")
    assert_equal("dx int8", rdx, idx)
    assert_equal("dw int8", rdw, idw)


@pytest.mark.parametrize("weight_format", ALL_FORMATS)
def test_numba_backward_blas_blocks(monkeypatch, rng, weight_format):
    """The numba exact backward on SciPy's BLAS blocks (``_backward.dx_blocks`` /
    ``dw_blocks``, what runs where the float32 tiles do not), with blocks shrunk so that small
    shapes cross them: K past several dx blocks of 16 features and not a multiple of a byte's
    codes, N past tiles of 24 decoded weight rows (the partial products added up), M past
    blocks of 10 rows, dw from codes and from float activations, split along K and (K shorter
    than a block) along N; then one shape at the real block sizes. Tables held off, as above
    (the blocks still run for int8 weights, and for ternary and sign ones where a table
    cannot)."""
    from lowbit.ops.packed_matmul._numba import _backward

    monkeypatch.setattr(_numba, "USE_FMA", False)
    monkeypatch.setattr(_numba, "LUT_MIN_ROWS", 1 << 30)
    with monkeypatch.context() as small:
        for name, value in (("DX_COLS", 16), ("DX_ROWS", 24), ("BLOCK_M", 10),
                            ("DW_MIN", 8)):
            small.setattr(_backward, name, value)
        cases = [(23, 37, 53), (9, 3, 40)]
        _check_backward_blocks(rng, weight_format, cases)
    _check_backward_blocks(rng, weight_format, [(1030, 9, 17)])


def _check_backward_blocks(rng, weight_format, cases):
    for M, K, N in cases:
        x, w = _data(rng, M, K, N)
        dy = rng.standard_normal((M, N)).astype(np.float32)
        with lowbit.use_backend("numba"):
            for act in ("int8", None):
                _, ctx = lowbit.linear_forward(x, w, weight_format, act)
                dx, dw = lowbit.linear_backward(dy, ctx)
                rdx, rdw = linear_bwd_ref(dy, x, w, weight_format, act)
                assert_close(f"dx {M}x{K}x{N} {act}", rdx, dx, rtol=1e-5)
                assert_close(f"dw {M}x{K}x{N} {act}", rdw, dw, rtol=1e-5)
