"""Why a backend cannot run: ``lowbit.backend_status()``, and numba or cupy installed but broken
(a fake package that fails to import, in a subprocess) warning once and falling back;
lowbit/_backend.py and lowbit/_dispatch.py."""

import subprocess
import sys
import textwrap

import numpy as np

import lowbit
from lowbit import _dispatch


def test_backend_status_covers_every_backend_in_order():
    status = lowbit.backend_status()
    assert list(status) == list(_dispatch.BACKENDS)
    assert status["numpy"] is None
    assert [b for b, reason in status.items() if reason is None] == lowbit.available_backends()
    for name, reason in status.items():
        assert reason == _dispatch.backend_unavailable_reason(name)
        assert reason is None or (isinstance(reason, str) and reason)


_BROKEN = """
import sys, warnings
import numpy as np
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import lowbit
    from lowbit import _dispatch
    status = lowbit.backend_status()
    names = lowbit.available_backends()
    lowbit.backend_status()
    chosen = _dispatch.select_backend(np.zeros(3))
    codes = np.arange(10, dtype=np.uint8) % 4
    assert (lowbit.unpack_bits(lowbit.pack_bits(codes, 2), 2, 10) == codes).all()
    try:
        with lowbit.use_backend({package!r} == "numba" and "numba" or "cuda"):
            lowbit.pack_bits(codes, 2)
    except (lowbit.BackendUnavailableError, TypeError) as exc:
        forced = str(exc)
    else:
        forced = None
ours = [w for w in caught if issubclass(w.category, lowbit.BackendImportWarning)]
print("WARNINGS", len(ours))
for w in ours:
    print("WARNING", w.category.__name__, issubclass(w.category, RuntimeWarning), w.message)
print("STATUS", status[{backend!r}])
print("AVAILABLE", names)
print("CHOSEN", chosen)
print("FORCED", forced)
"""


def _run_with_broken(tmp_path, package: str, backend: str, body: str) -> dict[str, list[str]]:
    """Run ``_BROKEN`` with a fake ``package`` (``body`` its ``__init__``) first on the path."""
    fake = tmp_path / package
    fake.mkdir()
    (fake / "__init__.py").write_text(textwrap.dedent(body))
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + _BROKEN.format(
        package=package, backend=backend)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        key, _, rest = line.partition(" ")
        lines.setdefault(key, []).append(rest)
    return lines


def test_numba_failing_with_an_abi_error_warns_once_and_falls_back(tmp_path):
    got = _run_with_broken(tmp_path, "numba", "numba", """
        raise ImportError("numpy ABI mismatch: module compiled against API version 0x10")
    """)
    assert got["WARNINGS"] == ["1"], got
    warning = got["WARNING"][0]
    assert warning.startswith("BackendImportWarning True"), warning
    assert "numba is installed but failed to import" in warning
    assert "ImportError: numpy ABI mismatch: module compiled against API version 0x10" in warning
    status = got["STATUS"][0]
    assert "not installed" not in status
    assert "ImportError: numpy ABI mismatch" in status and "pip install numba" in status
    assert "'numba'" not in got["AVAILABLE"][0] and "'numpy'" in got["AVAILABLE"][0]
    assert got["CHOSEN"] == ["numpy"]
    assert "numpy ABI mismatch" in got["FORCED"][0]


def test_numba_failing_with_an_os_error_is_reported(tmp_path):
    got = _run_with_broken(tmp_path, "numba", "numba", """
        raise OSError("libllvmlite.so: cannot open shared object file")
    """)
    assert got["WARNINGS"] == ["1"], got
    assert "OSError: libllvmlite.so: cannot open shared object file" in got["WARNING"][0]
    assert "OSError: libllvmlite.so" in got["STATUS"][0]
    assert got["CHOSEN"] == ["numpy"]


def test_numba_missing_a_dependency_is_broken_not_missing(tmp_path):
    got = _run_with_broken(tmp_path, "numba", "numba", """
        import llvmlite_that_is_not_there
    """)
    assert got["WARNINGS"] == ["1"], got
    assert "ModuleNotFoundError" in got["STATUS"][0]
    assert "llvmlite_that_is_not_there" in got["STATUS"][0]
    assert "not installed" not in got["STATUS"][0]


def test_cupy_failing_to_load_cuda_is_reported(tmp_path):
    got = _run_with_broken(tmp_path, "cupy", "cuda", """
        raise OSError("libcudart.so.12: cannot open shared object file: No such file")
    """)
    assert got["WARNINGS"] == ["1"], got
    assert "cupy is installed but failed to import" in got["WARNING"][0]
    assert "OSError: libcudart.so.12" in got["STATUS"][0]
    assert "'cuda'" not in got["AVAILABLE"][0]


def test_missing_numba_says_not_installed_without_a_warning():
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules['numba'] = None  # `import numba` fails as if it were not installed
        warnings.simplefilter("error")
        import lowbit
        print(lowbit.backend_status()["numba"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("numba is not installed: install numba"), out.stdout


def test_working_numba_has_no_reason():
    assert lowbit.backend_status()["numba"] is None
    assert _dispatch.select_backend(np.zeros(2)) == "numba"
