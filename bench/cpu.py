"""Suite ``cpu``: which kernel family each numba op runs on this CPU, and the BLAS NumPy uses.

Report-only rows (nothing is timed): the CPU model and the instruction-set extensions lowbit's
kernels choose by (AVX2, FMA, AVX-512 F/BW/VNNI, AVX-VNNI, AMX), the CPU Numba compiles for
(``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` when set), NumPy's BLAS as ``threadpoolctl`` reports
it (library, version, the kernel family OpenBLAS picked: its ``architecture``) and whether
``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` are set (both put OpenBLAS on other kernels), then
one row per op with the family that runs it. ``facts()`` is the same dictionary that
``bench/_harness.metadata`` stores in every result file. The choices themselves live with the
kernels: ``lowbit/ops/packed_matmul/_numba/__init__.py`` (``USE_VNNI``, ``USE_AVX2``,
``USE_FMA``: ``_fma.AVAILABLE`` and NumPy's BLAS kernel), each op's ``USE_FMA``;
``docs/backends.rst`` describes them.
"""

from __future__ import annotations

import os

from ._harness import Case, Config

SUITE = "cpu"

#: Numba targets ``python -m bench --cpu-target`` (and ``tests/test_packed_matmul_targets.py``)
#: force: LLVM's feature list of ``-mcpu=haswell`` (x86-64-v3 with the Ivy Bridge and Haswell
#: extras: the AVX2-only laptop) with AVX-512 and AVX-VNNI explicitly off, and Alder Lake (no
#: AVX-512: Haswell's features plus the ones the integer kernels care about, AVX-VNNI among them).
_HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+crc32,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,"
            "+invpcid,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,"
            "+sse4.2,+ssse3,+xsave,+xsaveopt,-avx512f,-avx512bw,-avx512vl,-avx512vnni,-avxvnni")
TARGETS = {
    "haswell": _HASWELL,
    "alderlake": (_HASWELL.replace(",-avxvnni", "")
                  + ",+adx,+aes,+clflushopt,+clwb,+gfni,+pku,+prfchw,+rdpid,+rdseed,+sha,+vaes,"
                    "+vpclmulqdq,+xsavec,+xsaves,+avxvnni"),
}
#: /proc/cpuinfo flags a host needs to execute each target's kernels.
TARGET_NEEDS = {"haswell": ("avx2", "fma", "bmi2"), "alderlake": ("avx2", "fma", "bmi2",
                                                                   "avx_vnni")}
#: Alder Lake's kernels where the host has AVX-512 VNNI and VL but not AVX-VNNI (Cascade Lake and
#: Ice Lake servers, Zen 4): Alder Lake's features with AVX-512 F, VL and VNNI on and AVX-VNNI off
#: (BW stays off, so the GEMV stays on 256 bits), under which LLVM encodes the same 256-bit
#: ``vpdpbusd`` with EVEX (with ``+avxvnni`` as well it would pick VEX where it can). Only the
#: integer kernels are then Alder Lake's: with AVX-512 F on, the float ones (register tiles, table
#: lookups) take their 512-bit paths.
ALDERLAKE_EVEX = (TARGETS["alderlake"].replace(",+avxvnni", ",-avxvnni")
                  .replace("-avx512f,", "+avx512f,").replace("-avx512vl,", "+avx512vl,")
                  .replace("-avx512vnni,", "+avx512vnni,"))
#: /proc/cpuinfo flags a host needs for ``ALDERLAKE_EVEX``.
EVEX_NEEDS = ("avx2", "fma", "bmi2", "avx512vl", "avx512_vnni")

#: /proc/cpuinfo flags that decide a kernel.
FLAGS = ("avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
         "amx_int8", "amx_bf16")


def host_flags() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and ":" in line:
                    have = set(line.split(":", 1)[1].split())
                    return {flag: flag in have for flag in FLAGS}
    except OSError:
        pass
    return {}


def target_env(target: str, environ: dict) -> dict:
    """``environ`` with Numba compiling for ``target`` (``target_features``; its own cache folder
    beside the host's, under the temporary directory) and OpenBLAS on its Haswell kernels, as on
    that CPU."""
    import tempfile

    cache = os.path.join(tempfile.gettempdir(), f"lowbit-numba-cache-{target}")
    features = target_features(target) or TARGETS[target]
    return dict(environ, NUMBA_CPU_NAME=target, NUMBA_CPU_FEATURES=features,
                NUMBA_CACHE_DIR=cache, OPENBLAS_CORETYPE="Haswell")


def target_features(target: str) -> str | None:
    """The ``NUMBA_CPU_FEATURES`` under which this host runs ``target``'s kernels: the target's
    own where the host has its flags, ``ALDERLAKE_EVEX`` for Alder Lake on a host with AVX-512
    VNNI and VL instead of AVX-VNNI; None where it can run neither."""
    flags = host_flags()
    if all(flags.get(f) for f in TARGET_NEEDS[target]):
        return TARGETS[target]
    if target == "alderlake" and all(flags.get(f) for f in EVEX_NEEDS):
        return ALDERLAKE_EVEX
    return None


def target_refusal(target: str) -> str | None:
    """Why this host cannot execute ``target``'s kernels (None: it can)."""
    if target_features(target) is not None:
        return None
    flags = host_flags()
    missing = [f for f in TARGET_NEEDS[target] if not flags.get(f)]
    return f"this CPU lacks {', '.join(missing)}: {target}'s kernels cannot run here"


def _blas() -> list[dict]:
    """NumPy's (and any other loaded) BLAS, as threadpoolctl reports it; [] without it."""
    try:
        import threadpoolctl
    except ImportError:
        return []
    import numpy  # noqa: F401  (loads its BLAS)

    keys = ("internal_api", "version", "architecture", "num_threads", "prefix")
    return [{k: info.get(k) for k in keys} for info in threadpoolctl.threadpool_info()
            if info.get("user_api") == "blas"]


def kernels() -> dict:
    """Op -> the kernel family numba runs it with on this CPU ("-" without numba)."""
    import lowbit

    if "numba" not in lowbit.available_backends():
        return {"numba": "-"}
    from lowbit.ops.gated_delta_scan import _numba_chunked
    from lowbit.ops.lowrank_residual import _numba as lowrank
    from lowbit.ops.packed_matmul import _numba as pm
    from lowbit.ops.packed_matmul._numba import _avx2, _fma, _lut_gemv, _mkl
    from lowbit.ops.segmented_attention import _numba as attention

    integer = ("avx512-vnni" if pm.USE_VNNI else
               ("avx-vnni" if _avx2.AVX_VNNI else "avx2") if pm.USE_AVX2 else None)
    tiles = "avx512-fma tiles" if _fma.WIDE else "avx2-fma tiles"
    fma = tiles if pm.USE_FMA else "SciPy's BLAS in blocks"
    mkl = "onemkl amx" if pm.USE_MKL else None
    return {
        "packed_matmul gemv (<= 32 rows)": integer or "portable gemv",
        "packed_matmul gemm": mkl or integer or "portable float64-BLAS gemm",
        "packed_matmul float x (ternary, sign)": "table lookups",
        "packed_matmul float x, few rows": (f"table lookups in {_lut_gemv.LANES}-lane registers"
                                            if _lut_gemv.LANES else "scalar table lookups"),
        "packed_matmul dx (ternary, sign)": "table lookups",
        "packed_matmul dx (int8)": fma,
        "packed_matmul dx, int8 gradients": mkl or integer or "float64 BLAS",
        "packed_matmul dw": fma,
        "segmented_attention": tiles if attention.USE_FMA else "BLAS",
        "gated_delta_scan chunked": tiles if _numba_chunked.USE_FMA else "token by token",
        "lowrank_residual causal-linear": tiles if lowrank.USE_FMA else "BLAS",
        "amx": ("onemkl's cblas_gemm_s8u8s32" if pm.USE_MKL else
                "this cpu has amx: pip install lowbit[mkl]" if _mkl.AMX else "no amx"),
        "onemkl": "installed" if _mkl.available() else "not installed (lowbit[mkl])",
    }


def facts() -> dict:
    """The CPU's deciding flags, Numba's target, the BLAS libraries loaded now and their
    environment, the kernels (read afresh each call: a later import can load another BLAS)."""
    import numba

    env = {var: os.environ.get(var) for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                 "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    return {"flags": host_flags(), "numba_target": numba.config.CPU_NAME or "host",
            "env": env, "blas": _blas(), "kernels": kernels()}


def cases(config: Config):
    from ._harness import _cpu_model

    if config.gpu:
        return
    f = facts()
    yield Case(SUITE, "cpu", info={"model": _cpu_model(), "numba target": f["numba_target"],
                                   **{k: "yes" if v else "no" for k, v in f["flags"].items()}})
    for i, blas in enumerate(f["blas"] or [{}]):
        env = {k: v or "unset" for k, v in f["env"].items() if k.startswith("OPENBLAS")}
        yield Case(SUITE, f"BLAS {i}" if i else "BLAS", info={**blas, **env})
    for op, family in f["kernels"].items():
        yield Case(SUITE, op, info={"kernel": family})
