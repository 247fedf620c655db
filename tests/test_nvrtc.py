"""Tests of the NVRTC compile check ``lowbit/_nvrtc.py`` on the test kernels of
``tests/cuda/sim_kernels.cu`` (the same list ``tests/test_cudasim.py`` runs on the CPU).

Needs ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` (the ``test`` extra), not a GPU.
"""

from __future__ import annotations

import pytest

from lowbit import _nvrtc

from test_cudasim import INCLUDE_DIRS, NAME_EXPRESSIONS, SOURCE

pytestmark = pytest.mark.skipif(not _nvrtc.available(), reason=_nvrtc.unavailable_reason())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_test_kernels_compile_without_spills(arch):
    report = _nvrtc.compile_check(SOURCE, NAME_EXPRESSIONS, INCLUDE_DIRS, arch)
    assert set(report) == set(NAME_EXPRESSIONS)
    for name, usage in report.items():
        assert usage["registers"] > 0, (name, usage)
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (name, usage)
    # Static shared memory is reported: a padded 32 x 33 float tile.
    assert report["transpose_tiled"]["shared"] == 32 * 33 * 4


def test_compile_error_carries_the_log():
    broken = 'extern "C" __global__ void k(float* x) { x[0] = undefined_name_42; }'
    with pytest.raises(RuntimeError, match="undefined_name_42"):
        _nvrtc.compile_check(broken, ["k"], [], "sm_80")


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


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("launcher", list(_op_launchers()))
def test_every_op_kernel_compiles_without_spills(launcher, arch):
    from lowbit import _kernels

    report = _nvrtc.compile_check(_kernels.source(launcher.SOURCE), launcher.NAME_EXPRESSIONS,
                                  [str(_kernels.cuda_dir())], arch)
    assert set(report) == set(launcher.NAME_EXPRESSIONS)
    for name, usage in sorted(report.items()):
        print(f"{launcher.SOURCE} {arch} {name}: {usage['registers']} registers, "
              f"{usage['shared']} B static shared, {usage['stack']} B stack")
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (name, usage)
