"""The numba packed matmul's kernels on CPU targets other than the host's.

Kernels: ``lowbit/ops/packed_matmul/_numba/_avx2.py`` and ``_avx2_gemm.py`` (AVX2 and AVX-VNNI,
256-bit: GEMV, GEMM and the dx of int8 gradients), the portable ``_gemv.py`` / ``_gemm_f64.py``;
selection in ``_numba/__init__.py``; reference ``reference/packed_matmul.py``. Numba compiles
for the CPU named by ``NUMBA_CPU_NAME`` with the LLVM features of ``NUMBA_CPU_FEATURES``, and
the kernel modules choose their variants from that list, so a subprocess with those set (and its
own ``NUMBA_CACHE_DIR``) builds and runs the AVX2 kernels on any x86-64 CPU that can execute
them, whatever the host would pick. Each run checks every weight format bit for bit against the
reference on shapes around the kernels' blocks (K not a multiple of a block, odd N, 1 to 100
rows: GEMV and GEMM), the dx of int8 gradients (``matmul_dx_int``) on the same shapes, plus
codes at the edges of the int16 bounds (activation and gradient code -128, every stored field
at its largest), and asserts which kernel ran; the SIMD GEMVs also run on weights followed by
an unreadable page (they read a row's last block whole, on into the next row). AVX-VNNI code is
compiled for Alder Lake and its assembly checked for the VEX-encoded ``vpdpbusd``; it runs where
the host CPU has AVX-VNNI, and elsewhere, where the host has AVX-512 VNNI and VL, the same
kernels run compiled with ``vpdpbusd`` in its EVEX encoding (the same operation on the same
registers: LLVM picks the encoding from the features). The float32 register tiles of ``_fma.py``
(the exact backward's, attention's and the low-rank residual's products), ``_f32_gemv.py`` and
the table-lookup products of ``_lut.py`` compiled for Haswell must give the host's bits.
"""

import os
import subprocess
import sys

from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from bench import cpu  # noqa: E402  (the forced targets ``python -m bench`` offers)
from lowbit.reference.packed_matmul import packed_matmul_ref  # noqa: E402
from lowbit.reference.quantize import (quantize_activation_ref, quantize_weight_ref,  # noqa: E402
                                       unpack_weight_ref)

HASWELL, ALDERLAKE = cpu.TARGETS["haswell"], cpu.TARGETS["alderlake"]

FORMATS = ("ternary", "sign", "int8")
# (M, K, N): GEMV rows 1 and 3 (one 4-row group and a remainder), 32 (the GEMV's largest),
# GEMM 33 and 100 (6-row tiles and a remainder; partial 16- and 64-column panels); K around the
# GEMV blocks (32 to 128 packed bytes), the GEMM's four-K words and its int16 runs of 42 words;
# 1 x 3000 (750 ternary bytes: 23 blocks of 32, the AVX2 one-row kernel's spans of 5 and rest).
SHAPES = [(1, 1, 3), (1, 515, 7), (1, 3000, 5), (3, 301, 5), (32, 1031, 9), (33, 37, 1),
          (100, 677, 70)]


def _ref(x, data, scale, format, K):
    """``packed_matmul_ref``'s formula vectorized: exact integer products (int64) of the
    reference codes, then ``float32(acc) * scale_x * scale_w`` in float32 in that order."""
    cx, sx = quantize_activation_ref(x, "int8")
    return _scaled(cx.astype(np.int64) @ unpack_weight_ref(data, format, K), sx, scale)


def _scaled(acc, sx, scale):
    sw = np.broadcast_to(np.asarray(scale, dtype=np.float32).reshape(-1), (acc.shape[1],))
    return (acc.astype(np.float32) * sx.astype(np.float32)[:, None]) * sw


def _run_checks(expect):
    """Every format and shape through ``_numba.matmul_int`` against the reference, asserting
    that the kernel family ``expect`` ("avx2", "avxvnni" or "portable") ran for every call."""
    from lowbit.ops.packed_matmul import _numba
    from lowbit.ops.packed_matmul._numba import _avx2, _avx2_gemm

    if expect == "portable":
        _numba.USE_VNNI = _numba.USE_AVX2 = False
    else:
        assert not _numba.USE_VNNI and _numba.USE_AVX2, "the AVX2 kernels are not selected"
        assert _avx2.AVX_VNNI == (expect == "avxvnni"), "wrong 256-bit variant"
    calls = []
    for module, name in ((_avx2, "gemv"), (_avx2_gemm, "gemm"), (_avx2_gemm, "gemm_dx")):
        def spy(*args, _f=getattr(module, name), _name=name):
            calls.append(_name)
            return _f(*args)
        setattr(module, name, spy)
    rng = np.random.default_rng(5)
    for format in FORMATS:
        for M, K, N in SHAPES:
            x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
            data, scale = quantize_weight_ref(rng.standard_normal((K, N)), format)
            ref = _ref(x, data, scale, format, K)
            if M * K * N < 20000:  # the loop reference itself on the small shapes
                np.testing.assert_array_equal(ref, packed_matmul_ref(x, data, scale, format, K))
            cx, sx = quantize_activation_ref(x, "int8")
            y = _numba.matmul_int(cx, sx, data, scale, format, K)
            np.testing.assert_array_equal(y, ref, err_msg=f"{format} {M}x{K}x{N}")
            # dx of int8 gradients: [M, N] codes against the weight read across its rows
            cg, sg = quantize_activation_ref(rng.standard_normal((M, N)) * 3, "int8")
            s = np.float32(0.375)
            dx = _numba.matmul_dx_int(cg, sg, data, s, format, K)
            acc = cg.astype(np.int64) @ unpack_weight_ref(data, format, K).T
            np.testing.assert_array_equal(dx, _scaled(acc, sg, s), err_msg=f"dx {format} "
                                          f"{M}x{K}x{N}")
        # the int16 bounds: code -128 everywhere and every stored field at its largest
        # (ternary 3, sign 1, int8 -128), rows of both GEMV and GEMM; the portable GEMM's
        # float64 plan assumes the quantizers' ranges (codes -127 .. 127, ternary stored 2)
        low = -127 if expect == "portable" else -128
        top = 0xAA if expect == "portable" and format == "ternary" else 0xFF
        for M, K, N in [(2, 1031, 3), (38, 2053, 17)]:
            cx = np.full((M, K), low, np.int8)
            cx[1] = 127
            nbytes = K if format == "int8" else -(-K * {"ternary": 2, "sign": 1}[format] // 8)
            data = np.full((N, nbytes), (low & 0xFF) if format == "int8" else top, np.uint8)
            if format == "int8":
                data = data.view(np.int8)
            sx = np.full(M, 0.5, np.float32)
            scale = np.float32(0.25) if format != "int8" else np.full(N, 0.25, np.float32)
            codes_w = unpack_weight_ref(data, format, K)
            acc = cx.astype(np.int64) @ codes_w
            y = _numba.matmul_int(cx, sx, data, scale, format, K)
            np.testing.assert_array_equal(y, _scaled(acc, sx, scale),
                                          err_msg=f"{format} extreme {M}x{K}x{N}")
            cg = np.full((M, N), low, np.int8)
            cg[0] = 127
            dx = _numba.matmul_dx_int(cg, sx, data, np.float32(0.25), format, K)
            np.testing.assert_array_equal(dx, _scaled(cg.astype(np.int64) @ codes_w.T, sx,
                                                      np.float32(0.25)),
                                          err_msg=f"dx {format} extreme {M}x{K}x{N}")
    if expect == "portable":
        assert not calls, calls
    else:
        assert {"gemv", "gemm", "gemm_dx"} <= set(calls), calls


def _guarded(data):
    """A copy of ``data`` ending where an unreadable page begins: a kernel that reads past the
    array faults."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    pages = -(-data.nbytes // page) + 1
    buf = mmap.mmap(-1, pages * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    guard = ctypes.c_void_p(base + (pages - 1) * page)
    assert libc.mprotect(guard, ctypes.c_size_t(page), 0) == 0, ctypes.get_errno()  # PROT_NONE
    out = np.frombuffer(buf, np.uint8, count=data.nbytes, offset=(pages - 1) * page - data.nbytes)
    out = out.view(data.dtype).reshape(data.shape)
    out[...] = data
    return out


def _guard_checks():
    """The GEMV (one row, and a 4-row group with a remainder) on weights that end at an
    unreadable page: rows that end inside a block (read on into the next row, the last ones
    not), and rows shorter than a block."""
    from lowbit.ops.packed_matmul import _numba

    rng = np.random.default_rng(6)
    # packed rows of 656 bytes (a 16-byte tail after 32-, 64- and 128-byte blocks) and 5 bytes
    for format, K in [("ternary", 2624), ("ternary", 20), ("sign", 5248), ("sign", 40),
                      ("int8", 656), ("int8", 5)]:
        for M, N in [(1, 37), (5, 3)]:
            x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
            data, scale = quantize_weight_ref(rng.standard_normal((K, N)), format)
            cx, sx = quantize_activation_ref(x, "int8")
            y = _numba.matmul_int(cx, sx, _guarded(data), scale, format, K)
            np.testing.assert_array_equal(y, _ref(x, data, scale, format, K),
                                          err_msg=f"guarded {format} {M}x{K}x{N}")
            if format == "int8":  # float activations (``_f32_gemv`` where it runs)
                y = _numba.matmul_float(x, _guarded(data), scale, format, K)
                np.testing.assert_array_equal(y, _numba.matmul_float(x, data, scale, format, K),
                                              err_msg=f"guarded float {M}x{K}x{N}")


def _subprocess(tmp_path, cpu, features, code):
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features,
               NUMBA_CACHE_DIR=str(tmp_path / "numba"), NUMBA_DISABLE_JIT="0")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(sys.platform == "win32", reason="mprotect")
def test_gemv_reads_nothing_past_the_weight(tmp_path):
    """This host's GEMV on weights followed by an unreadable page, in a subprocess (a read past
    them faults); the Haswell run below checks the 256-bit GEMV so."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                                       os.environ.get("PYTHONPATH", "")]))
    code = "import test_packed_matmul_targets as t; t._guard_checks(); print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}: {proc.stdout}{proc.stderr}")


def test_host_kernels_match_reference():
    """This host's own choice (AVX2 here, also where AVX-512 VNNI would be preferred) and the
    portable kernels, in this process."""
    from lowbit.ops.packed_matmul import _numba
    from lowbit.ops.packed_matmul._numba import _avx2, _avx2_gemm

    saved = _numba.USE_VNNI, _numba.USE_AVX2, _avx2.gemv, _avx2_gemm.gemm, _avx2_gemm.gemm_dx
    try:
        if _avx2.AVAILABLE:
            _numba.USE_VNNI = False
            _run_checks("avxvnni" if _avx2.AVX_VNNI else "avx2")
        _avx2.gemv, _avx2_gemm.gemm, _avx2_gemm.gemm_dx = saved[2:]
        _run_checks("portable")
    finally:
        (_numba.USE_VNNI, _numba.USE_AVX2, _avx2.gemv, _avx2_gemm.gemm,
         _avx2_gemm.gemm_dx) = saved


@pytest.mark.skipif(cpu.target_refusal("haswell") is not None,
                    reason="this CPU cannot execute code compiled for Haswell")
def test_haswell_target_matches_reference(tmp_path):
    """The AVX2 kernels compiled for Haswell (no AVX-512, no AVX-VNNI), run and checked."""
    out = _subprocess(tmp_path, "haswell", HASWELL,
                      "import test_packed_matmul_targets as t; t._run_checks('avx2'); "
                      "t._guard_checks(); print('ok')")
    assert out.strip().endswith("ok")


def _tile_digest():
    """SHA-256 of ``_f32_gemv``'s results and of the float32 register tiles' (``_fma.panel_block``,
    which every kernel built on the tiles calls: 1 to 13 rows, A read along its rows and down its
    columns, from zero and accumulated, a short and a long reduction) with which tiles ran: every
    output is the same fused multiply-adds in the same order on 512-bit and 256-bit vectors, so
    the digests of two targets must be equal."""
    import hashlib

    from lowbit.ops.packed_matmul._numba import _fma

    from lowbit.ops.packed_matmul._numba import _f32_gemv

    assert _fma.AVAILABLE and _f32_gemv.AVAILABLE, "no float32 tiles on this target"
    rng = np.random.default_rng(11)
    h = hashlib.sha256()
    # few rows of float activations, int8 weights
    for M, K, N in [(1, 37, 3), (5, 333, 7), (6, 4160, 9)]:
        data, scale = quantize_weight_ref(rng.standard_normal((K, N)), "int8")
        x = rng.standard_normal((M, K)).astype(np.float32)
        h.update(_f32_gemv.gemv(x, data, scale, np.empty((M, N), np.float32)).tobytes())
    for rows, count in [(1, 1), (5, 70), (6, 256), (13, 301)]:
        a = rng.standard_normal((rows, count)).astype(np.float32)
        at = np.ascontiguousarray(a.T)
        panel = rng.standard_normal((count, _fma.PANEL)).astype(np.float32)
        for load in (False, True):
            c = rng.standard_normal((rows + 2, _fma.PANEL + 8)).astype(np.float32)
            _fma.panel_block(a, rows, count, 1, 0, panel, count, c, 8, load)
            _fma.panel_block(at, rows, 1, rows, 0, panel, count, c, 0, True)
            h.update(c.tobytes())
    return f"{'wide' if _fma.WIDE else 'avx2'} {h.hexdigest()}"


def _lut_digest():
    """The lanes of ``_lut_gemv``'s lookups and the SHA-256 of the table-lookup products' results
    (``_lut.py``: the forward and dx of ternary and sign weights, row tiles with a remainder,
    tables across blocks; ``_lut_gemv.py``: the forward of one to five rows, its rows' words
    gathered, and transposed in blocks): the same float32 adds in the same order on 16-lane (zmm)
    and 8-lane (ymm) vectors."""
    import hashlib

    from lowbit.ops.packed_matmul import _numba
    from lowbit.ops.packed_matmul._numba import _lut_gemv
    from lowbit.reference.quantize import quantize_weight_ref

    rng = np.random.default_rng(12)
    h = hashlib.sha256()
    for format in ("ternary", "sign"):
        for M, K, N in [(5, 70, 53), (21, 130, 9), (1, 70, 53), (3, 333, 70)]:
            data, scale = quantize_weight_ref(rng.standard_normal((K, N)), format)
            x = rng.standard_normal((M, K)).astype(np.float32)
            dy = rng.standard_normal((M, N)).astype(np.float32)
            h.update(_numba.matmul_float(x, data, scale, format, K).tobytes())
            h.update(_numba.matmul_dx(dy, data, np.float32(scale), format, K).tobytes())
    return f"{_lut_gemv.LANES} {h.hexdigest()}"


@pytest.mark.skipif(cpu.target_refusal("haswell") is not None,
                    reason="this CPU cannot execute code compiled for Haswell")
def test_haswell_float_tiles_equal_host(tmp_path):
    """The float32 tiles compiled for Haswell (256-bit, four passes of 16 columns a panel) give
    the host's tiles' bits (512-bit where it has AVX-512: the comparison that matters); so do
    the table-lookup products."""
    out = _subprocess(tmp_path, "haswell", HASWELL,
                      "import test_packed_matmul_targets as t; print(t._tile_digest()); "
                      "print(t._lut_digest())")
    tiles, tables = out.strip().splitlines()[-2:]
    assert tiles.startswith("avx2 ") and tables.startswith("8 ")
    assert tiles.split()[1] == _tile_digest().split()[1]
    assert tables.split()[1] == _lut_digest().split()[1]


def _asm_check(vex):
    """Compiles the AVX-VNNI kernels (GEMV, GEMM, dx of int8 weights) and checks their assembly:
    with ``vex``, each holds ``{vex} vpdpbusd`` on ymm registers and no zmm register; without,
    the GEMV's ``vpdpbusd`` are on ymm and none is VEX-encoded."""
    from numba import types

    from lowbit.ops.packed_matmul import _numba
    from lowbit.ops.packed_matmul._numba import _avx2, _avx2_gemm

    assert _numba.USE_AVX2 and _avx2.AVX_VNNI and not _numba.USE_VNNI

    def A(dt, nd):
        return types.Array(dt, nd, "C")

    f32, i64 = types.float32, types.int64
    kernels = [
        (_avx2._gemv_kernel, (A(types.int8, 3), A(types.uint8, 2), i64, i64, i64, i64,
                              A(types.int32, 1), A(f32, 1), A(f32, 1), A(f32, 2))),
        (_avx2_gemm._gemm_kernel, (A(types.int8, 2), A(types.int8, 2), i64, i64,
                                   A(types.int32, 1), A(f32, 1), A(f32, 1), A(f32, 2))),
        (_avx2_gemm._gemm_dx_kernel, (A(types.int8, 2), A(types.int8, 2), i64, i64,
                                      A(types.int32, 1), A(f32, 1), A(f32, 1), i64, A(f32, 2))),
    ]
    for kernel, sig in kernels if vex else kernels[:1]:
        kernel.compile(sig)
        asm = kernel.inspect_asm(sig)
        lines = [line for line in asm.splitlines() if "vpdpbusd" in line]
        assert lines and all(("{vex}" in line) == vex and "%ymm" in line
                             for line in lines), lines[:4]
        if vex:
            assert "%zmm" not in asm


@pytest.mark.skipif(not cpu.host_flags().get("avx2"),
                    reason="no x86-64 AVX2 host to compile on")
def test_alderlake_target_compiles_to_vex_vpdpbusd(tmp_path):
    """The AVX-VNNI kernels compiled for Alder Lake: the GEMV, GEMM and dx (int8 weights) assembly
    holds ``{vex} vpdpbusd`` on ymm registers and no zmm register (compiled, not run)."""
    assert _subprocess(tmp_path, "alderlake", ALDERLAKE,
                       "import test_packed_matmul_targets as t; t._asm_check(True); "
                       "print('ok')").strip().endswith("ok")


@pytest.mark.skipif(cpu.target_features("alderlake") is None,
                    reason="this CPU has neither AVX-VNNI nor AVX-512 VNNI with VL: the Alder "
                           "Lake kernels are compiled and their assembly checked, not run")
def test_alderlake_target_matches_reference(tmp_path):
    """The AVX-VNNI kernels run and checked (every format and shape, the int16 bounds, weights
    before an unreadable page), VEX-encoded where the host has AVX-VNNI, else EVEX-encoded (the
    GEMV's assembly checked for it: the same kernels, not the 512-bit ones)."""
    features = cpu.target_features("alderlake")  # Alder Lake's, or cpu.ALDERLAKE_EVEX
    check = "t._asm_check(False); " if features == cpu.ALDERLAKE_EVEX else ""
    out = _subprocess(tmp_path, "alderlake", features,
                      "import test_packed_matmul_targets as t; " + check
                      + "t._run_checks('avxvnni'); t._guard_checks(); print('ok')")
    assert out.strip().endswith("ok")
