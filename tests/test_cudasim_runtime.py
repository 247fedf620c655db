"""Tests of cudasim's failure paths, thread start-up and build cache (its kernels against numpy
are ``tests/test_cudasim.py``, whose module of test kernels, ``tests/cuda/sim_kernels.cu``, these
tests launch too): bad arguments and launch configurations, deadlocks, barrier timeouts, traps
and device asserts, late-starting threads on a loaded machine, and the on-disk cache of built
modules (private, tamper-checked, safe under concurrent builds).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from lowbit import _cudasim, _cudasim_build

from test_cudasim import BOUNDED_S, INCLUDE_DIRS, NAME_EXPRESSIONS, ROOT, SOURCE, TESTS
from test_cudasim import test_block_reduce_shuffle_and_shared as block_reduce_check

pytestmark = pytest.mark.skipif(not _cudasim.available(), reason=_cudasim.unavailable_reason())


@pytest.fixture(scope="module")
def mod():
    return _cudasim.load_module(SOURCE, NAME_EXPRESSIONS, INCLUDE_DIRS)

# ------------------------------------------------------------------------------------------
# Failures: bad arguments, deadlocks, timeouts, traps
# ------------------------------------------------------------------------------------------

def test_argument_count_mismatch(mod):
    bins = np.full(4, -3, np.int32)
    with pytest.raises(TypeError, match="takes 4 arguments, got 3"):
        mod.get_function("histogram")(1, 32, (np.zeros(8, np.int32), bins, np.int32(8)))
    assert (bins == -3).all()


def test_argument_type_mismatch(mod):
    x = np.zeros(8, np.float32)
    y = np.full(8, 9.0, np.float32)
    kernel = mod.get_function("scale_add<2, float>")
    with pytest.raises(TypeError, match=r"argument 3: expected a 8-byte signed integer, "
                                        r"got float32"):
        kernel(1, 32, (x, y, np.float32(1), np.float32(8)))
    with pytest.raises(TypeError, match="argument 2: expected a 4-byte floating point, got int32"):
        kernel(1, 32, (x, y, np.int32(1), np.int64(8)))
    with pytest.raises(TypeError, match="Python int"):
        kernel(1, 32, (x, y, np.float32(1), 8))
    with pytest.raises(TypeError, match="got an array"):
        kernel(1, 32, (x, y, y, np.int64(8)))
    with pytest.raises(TypeError, match="pointer parameter"):
        kernel(1, 32, (x, np.float32(0), np.float32(1), np.int64(8)))
    assert (y == 9.0).all()


def test_bad_launch_configuration(mod):
    kernel = mod.get_function("histogram")
    args = (np.zeros(8, np.int32), np.zeros(4, np.int32), np.int32(8), np.int32(4))
    with pytest.raises(ValueError, match="at most 1024"):
        kernel(1, (64, 32), args)
    with pytest.raises(ValueError, match="grid dimension x"):
        kernel(0, 32, args)
    with pytest.raises(TypeError):
        kernel(1.5, 32, args)
    with pytest.raises(KeyError, match="not among"):
        mod.get_function("no_such_kernel")


@pytest.mark.parametrize("name,message", [
    ("divergent_barrier", r"divergent __syncthreads\(\).*barrier"),
    ("true_deadlock", r"deadlock.*barriers"),
])
def test_deadlock_raises_and_module_recovers(mod, rng, name, message):
    out = np.zeros(64, np.int32)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=message):
        mod.get_function(name)(2, 64, (out,))
    assert time.perf_counter() - start < BOUNDED_S
    block_reduce_check(mod, rng, 3, 96)


def test_barrier_timeout(mod, rng):
    out = np.zeros(32, np.int32)
    spin_ns = np.int64(600_000_000)  # clock64() counts nanoseconds under cudasim
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="timeout of 100 ms"):
        mod.get_function("slow_thread")(1, 32, (out, spin_ns), timeout=0.1)
    assert time.perf_counter() - start < BOUNDED_S
    block_reduce_check(mod, rng, 3, 96)


def test_slow_but_progressing_block_does_not_time_out(mod):
    # Arrivals 0.5 s apart for 2.5 s in all: the first waiter waits longer than the timeout,
    # but the block keeps moving, which is a loaded machine, not a stuck thread.
    out = np.zeros(6, np.int32)
    mod.get_function("staggered_barrier")(1, 6, (out, np.uint32(500_000_000)), timeout=2.0)
    np.testing.assert_array_equal(out, 1)


def test_default_timeout_is_generous():
    assert _cudasim.DEFAULT_TIMEOUT_S >= 60


# ------------------------------------------------------------------------------------------
# Thread start-up and hand-off on a loaded machine
# ------------------------------------------------------------------------------------------

#: Launches whose block sizes alternate small and large in one module: the workers idle in a
#: small launch are needed again in the next large one.
_LATE_START_LAUNCHES = ((1, 32), (2, 1024), (3, 64), (1, 512), (2, 256), (1, 1024))


def test_late_starting_threads_never_cause_false_deadlocks(mod, rng, monkeypatch):
    """Regression: under heavy load, shuffles reported bogus deadlocks ("all 1 running threads
    wait ... lanes 0x00004000 in __shfl_xor_sync ... waiting for lanes 0x00000000").

    A pool worker that saw a block's start signal but was descheduled before it read the
    block's thread count could act on the count of the *next* launch, run its CUDA thread
    there, and then run it a second time in the same block; the second run corrupted the
    count of running threads. The jitter knob makes every thread sleep at random when it is
    handed its block and around its exit, which opened that window within a few launches with
    the old worker loop (16 of 20 runs of this test failed, most in the first round).
    """
    monkeypatch.setenv(_cudasim.JITTER_ENV, "200")
    kernel = mod.get_function("block_reduce_sum")
    for _ in range(6):
        for blocks, threads in _LATE_START_LAUNCHES:
            x = rng.standard_normal(blocks * threads).astype(np.float32)
            partial = np.full(blocks, np.nan, np.float32)
            kernel(blocks, threads, (x, partial, np.int32(x.size)))
            expected = x.reshape(blocks, threads).astype(np.float64).sum(axis=1)
            np.testing.assert_allclose(partial, expected, rtol=1e-5, atol=1e-4)


def test_late_starting_threads_still_report_real_deadlocks(mod, monkeypatch):
    monkeypatch.setenv(_cudasim.JITTER_ENV, "200")
    out = np.zeros(64, np.int32)
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"deadlock.*barriers"):
            mod.get_function("true_deadlock")(2, 64, (out,))
        with pytest.raises(RuntimeError, match=r"divergent __syncthreads\(\)"):
            mod.get_function("divergent_barrier")(2, 64, (out,))


def test_jitter_knob_is_validated(mod, monkeypatch):
    out = np.zeros(32, np.int32)
    for bad in ("fast", "-1", str(_cudasim.MAX_JITTER_US + 1)):
        monkeypatch.setenv(_cudasim.JITTER_ENV, bad)
        with pytest.raises(ValueError, match=_cudasim.JITTER_ENV):
            mod.get_function("trap_kernel")(1, 32, (out,))


def test_trap(mod):
    with pytest.raises(RuntimeError, match=r"__trap\(\) called by thread 3"):
        mod.get_function("trap_kernel")(1, 32, (np.zeros(32, np.int32),))


def test_device_assert(mod):
    with pytest.raises(RuntimeError, match=r"assertion `threadIdx.x != 5` failed"):
        mod.get_function("assert_kernel")(1, 32, (np.zeros(32, np.int32),))


def test_name_expression_validation():
    with pytest.raises(ValueError, match="invalid kernel name expression"):
        _cudasim.load_module(SOURCE, ["k; int x"], INCLUDE_DIRS)
    with pytest.raises(TypeError):
        _cudasim.load_module(SOURCE, "block_reduce_sum", INCLUDE_DIRS)


def test_compile_error_reports_gxx_output(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="not_declared_anywhere"):
        _cudasim.load_module('extern "C" __global__ void k(int* x) { not_declared_anywhere(); }',
                             ["k"], INCLUDE_DIRS)


# ------------------------------------------------------------------------------------------
# Build cache
# ------------------------------------------------------------------------------------------

def _tiny_source() -> str:
    # A fresh comment makes a source no cache has seen.
    return textwrap.dedent(f"""\
        // cache test {uuid.uuid4().hex}
        extern "C" __global__ void add_one(int* x, int n) {{
            const int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) x[i] += 1;
        }}
        """)


def _run_tiny(module) -> None:
    x = np.arange(40, dtype=np.int32)
    module.get_function("add_one")(2, 32, (x, np.int32(40)))
    np.testing.assert_array_equal(x, np.arange(40) + 1)


def test_cache_reuses_library_rejects_tampering_and_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE_DIR", str(tmp_path / "c"))
    code = _tiny_source()
    builds = _cudasim.build_count
    first = _cudasim.load_module(code, ["add_one"], INCLUDE_DIRS)
    assert _cudasim.build_count == builds + 1
    assert _cudasim.load_module(code, ["add_one"], INCLUDE_DIRS) is first
    directory = tmp_path / "c" / "cudasim"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (lib,) = directory.glob("*.so")
    assert lib.with_suffix(".sha256").read_text().strip() == _cudasim._file_sha256(lib)

    # From the disk cache: no compiler run.
    _cudasim._clear_loaded_modules()
    again = _cudasim.load_module(code, ["add_one"], INCLUDE_DIRS)
    assert again is not first
    assert _cudasim.build_count == builds + 1, "a cached library must not be rebuilt"
    _run_tiny(again)

    # A library whose bytes no longer match the recorded digest is rebuilt, not loaded.
    # Replace the file rather than write into it: this process has the original mapped.
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    planted = directory / "planted"
    planted.write_bytes(bytes(data))
    os.replace(planted, lib)
    _cudasim._clear_loaded_modules()
    rebuilt = _cudasim.load_module(code, ["add_one"], INCLUDE_DIRS)
    assert _cudasim.build_count == builds + 2, "a tampered library must be rebuilt"
    assert lib.read_bytes() != bytes(data)
    _run_tiny(rebuilt)


def test_cache_key_covers_the_header_and_each_of_its_parts(tmp_path, monkeypatch):
    """An edit to the emulation header or to any part it includes changes the cache key, also
    when the header's folder is not among the include dirs (test kernels outside cuda/)."""
    copy = tmp_path / "cuda"
    copy.mkdir()
    for header in (ROOT / "cuda").glob("cudasim*.cuh"):
        shutil.copy(header, copy)
    entry = copy / _cudasim_build.HEADER_NAME
    parts = sorted(copy.glob(_cudasim_build.HEADER_PARTS))
    included = re.findall(r'^#include "([^"]+)"', entry.read_text(), flags=re.M)
    assert sorted(included) == [p.name for p in parts] and parts, "the key must see every part"
    monkeypatch.setattr(_cudasim_build, "_find_header", lambda include_dirs: entry)
    include_dirs = [str(TESTS / "cuda")]
    base = _cudasim_build.prepare(SOURCE, include_dirs)
    assert ("-include", str(entry)) in zip(base.flags, base.flags[1:])
    keys = {base.key}
    edited = (entry, *parts)
    for path in edited:
        original = path.read_bytes()
        path.write_bytes(original + b"// edited\n")
        keys.add(_cudasim_build.prepare(SOURCE, include_dirs).key)
        path.write_bytes(original)
    assert len(keys) == 1 + len(edited)
    assert _cudasim_build.prepare(SOURCE, include_dirs).key == base.key


def test_insecure_cache_dir_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE_DIR", str(tmp_path))
    shared = tmp_path / "cudasim"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        fallback = _cudasim.cache_dir()
    assert fallback != shared
    assert _cudasim._insecure_reason(fallback) is None
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700


def test_cache_dir_must_not_be_a_symlink(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE_DIR", str(tmp_path))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "cudasim").symlink_to(target)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        assert _cudasim.cache_dir() != tmp_path / "cudasim"


_CHILD = """
import sys
import numpy as np
from lowbit import _cudasim
code = open(sys.argv[1]).read()
mod = _cudasim.load_module(code, ["add_one"], sys.argv[2:])
x = np.arange(40, dtype=np.int32)
mod.get_function("add_one")(2, 32, (x, np.int32(40)))
assert (x == np.arange(40) + 1).all()
print("ok", _cudasim.build_count)
"""


def test_concurrent_builds_in_two_processes(tmp_path):
    source = tmp_path / "tiny.cu"
    source.write_text(_tiny_source())
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, LOWBIT_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(script), str(source), *INCLUDE_DIRS],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert out.startswith("ok")
    (lib,) = (tmp_path / "cache" / "cudasim").glob("*.so")
    assert lib.with_suffix(".sha256").read_text().strip() == _cudasim._file_sha256(lib)
