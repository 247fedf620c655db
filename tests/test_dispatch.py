"""Dispatch: backend selection, strict forcing, error messages; lowbit/_dispatch.py."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


_GUARDED_KERNEL = """
import numba
from ._c import VALUE
from owner import OFFSET


@numba.njit(cache=True)
def f():
    return VALUE + OFFSET
"""


@pytest.mark.skipif("numba" not in lowbit.available_backends(), reason="needs numba")
@pytest.mark.parametrize("cache_dir", [False, True], ids=["in-tree", "NUMBA_CACHE_DIR"])
def test_numba_cache_guard_recompiles_kernels_after_an_edit_elsewhere(tmp_path, cache_dir):
    """A cached kernel freezes constants it imports from another file of its package and from an
    owner outside it; Numba keys the cache on the kernel's own file only, so without the guard
    the edits below would return the old constants."""
    package = tmp_path / "kern"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import os\nfrom lowbit import _backend\n"
        "_backend.numba_cache_guard(__file__, os.path.join(os.path.dirname(__file__), "
        "'..', 'owner.py'))\n")
    (package / "_k.py").write_text(_GUARDED_KERNEL)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "NUMBA_DISABLE_JIT")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(Path(lowbit.__file__).parents[1])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a .pyc keyed on a whole-second mtime could go stale
    if cache_dir:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache")
    code = ("from kern._k import f; v = f(); "
            "print(v, sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))")

    def run(value, offset):
        (package / "_c.py").write_text(f"VALUE = {value}\n")
        (tmp_path / "owner.py").write_text(f"OFFSET = {offset}\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return tuple(int(v) for v in out.stdout.split())

    assert run(1, 10) == (11, 0, 1)  # compiled and cached
    assert run(1, 10) == (11, 1, 0)  # loaded from the cache
    assert run(2, 10)[0] == 12  # an edit to a sibling file of the kernel's package
    assert run(2, 30)[0] == 32  # an edit to the owner
    assert run(2, 30) == (32, 1, 0)  # and cached again
    cache = (tmp_path / "cache") if cache_dir else package / "__pycache__"
    assert list(cache.rglob("lowbit-sources-__init__.sha256"))
