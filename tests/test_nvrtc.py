"""Tests of the NVRTC compile check ``lowbit/_nvrtc.py`` on the test kernels of
``tests/cuda/sim_kernels.cu`` (the same list ``tests/test_cudasim.py`` runs on the CPU), of every
op's kernels, and of the compile options ``lowbit._kernels.NVRTC_OPTIONS`` (IEEE subnormals and
division, no contraction): in the PTX, and on subnormal inputs on every backend.

The NVRTC tests need ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` (the ``test`` extra), not a GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import lowbit
from lowbit import _kernels, _nvrtc
from lowbit.reference.saved_activation import pack_activation_ref, unpack_activation_ref

from test_cudasim import INCLUDE_DIRS, NAME_EXPRESSIONS, SOURCE

needs_nvrtc = pytest.mark.skipif(not _nvrtc.available(), reason=_nvrtc.unavailable_reason())


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_test_kernels_compile_without_spills(arch):
    report = _nvrtc.compile_check(SOURCE, NAME_EXPRESSIONS, INCLUDE_DIRS, arch)
    assert set(report) == set(NAME_EXPRESSIONS)
    for name, usage in report.items():
        assert usage["registers"] > 0, (name, usage)
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (name, usage)
    # Static shared memory is reported: a padded 32 x 33 float tile.
    assert report["transpose_tiled"]["shared"] == 32 * 33 * 4


@needs_nvrtc
def test_compile_error_carries_the_log():
    broken = 'extern "C" __global__ void k(float* x) { x[0] = undefined_name_42; }'
    with pytest.raises(RuntimeError, match="undefined_name_42"):
        _nvrtc.compile_check(broken, ["k"], [], "sm_80")


@needs_nvrtc
def test_standard_headers_are_not_available():
    # Kernels must not include standard headers: NVRTC (without a CUDA toolkit) has none.
    with pytest.raises(RuntimeError, match="cstdint"):
        _nvrtc.compile_check('#include <cstdint>\nextern "C" __global__ void k() {}', ["k"],
                             [], "sm_90")


def test_ptxas_log_parsing():
    log = "\n".join([
        "ptxas info    : 0 bytes gmem",
        "ptxas info    : Compiling entry function '_Z1kILi3EEvPfi' for 'sm_90'",
        "ptxas info    : Function properties for _Z1kILi3EEvPfi",
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads",
        "ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem",
        "ptxas info    : Compiling entry function 'f' for 'sm_90'",
        "ptxas info    : Function properties for f",
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 8 registers, used 0 barriers, 364 bytes cmem[0]",
    ])
    assert _nvrtc.parse_ptxas_log(log) == {
        "_Z1kILi3EEvPfi": {"registers": 40, "spill_stores": 8, "spill_loads": 4,
                           "shared": 1024, "stack": 16},
        "f": {"registers": 8, "spill_stores": 0, "spill_loads": 0, "shared": 0, "stack": 0},
    }


def _op_launchers():
    """Every ``lowbit/ops/<op>/_cuda.py`` with its SOURCE and NAME_EXPRESSIONS."""
    import importlib
    import pkgutil

    import lowbit.ops

    for info in sorted(pkgutil.iter_modules(lowbit.ops.__path__), key=lambda i: i.name):
        try:
            launcher = importlib.import_module(f"lowbit.ops.{info.name}._cuda")
        except ModuleNotFoundError as exc:
            if exc.name != f"lowbit.ops.{info.name}._cuda":
                raise
            continue
        yield pytest.param(launcher, id=info.name)


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("launcher", list(_op_launchers()))
def test_every_op_kernel_compiles_without_spills(launcher, arch):
    report = _nvrtc.compile_check(_kernels.source(launcher.SOURCE), launcher.NAME_EXPRESSIONS,
                                  [str(_kernels.cuda_dir())], arch)
    assert set(report) == set(launcher.NAME_EXPRESSIONS)
    for name, usage in sorted(report.items()):
        print(f"{launcher.SOURCE} {arch} {name}: {usage['registers']} registers, "
              f"{usage['shared']} B static shared, {usage['stack']} B stack")
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (name, usage)


#: PTX arithmetic that flushes subnormals to zero.
FLUSHING = re.compile(r"\b(?:add|sub|mul|fma|mad|div|sqrt|min|max|setp|cvt|neg|abs)\.\S*ftz\S*")


@needs_nvrtc
@pytest.mark.parametrize("launcher", list(_op_launchers()))
def test_every_op_kernel_keeps_subnormals_and_ieee_division(launcher):
    ptx = _nvrtc.compile_ptx(_kernels.source(launcher.SOURCE), launcher.NAME_EXPRESSIONS,
                             [str(_kernels.cuda_dir())], "sm_90")
    # libdevice's exp and double division start from ex2.approx.ftz / rcp.approx.ftz on
    # range-reduced values whatever the flag; the kernels' own arithmetic must not flush.
    assert FLUSHING.findall(ptx) == []
    assert "div.approx" not in ptx and "div.full" not in ptx and "sqrt.approx" not in ptx


@needs_nvrtc
def test_a_trailing_ftz_true_would_flush_subnormals():
    # CuPy appends -ftz=true to the options it is given, and NVRTC's last option wins: the reason
    # lowbit compiles through NVRTC itself on a GPU (lowbit/_kernels.py).
    from lowbit.ops.quantize import _cuda as launcher

    args = (_kernels.source(launcher.SOURCE), launcher.NAME_EXPRESSIONS,
            [str(_kernels.cuda_dir())], "sm_90")
    assert FLUSHING.findall(_nvrtc.compile_ptx(*args)) == []
    assert FLUSHING.findall(_nvrtc.compile_ptx(*args, options=["-ftz=true"]))
    assert "-ftz=false" in _kernels.NVRTC_OPTIONS and "-fmad=false" in _kernels.NVRTC_OPTIONS


#: float32 subnormals (the smallest normal is 1.18e-38): flushed to zero under -ftz=true.
SUBNORMALS = np.array([[1e-40, 3e-40, -2e-41, 5e-39, 0.0, 7e-45, -1e-39, 2e-40]], np.float32)


def test_subnormal_activations_pack_bitwise_like_the_reference(backend):
    # A group spanning less than the scale floor keeps only its minimum, a subnormal: exact.
    packed = lowbit.pack_activation(backend.to(SUBNORMALS), "int8", group_size=4)
    ref = pack_activation_ref(SUBNORMALS, "int8", group_size=4)
    mins = packed.mins.get() if backend.name == "cuda" else packed.mins
    np.testing.assert_array_equal(mins.view(np.uint32), ref["mins"].view(np.uint32))
    assert np.count_nonzero(ref["mins"]) == 2
    out = packed.unpack()
    out = out.get() if backend.name == "cuda" else out
    expected = unpack_activation_ref(ref, SUBNORMALS.shape, "int8", group_size=4)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_subnormal_products_survive_the_float_matmul(backend):
    # x subnormal times ternary codes and a scale near one: the products stay subnormal.
    w = np.array([[1.0, -1.0], [1.0, 1.0]], np.float32)
    x = np.array([[3e-39, 1e-39]], np.float32)
    pw = lowbit.quantize_weight(backend.to(w), "ternary")
    y = lowbit.packed_matmul(backend.to(x), pw, act_format=None)
    y = y.get() if backend.name == "cuda" else y
    expected = (x.astype(np.float64) @ np.array([[1, -1], [1, 1]])).astype(np.float32)
    np.testing.assert_array_equal(y, expected)
    assert np.all(expected != 0) and np.all(np.abs(expected) < np.finfo(np.float32).tiny)


class _CupyStyleNvrtc:
    """CuPy's NVRTC binding (``cupy_backends.cuda.libs.nvrtc``), played by cuda.bindings: the
    calls ``lowbit._kernels._compile_cubin`` makes on a GPU machine, recorded."""

    class NVRTCError(RuntimeError):
        pass

    def __init__(self):
        self.nvrtc, _ = _nvrtc._load()
        self.compiled_with = []

    def _ok(self, result):
        if result[0] != self.nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise self.NVRTCError(str(result[0]))
        return result[1:]

    def getVersion(self):
        return tuple(self._ok(self.nvrtc.nvrtcVersion()))

    def createProgram(self, src, name, headers, include_names):
        return self._ok(self.nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], []))[0]

    def addNameExpression(self, prog, name):
        self._ok(self.nvrtc.nvrtcAddNameExpression(prog, name.encode()))

    def compileProgram(self, prog, options):
        self.compiled_with.append(list(options))
        self._ok(self.nvrtc.nvrtcCompileProgram(prog, len(options),
                                                [o.encode() for o in options]))

    def getLoweredName(self, prog, name):
        return self._ok(self.nvrtc.nvrtcGetLoweredName(prog, name.encode()))[0].decode()

    def getCUBIN(self, prog):
        (size,) = self._ok(self.nvrtc.nvrtcGetCUBINSize(prog))
        buf = bytearray(size)
        self._ok(self.nvrtc.nvrtcGetCUBIN(prog, buf))
        return bytes(buf)

    def getProgramLog(self, prog):
        return _nvrtc._program_log(self.nvrtc, prog)

    def destroyProgram(self, prog):
        self._ok(self.nvrtc.nvrtcDestroyProgram(prog))


@needs_nvrtc
def test_gpu_load_compiles_with_lowbits_options_once_into_the_cache(tmp_path, monkeypatch):
    from lowbit.ops.pack_bits import _cuda as launcher

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    fake = _CupyStyleNvrtc()
    args = (fake, _kernels.source(launcher.SOURCE), launcher.NAME_EXPRESSIONS,
            _kernels.NVRTC_OPTIONS + (f"-I{_kernels.cuda_dir()}",), "sm_90")
    cubin, lowered = _kernels._compile_cubin(*args)
    # lowbit's options are the last word: nothing after them turns flushing back on.
    (options,) = fake.compiled_with
    assert options[:len(_kernels.NVRTC_OPTIONS)] == list(_kernels.NVRTC_OPTIONS)
    assert not any("ftz=true" in o for o in options)
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    assert set(lowered) == set(launcher.NAME_EXPRESSIONS)
    assert all(name.startswith("_Z") for name in lowered.values())
    again = _kernels._compile_cubin(*args)
    assert again == (cubin, lowered) and len(fake.compiled_with) == 1


# -- SASS facts: the instructions each rebuilt kernel is built around -------------------

needs_sass = pytest.mark.skipif(not _nvrtc.sass_available(),
                                reason="cuobjdump not found: pip install nvidia-cuda-cuobjdump "
                                       "nvidia-cuda-nvdisasm (the lowbit[test] extra)")

#: Per kernel family (the name before ``<``): a check of its sm_90 SASS counts, and what it says.
SASS_AIMS = {
    # One 64-k stage of the 128 x 128 tile: 8 warps of 64 x 32, 32 m16n8k32 mma, 12 ldmatrix.x4.
    "gemm_int": (lambda c, name: c["IMMA"] >= 32 and c["LDSM"] >= 12 and c["LDGSTS"] >= 4,
                 ">= 32 IMMA (16 per k32), >= 12 LDSM and cp.async (LDGSTS) per stage"),
    # One 128-bit weight load per lane (64 ternary codes), a dp4a per 4 codes for each of the 8
    # rows: 16 IDP per 32-bit weight word for ternary (32 sign, 1 int8 per row of 4 codes). The
    # static count of one body copy: 128 / 256 / 32 (the compiler may duplicate the body).
    "gemv_int": (lambda c, name: c["IDP"] >= {"0": 128, "1": 256, "2": 32}[name[-2]],
                 ">= 4 IDP per 32-bit weight word per row (ternary; sign 8, int8 1)"),
    # FlashAttention-2's structure (float: the double twins run DFMA): register-blocked score
    # products, the softmax statistics in registers; the backward has no warp reductions.
    "segmented_attention_fwd": (lambda c, name: "double" in name or c["FFMA"] >= 8 * c["SHFL"]
                                and c["FFMA"] >= 400, ">= 8 FFMA per SHFL, >= 400 FFMA"),
    "segmented_attention_bwd_dq": (lambda c, name: "double" in name or c["SHFL"] == 0
                                   and c["FFMA"] >= 400, "no SHFL, >= 400 FFMA"),
    "segmented_attention_bwd_dkdv": (lambda c, name: "double" in name or c["SHFL"] == 0
                                     and c["FFMA"] >= 400, "no SHFL, >= 400 FFMA"),
    # Scans: the state's columns split over groups of lanes; a few shuffles per token for the
    # sums over K (the per-token work is FMA on register-held state rows).
    "gated_delta_fwd": (lambda c, name: "double" in name or c["FFMA"] >= 8 * c["SHFL"],
                        ">= 8 FFMA per SHFL"),
    "gated_delta_bwd": (lambda c, name: "double" in name or c["FFMA"] >= 3 * c["SHFL"],
                        ">= 3 FFMA per SHFL"),
    "selective_fwd": (lambda c, name: "double" in name or c["FFMA"] >= 8 * c["SHFL"],
                      ">= 8 FFMA per SHFL"),
    "selective_bwd": (lambda c, name: "double" in name or c["FFMA"] >= 3 * c["SHFL"],
                      ">= 3 FFMA per SHFL"),
}


def _sass_rows(launcher, arch="sm_90"):
    code = _kernels.source(launcher.SOURCE)
    texts = _nvrtc.sass(code, launcher.NAME_EXPRESSIONS, [str(_kernels.cuda_dir())], arch)
    return {name: (_nvrtc.sass_counts(text), text) for name, text in texts.items()}


def test_sass_counts_parse_a_listing():
    text = "\n".join([
        "        /*0080*/                   IMMA.16832.S8.S8 R8, R12.ROW, R20.COL, R8 ;",
        "        /*0090*/              @!P0 LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;",
        "        /*00a0*/                   LDSM.16.M88.4 R12, [R2] ;",
        "        /*00b0*/                   FFMA R1, R2, R3, R1 ;",
        "        /*00c0*/               @P1 FFMA R1, R2, R3, R1 ;",
        "        /*00d0*/                   SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;",
        "        /*00e0*/              @!PT LDS RZ, [RZ] ;",
        "        /*00f0*/                   LDS.128 R4, [R2+0x10] ;",
    ])
    counts = _nvrtc.sass_counts(text)
    assert (counts["IMMA"], counts["LDGSTS"], counts["LDSM"], counts["FFMA"],
            counts["SHFL"], counts["LDS"], counts["LDL"]) == (1, 1, 1, 2, 1, 1, 0)


@needs_sass
@pytest.mark.parametrize("launcher", list(_op_launchers()))
def test_every_kernel_sass_has_no_local_memory_and_meets_its_aims(launcher):
    for name, (counts, text) in sorted(_sass_rows(launcher).items()):
        shown = {k: v for k, v in counts.items() if v}
        print(f"{launcher.SOURCE} sm_90 {name}: {shown}")
        assert counts["LDL"] == 0 and counts["STL"] == 0, (name, shown)
        family = name.split("<")[0]
        if family in SASS_AIMS:
            check, aim = SASS_AIMS[family]
            assert check(counts, name), f"{name}: {aim}; SASS counts {shown}"
