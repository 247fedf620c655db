"""Dispatch: backend selection, strict forcing, error messages; lowbit/_dispatch.py."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lowbit
from lowbit import _backend, _dispatch


def test_available_backends_lists_cpu_backends():
    names = lowbit.available_backends()
    assert names[0] == "numpy"
    assert set(names) <= set(_dispatch.BACKENDS)
    assert "numba" in names  # a default dependency


def test_automatic_choice_for_numpy_arrays():
    assert _dispatch.select_backend(np.zeros(3)) == "numba"


def test_use_backend_forces_and_restores():
    with lowbit.use_backend("numpy"):
        assert _dispatch.select_backend(np.zeros(3)) == "numpy"
        with lowbit.use_backend("numba"):
            assert _dispatch.select_backend(np.zeros(3)) == "numba"
        assert _dispatch.select_backend(np.zeros(3)) == "numpy"
    assert _dispatch.forced_backend() is None


def test_environment_variable_forces(monkeypatch):
    monkeypatch.setenv("LOWBIT_BACKEND", "numpy")
    assert _dispatch.select_backend(np.zeros(3)) == "numpy"
    with lowbit.use_backend("numba"):  # the context manager wins over the environment
        assert _dispatch.select_backend(np.zeros(3)) == "numba"


def test_environment_variable_unknown(monkeypatch):
    monkeypatch.setenv("LOWBIT_BACKEND", "tpu")
    with pytest.raises(ValueError, match="LOWBIT_BACKEND"):
        _dispatch.select_backend(np.zeros(3))


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend"):
        with lowbit.use_backend("opencl"):
            pass


def test_forced_cuda_on_numpy_arrays_is_a_type_error():
    with lowbit.use_backend("cuda"):
        with pytest.raises(TypeError, match="cuda"):
            lowbit.pack_bits(np.zeros(4, np.uint8), 2)


def test_forced_missing_backend_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(_backend, "numba_available", lambda: False)
    with lowbit.use_backend("numba"):
        with pytest.raises(lowbit.BackendUnavailableError, match="pip install numba"):
            lowbit.pack_bits(np.zeros(4, np.uint8), 2)
    # Not forced: the automatic choice falls back to NumPy.
    assert _dispatch.select_backend(np.zeros(3)) == "numpy"


def test_forced_missing_cudasim_says_how_to_get_it(monkeypatch):
    from lowbit import _cudasim

    monkeypatch.setattr(_cudasim, "available", lambda: False)
    with lowbit.use_backend("cudasim"):
        with pytest.raises(lowbit.BackendUnavailableError, match="cudasim"):
            lowbit.pack_bits(np.zeros(4, np.uint8), 2)


class _FakeDeviceArray(np.ndarray):
    """Stands in for a cupy array so that mixing can be tested without a GPU."""


def test_mixed_numpy_and_cupy_inputs_raise(monkeypatch):
    monkeypatch.setattr(_backend, "is_cupy_array", lambda x: isinstance(x, _FakeDeviceArray))
    fake = np.zeros(3).view(_FakeDeviceArray)
    with pytest.raises(TypeError, match="mix numpy and cupy"):
        _backend.array_kind(np.zeros(3), fake)


def test_import_without_numba_and_cupy():
    code = textwrap.dedent("""
        import sys
        for name in ('numba', 'cupy', 'llvmlite'):
            sys.modules[name] = None  # makes `import name` fail as if it were not installed
        import numpy as np, lowbit
        names = lowbit.available_backends()
        assert 'numba' not in names and 'cuda' not in names, names
        codes = np.arange(10, dtype=np.uint8) % 4
        assert (lowbit.unpack_bits(lowbit.pack_bits(codes, 2), 2, 10) == codes).all()
        print('ok', names)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_never_runs_catches_every_backend_call(never_runs):
    codes = np.arange(8, dtype=np.uint8) % 4
    with pytest.raises(AssertionError, match="ran before validation"):
        lowbit.pack_bits(codes, 2)
    with never_runs.paused():
        assert lowbit.pack_bits(codes, 2).shape == (2,)


def test_numba_cache_guard_restamps_the_package_when_any_source_changes(tmp_path):
    package, owner = tmp_path / "kernels", tmp_path / "owner.py"
    package.mkdir()
    files = [package / name for name in ("__init__.py", "_a.py", "_b.py")]
    for i, path in enumerate([*files, owner]):
        path.write_text(f"X = {i}\n")
        os.utime(path, ns=(10**18, 10**18 + i * 10**9))
    _backend.numba_cache_guard(str(files[0]), str(owner))
    newest = owner.stat().st_mtime_ns
    assert [p.stat().st_mtime_ns for p in files] == [newest] * 3
    # An edit to one kernel file moves every stamp of the package to it.
    os.utime(files[1], ns=(10**18, newest + 5 * 10**9))
    _backend.numba_cache_guard(str(files[0]), str(owner))
    assert [p.stat().st_mtime_ns for p in files] == [newest + 5 * 10**9] * 3
    assert owner.stat().st_mtime_ns == newest  # owners are read, never restamped
