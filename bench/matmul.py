"""Suite ``matmul``: packed ternary/sign/int8 matmul against float matmul and a copy roofline.

Op: ``lowbit/ops/packed_matmul`` (formats in ``lowbit/ops/quantize``); reference:
``reference/packed_matmul.py``. Rows (CPU):

- GEMV, one row, K = N = 4096: NumPy float32 ``x @ W`` (baseline), the packed GEMV (target 5x),
  the same call against a NumPy copy of the packed bytes (target 0.5: at least half the copy
  roofline; the ratio is copy time over GEMV time for the same number of bytes, and both GB/s
  columns count those bytes once, the copy's writes not included; the ``kernel`` column says
  whether the AVX-512 VNNI kernels ran, here and in the GEMM rows), the ternary and sign GEMV
  with float32 activations (``act_format=None``: the table lookups of ``_lut_gemv.py``; int8
  weights: ``_f32_gemv.py``; checked against float64 at this shape), and the two portable
  Numba GEMV variants (plane decode, lookup table) side by side;
- GEMV, ternary, 16 rows of K = N = 4096 (target 3x) and one row of 2560 x 6912 (BitNet
  b1.58 2B's widest projection, target 5x), each against NumPy float32 ``x @ W``; the ``kernel``
  column also names the 256-bit ``avx2`` / ``avxvnni`` kernels;
- GEMM, M = 256: NumPy float32 matmul (baseline), packed GEMM (target 1.0; with float32
  activations checked against float64), with the weight bytes of both;
- the straight-through linear layer's backward (ternary weights, int8 activations) against its
  NumPy float32 equivalent: the exact path (target 1.0) and the opt-in int8 gradients (target
  2.0), with the cosine of the latter's dx and dw against the exact gradients;
- torch float32 / bfloat16 matmul on the same shapes when torch is installed;
- the ternary GEMM on oneMKL's integer GEMM when the ``mkl`` extra is installed (target 1.5x
  torch's bf16 matmul on a CPU with AMX, where lowbit chooses it; reported elsewhere).

With ``--gpu`` the same shapes run on cupy arrays against cupy float16 matmul (GEMM at M = 4096).
Thread counts are printed with the table; every side runs with the same ones.
"""

from __future__ import annotations

import contextlib

import numba
import numpy as np

import lowbit
from lowbit.reference.packed_matmul import linear_bwd_int8_ref, linear_bwd_ref, packed_matmul_ref

from ._harness import Case, Config

SUITE = "matmul"


# The lookup-table GEMV lives here, not in lowbit: it is slower than the plane-decode GEMV the
# library runs, and is kept only so this suite shows that comparison.
@numba.njit(parallel=True, cache=True)
def _lut_gemv2(codes_x, data, out):
    """Ternary GEMV through per-group lookup tables of the 256 sums a byte can select."""
    M, K = codes_x.shape
    N, nbytes = data.shape
    table = np.zeros((M, nbytes, 256), dtype=np.int32)
    for m in range(M):
        for g in numba.prange(nbytes):
            for b in range(256):
                s = np.int32(0)
                for j in range(4):
                    k = 4 * g + j
                    if k < K:
                        s += np.int32(codes_x[m, k]) * (((b >> (2 * j)) & 3) - 1)
                table[m, g, b] = s
    for n in numba.prange(N):
        row = data[n]
        for m in range(M):
            t = table[m]
            acc = np.int32(0)
            for g in range(nbytes):
                acc += t[g, row[g]]
            out[m, n] = acc


def _gemv_lut(codes_x, data):
    """Exact int32 ternary ``codes_x @ codes_w`` [M, N] through lookup tables."""
    acc = np.empty((codes_x.shape[0], data.shape[0]), dtype=np.int32)
    _lut_gemv2(codes_x, data, acc)
    return acc


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _maybe(backend):
    return lowbit.use_backend(backend) if backend else contextlib.nullcontext()


def _check_small(xp, backend, format, act_format, rows):
    """The same path on a small shape against the float64 reference."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, 75)).astype(np.float32)
    w = rng.standard_normal((75, 45)).astype(np.float32)
    with _maybe(backend):
        pw = lowbit.quantize_weight(xp.asarray(w), format)
        y = lowbit.packed_matmul(xp.asarray(x), pw, act_format)
    ref = packed_matmul_ref(x, _host(pw.data), _host(pw.scale), format, 75, act_format)
    if act_format is None:
        np.testing.assert_allclose(_host(y), ref, rtol=1e-4, atol=1e-4)
    else:
        np.testing.assert_array_equal(_host(y), ref)


def _check_float(x, pw, y):
    """A float-activation product at the benchmark's shape against float64 (float32 rounding)."""
    ref = (x.astype(np.float64) @ _host(pw.codes()).astype(np.float64)) * _host(pw.scale)
    np.testing.assert_allclose(_host(y), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def _check_exact(xp, backend, x, pw, y):
    """Int8-activation result of a large shape: exact integer sums in float64 BLAS, then scales."""
    q = lowbit.quantize_activation(x)
    codes_w = _host(pw.codes()).astype(np.float64)
    acc = _host(q.codes).astype(np.float64) @ codes_w  # integers below 2^53: exact
    ref = (acc.astype(np.float32) * _host(q.scale)[:, None]) * _host(pw.scale)
    np.testing.assert_array_equal(_host(y), ref)


def _kernel(backend):
    """Which numba integer kernels (GEMV and GEMM) the auto/numba rows run."""
    if backend not in (None, "numba") or "numba" not in lowbit.available_backends():
        return "-"
    from lowbit.ops.packed_matmul import _numba
    from lowbit.ops.packed_matmul._numba import _avx2
    if _numba.USE_VNNI:
        return "vnni"
    if _numba.USE_AVX2:
        return "avxvnni" if _avx2.AVX_VNNI else "avx2"
    return "portable"


def _float_kernel(backend, grad=False, rows=None, fmt="ternary"):
    """Which numba kernels the float-activation rows run: for ternary and sign weights the table
    lookups (``_lut.py``; for one row ``_lut_gemv.py``'s, in registers of ``LANES`` lanes or
    scalar), for one row of int8 weights ``_f32_gemv.py`` or the decoded tiles, and for the exact
    backward also dw's (FMA tiles or BLAS blocks)."""
    if _kernel(backend) == "-":
        return "-"
    from lowbit.ops.packed_matmul import _numba
    from lowbit.ops.packed_matmul._numba import _f32_gemv, _lut_gemv
    if fmt == "int8":
        return "f32 gemv (fma)" if _f32_gemv.AVAILABLE else "decoded tiles + blas"
    if rows == 1:
        lanes = _lut_gemv.LANES
        return f"lut gemv ({lanes}-lane permutes)" if lanes else "lut gemv (scalar)"
    if not grad:
        return "lut"
    return "lut dx, " + ("fma tiles dw" if _numba.USE_FMA else "blas blocks dw")


def _torch_cases(x, w, prefix, baseline):
    try:
        import torch
    except ImportError:
        return
    tx, tw = torch.from_numpy(x), torch.from_numpy(w)
    bx, bw = tx.to(torch.bfloat16), tw.to(torch.bfloat16)
    info = {"threads": torch.get_num_threads()}
    yield Case(SUITE, f"{prefix} torch f32", fn=lambda: tx @ tw, baseline=baseline, info=info)
    yield Case(SUITE, f"{prefix} torch bf16", fn=lambda: bx @ bw, baseline=baseline, info=info)


def _mkl_cases(xm, pw, M, K, N):
    """The ternary GEMM on oneMKL's ``cblas_gemm_s8u8s32`` (what ``USE_MKL`` picks on a CPU with
    AMX), called directly so that it is timed wherever the ``mkl`` extra is installed: against
    torch's bf16 matmul with target 1.5 on an AMX CPU with torch, against NumPy f32 otherwise
    (without AMX it is reported, not chosen: ``kernel`` says which)."""
    try:
        from lowbit.ops.packed_matmul._numba import _mkl
    except ImportError:
        return
    if not _mkl.available():
        return
    try:
        import torch  # noqa: F401
        peer = _mkl.AMX
    except ImportError:
        peer = False
    q = lowbit.quantize_activation(xm)
    sw = np.asarray(pw.scale, np.float32).reshape(-1)
    out = np.empty((M, N), np.float32)

    def fn():
        return _mkl.gemm(q.codes, q.scale, pw.data, sw, 2, K, out)

    yield Case(SUITE, "gemm ternary/int8 mkl", fn=fn,
               check=lambda: _check_exact(np, None, xm, pw, fn().copy()),
               baseline="gemm torch bf16" if peer else "gemm numpy f32",
               target=1.5 if peer else None, flops=2.0 * M * K * N,
               info={"shape": f"{M}x{K}x{N}", "format": "ternary/int8",
                     "kernel": "mkl amx" if _mkl.AMX else "mkl (no amx: not chosen)"})


def cases(config: Config):
    if config.gpu:
        yield from _gpu_cases(config)
        return
    backend = config.backend
    label = backend or "auto"
    K = N = 1024 if config.quick else 4096
    M = 64 if config.quick else 256
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    x1 = rng.standard_normal((1, K)).astype(np.float32)
    xm = rng.standard_normal((M, K)).astype(np.float32)
    with _maybe(backend):
        packed = {f: lowbit.quantize_weight(w, f) for f in ("ternary", "sign", "int8")}
    pw = packed["ternary"]

    def run(fn):
        def timed():
            with _maybe(backend):
                return fn()
        return timed

    # GEMV ------------------------------------------------------------------------------------
    src = np.random.default_rng(2).integers(0, 256, pw.data.nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    yield Case(SUITE, "copy packed bytes", fn=lambda: np.copyto(dst, src), nbytes=src.nbytes,
               info={"shape": f"{src.nbytes:,} B"})
    yield Case(SUITE, "gemv numpy f32", fn=lambda: x1 @ w, nbytes=w.nbytes,
               flops=2.0 * K * N, info={"shape": f"1x{K}x{N}", "weight B": w.nbytes})
    for fmt, act in (("ternary", "int8"), ("sign", "int8"), ("int8", "int8"), ("ternary", None),
                     ("sign", None), ("int8", None)):
        p = packed[fmt]
        fn = run(lambda p=p, act=act: lowbit.packed_matmul(x1, p, act))

        def check(p=p, fn=fn, fmt=fmt, act=act):
            _check_small(np, backend, fmt, act, 1)
            if act is not None:
                _check_exact(np, backend, x1, p, fn())
            else:
                _check_float(x1, p, fn())

        info = {"shape": f"1x{K}x{N}", "format": f"{fmt}/{act}", "weight B": p.nbytes,
                "kernel": _kernel(backend) if act else _float_kernel(backend, rows=1, fmt=fmt)}
        name = f"gemv {fmt} {label}" if act else f"gemv {fmt}/None {label}"
        yield Case(SUITE, name, fn=fn, check=check, baseline="gemv numpy f32",
                   target=5.0 if (fmt, act) == ("ternary", "int8") else None, nbytes=p.nbytes,
                   flops=2.0 * K * N, info=info)
        if (fmt, act) == ("ternary", "int8"):
            yield Case(SUITE, f"gemv {fmt} {label} vs copy", fn=fn, baseline="copy packed bytes",
                       target=0.5, nbytes=p.nbytes, info=info)
    if backend in (None, "numba"):
        from lowbit.ops.packed_matmul._numba import _gemv
        codes = lowbit.quantize_activation(x1).codes
        exact = codes.astype(np.int64) @ pw.codes().astype(np.int64)
        yield Case(SUITE, "gemv kernel portable plane-decode", fn=lambda: _gemv.gemv_acc(
            codes, pw.data, "ternary"), baseline="copy packed bytes", nbytes=pw.data.nbytes,
            check=lambda: np.testing.assert_array_equal(
                _gemv.gemv_acc(codes, pw.data, "ternary"), exact),
            info={"format": "ternary/int8"})
        yield Case(SUITE, "gemv kernel portable lookup-table", fn=lambda: _gemv_lut(
            codes, pw.data), baseline="copy packed bytes", nbytes=pw.data.nbytes,
            check=lambda: np.testing.assert_array_equal(_gemv_lut(codes, pw.data), exact),
            info={"format": "ternary/int8"})
    yield from _torch_cases(x1, w, "gemv", "gemv numpy f32")
    yield from _more_gemv_cases(backend, label, rng, w, 16 if not config.quick else 4)

    # GEMM ------------------------------------------------------------------------------------
    yield Case(SUITE, "gemm numpy f32", fn=lambda: xm @ w, flops=2.0 * M * K * N,
               info={"shape": f"{M}x{K}x{N}", "weight B": w.nbytes})
    for fmt, act in (("ternary", "int8"), ("sign", "int8"), ("int8", "int8"), ("ternary", None)):
        p = packed[fmt]
        fn = run(lambda p=p, act=act: lowbit.packed_matmul(xm, p, act))

        def check(p=p, fn=fn, fmt=fmt, act=act):
            _check_small(np, backend, fmt, act, 33)
            if act is not None:
                _check_exact(np, backend, xm, p, fn())
            else:
                _check_float(xm, p, fn())

        yield Case(SUITE, f"gemm {fmt}/{act} {label}", fn=fn, check=check,
                   baseline="gemm numpy f32", target=1.0 if (fmt, act) == ("ternary", "int8")
                   else None, flops=2.0 * M * K * N,
                   info={"shape": f"{M}x{K}x{N}", "format": f"{fmt}/{act}", "weight B": p.nbytes,
                         "kernel": _kernel(backend) if act else _float_kernel(backend),
                         "weight saving": round(w.nbytes / p.nbytes, 1)})
    yield from _torch_cases(xm, w, "gemm", "gemm numpy f32")

    # straight-through backward ---------------------------------------------------------------
    yield from _backward_cases(backend, label, rng, xm, w, M, K, N)
    # last: nothing of MKL's is loaded while the NumPy and lowbit rows above are timed
    yield from _mkl_cases(xm, pw, M, K, N)


def _more_gemv_cases(backend, label, rng, w, rows):
    """Ternary GEMV at ``rows`` rows of the square shape, and one row of BitNet b1.58 2B's
    widest projection (K = 2560, N = 6912), each against NumPy float32 ``x @ W``."""
    K, N = w.shape
    for M, wk in ((rows, w), (1, rng.standard_normal((2560, 6912)).astype(np.float32))):
        x = rng.standard_normal((M, wk.shape[0])).astype(np.float32)
        shape = f"{M}x{wk.shape[0]}x{wk.shape[1]}"
        base = f"gemv {shape} numpy f32"
        yield Case(SUITE, base, fn=lambda x=x, wk=wk: x @ wk, nbytes=wk.nbytes,
                   flops=2.0 * x.size * wk.shape[1], info={"shape": shape})
        with _maybe(backend):
            p = lowbit.quantize_weight(wk, "ternary")

        def fn(x=x, p=p):
            with _maybe(backend):
                return lowbit.packed_matmul(x, p, "int8")

        yield Case(SUITE, f"gemv {shape} ternary {label}", fn=fn, baseline=base,
                   check=lambda x=x, p=p, fn=fn: _check_exact(np, backend, x, p, fn()),
                   target=3.0 if M > 1 else 5.0, nbytes=p.nbytes,
                   flops=2.0 * x.size * wk.shape[1],
                   info={"shape": shape, "format": "ternary/int8", "kernel": _kernel(backend)})


def _cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _check_backward_small(backend, grad_format):
    """The straight-through backward on a small shape against its float64 reference: the exact
    path within float32 rounding, the int8 gradient path bit for bit."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((33, 75)).astype(np.float32)
    w = rng.standard_normal((75, 45)).astype(np.float32)
    dy = rng.standard_normal((33, 45)).astype(np.float32)
    with _maybe(backend):
        _, ctx = lowbit.linear_forward(x, w, "ternary", "int8")
        dx, dw = lowbit.linear_backward(dy, ctx, grad_format=grad_format)
    if grad_format is None:
        rdx, rdw = linear_bwd_ref(dy, x, w, "ternary", "int8")
        np.testing.assert_allclose(dx, rdx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-5)
    else:
        rdx, rdw = linear_bwd_int8_ref(dy, x, w, "ternary", "int8")
        np.testing.assert_array_equal(dx, rdx)
        np.testing.assert_array_equal(dw, rdw)


def _backward_cases(backend, label, rng, xm, w, M, K, N):
    """NumPy float32 ``(dy @ w.T, x.T @ dy)`` (baseline), lowbit's exact straight-through backward
    (target 1.0) and its int8 gradient path (target 2.0, with the cosine of its dx and dw against
    the exact gradients, computed in float64 from the same codes)."""
    dy = rng.standard_normal((M, N)).astype(np.float32)
    with _maybe(backend):
        _, ctx = lowbit.linear_forward(xm, w, "ternary", "int8")
    qw = ctx.packed.codes().astype(np.float64) * float(ctx.packed.scale)
    qa = lowbit.quantize_activation(xm).dequantize().astype(np.float64)
    exact = (dy.astype(np.float64) @ qw.T, qa.T @ dy.astype(np.float64))

    def close(got, want, rtol):
        for name, g, r in zip(("dx", "dw"), got, want):
            err = np.abs(g - r).max() / np.abs(r).max()
            assert err < rtol, f"{name}: max error {err:.2e} of the largest value"

    yield Case(SUITE, "linear bwd numpy f32", fn=lambda: (dy @ w.T, xm.T @ dy),
               check=lambda: close((dy @ w.T, xm.T @ dy),
                                   (dy.astype(np.float64) @ w.T.astype(np.float64),
                                    xm.T.astype(np.float64) @ dy.astype(np.float64)), 1e-5),
               flops=4.0 * M * K * N, info={"shape": f"{M}x{K}x{N}"})
    info = {"shape": f"{M}x{K}x{N}", "format": "ternary/int8", "ctx B": ctx.nbytes,
            "ctx fp32 B": ctx.dense_nbytes}
    for grad_format in (None, "int8"):
        def fn(grad_format=grad_format):
            with _maybe(backend):
                return lowbit.linear_backward(dy, ctx, grad_format=grad_format)

        row = dict(info, grad=grad_format or "float32",
                   kernel=_float_kernel(backend, True) if grad_format is None else _kernel(backend))

        def check(fn=fn, grad_format=grad_format, row=row):
            _check_backward_small(backend, grad_format)
            got = fn()
            if grad_format is None:
                close(got, exact, 1e-5)
            else:  # the cosines go into the row: the int8 path is an approximation
                row["cos dx"], row["cos dw"] = (f"{_cosine(g, r):.6f}"
                                                for g, r in zip(got, exact))

        yield Case(SUITE, f"linear bwd ternary/int8 {label}"
                   + ("" if grad_format is None else " grad int8"), fn=fn, check=check,
                   baseline="linear bwd numpy f32", target=1.0 if grad_format is None else 2.0,
                   flops=4.0 * M * K * N, info=row)


def _gpu_cases(config: Config):
    import cupy as cp

    backend = config.backend or "cuda"
    K = N = 1024 if config.quick else 4096
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    w16 = cp.asarray(w, dtype=cp.float16)
    with lowbit.use_backend(backend):
        pw = lowbit.quantize_weight(cp.asarray(w), "ternary")
    src = cp.zeros(pw.data.nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    yield Case(SUITE, "gpu copy packed bytes", fn=lambda: cp.copyto(dst, src),
               nbytes=2 * src.nbytes, info={"shape": f"{src.nbytes:,} B"})
    for M in (1, 256 if config.quick else 4096):
        x = cp.asarray(rng.standard_normal((M, K)).astype(np.float32))
        x16 = x.astype(cp.float16)
        kind = "gemv" if M == 1 else "gemm"
        yield Case(SUITE, f"{kind} cupy f16", fn=lambda x16=x16: x16 @ w16,
                   flops=2.0 * M * K * N, nbytes=w16.nbytes, info={"shape": f"{M}x{K}x{N}"})

        def fn(x=x):
            with lowbit.use_backend(backend):
                return lowbit.packed_matmul(x, pw, "int8")

        def check(x=x, fn=fn):
            _check_small(cp, backend, "ternary", "int8", 1 if M == 1 else 33)
            _check_exact(cp, backend, x, pw, fn())

        yield Case(SUITE, f"{kind} ternary/int8 {backend}", fn=fn, check=check,
                   baseline=f"{kind} cupy f16", flops=2.0 * M * K * N, nbytes=pw.nbytes,
                   info={"shape": f"{M}x{K}x{N}", "weight B": pw.nbytes})
