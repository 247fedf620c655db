"""Optional imports (cupy, numba) and array-kind detection.

Used by ``lowbit/_dispatch.py``; nothing here imports cupy or numba eagerly at module import
beyond a guarded try, so ``import lowbit`` works with neither installed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import numpy as np
from numpy.typing import DTypeLike


class BackendImportWarning(RuntimeWarning):
    """An optional backend package (numba, cupy) is installed but failed to import.

    Issued once per package and process, naming the real exception; lowbit then runs without
    that backend (numba: the numpy backend; cupy: no cuda backend), and
    ``lowbit.backend_status()`` gives the same reason.
    """


@functools.lru_cache(maxsize=None)
def _import_optional(name: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)``, or ``(None, why not)`` when ``name`` is missing or fails to import.

    "Missing" is only a ``ModuleNotFoundError`` for ``name`` itself. Any other failure (a NumPy
    ABI mismatch, a missing CUDA library, a broken dependency) is an installed but unusable
    package: a ``BackendImportWarning`` says so once, and the reason carries the exception.
    A broken install must not break ``import lowbit``, hence the broad ``except``.
    """
    try:
        if importlib.util.find_spec(name) is None:
            return None, f"{name} is not installed"
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None, f"{name} is not installed"
        error: BaseException = exc
    except Exception as exc:  # noqa: BLE001 - see the docstring
        error = exc
    else:
        return module, None
    reason = (f"{name} is installed but failed to import "
              f"({type(error).__name__}: {error})")
    warnings.warn(f"lowbit: {reason}; running without the {name} backend",
                  BackendImportWarning, stacklevel=2)
    return None, reason


def cupy_module() -> Any:
    """Return the cupy module, or None when it is not installed or unusable."""
    return _import_optional("cupy")[0]


def cupy_unavailable_reason() -> str | None:
    """None when cupy imports, else why not (not installed, or the import's exception)."""
    return _import_optional("cupy")[1]


@functools.lru_cache(maxsize=None)
def cuda_device_count() -> int:
    """The number of CUDA devices cupy sees (0 without cupy or a driver)."""
    cp = cupy_module()
    if cp is None:
        return 0
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def numba_available() -> bool:
    """Whether numba imports (a broken install warns once; see ``BackendImportWarning``)."""
    return _import_optional("numba")[0] is not None


def numba_unavailable_reason() -> str | None:
    """None when numba imports, else why not (not installed, or the import's exception)."""
    return _import_optional("numba")[1]


def is_cupy_array(x: object) -> bool:
    """Whether ``x`` is a cupy array (False without cupy)."""
    cp = cupy_module()
    return cp is not None and isinstance(x, cp.ndarray)


def array_kind(*arrays: object) -> str | None:
    """Return "numpy", "cupy" or None (no arrays) for the given inputs.

    Raises:
        TypeError: numpy and cupy arrays are mixed (data is never moved implicitly).
    """
    if all(type(a) is np.ndarray for a in arrays):  # the common case, without a cupy lookup
        return "numpy" if arrays else None
    kinds: set[str] = set()
    for a in arrays:
        if a is None:
            continue
        if is_cupy_array(a):
            kinds.add("cupy")
        elif isinstance(a, np.ndarray):
            kinds.add("numpy")
    if len(kinds) > 1:
        raise TypeError(
            "inputs mix numpy and cupy arrays; lowbit never moves data between host and device: "
            "convert them first (cupy.asarray / cupy.asnumpy)"
        )
    return kinds.pop() if kinds else None


def array_module(*arrays: object) -> Any:
    """numpy or cupy, following the kind of the given arrays (numpy when none)."""
    return cupy_module() if array_kind(*arrays) == "cupy" else np


# Tests set this (tests/conftest.py) so that every output a backend allocates starts as NaN (or
# all-ones bits for integers): an element a kernel forgets to write then fails the comparison.
_poison_outputs = False


def set_poison_outputs(flag: bool) -> bool:
    """Turn NaN-poisoning of freshly allocated outputs on or off; returns the previous value."""
    global _poison_outputs
    previous, _poison_outputs = _poison_outputs, bool(flag)
    return previous


def empty(shape: int | tuple[int, ...], dtype: DTypeLike, xp: Any = np) -> Any:
    """Allocate an output array on ``xp`` (numpy or cupy); every backend allocates through here."""
    out = xp.empty(shape, dtype=dtype)
    if _poison_outputs and out.size:
        kind = np.dtype(dtype).kind
        if kind in "fc":
            out.fill(np.nan)
        elif kind in "iub":
            out.view(np.uint8 if kind == "b" else out.dtype).fill(
                True if kind == "b" else np.iinfo(out.dtype).max if kind == "u" else -1
            )
    return out


def numba_cache_guard(package_file: str, *owners: str) -> None:
    """Make Numba's on-disk cache see edits to every file a kernel package depends on.

    Numba (``cache=True``) keys each cached kernel on its own source file only (its mtime and
    size in older Numba, a hash of its contents in newer ones such as 0.68), and freezes into the
    cached code the globals and inlined helpers it reads from other files: an edit there, or an
    upgrade that changes only those files, would leave the kernel stale. Called at the top of a
    kernel package's ``__init__`` (or of a kernel module, for the files beside it), before its
    kernels are imported, this keeps a SHA-256 of the contents of every ``.py`` file of that
    folder and of the ``owners`` (the modules whose constants the kernels import) in the folder's
    Numba cache directory, the one Numba picks for those files (``NUMBA_CACHE_DIR``, else
    ``__pycache__`` where writable, else the user-wide cache); where it is missing or differs,
    the folder's cached kernels (``*.nbi``, ``*.nbc``) are deleted first and the digest written
    (to a temporary file, then renamed). Unchanged sources cost a read and a hash of them.

    Args:
        package_file: ``__file__`` of the package's ``__init__.py`` or of the kernel module.
        owners: paths of further source files the kernels depend on.
    """
    import hashlib

    source = Path(package_file).resolve()
    cache = _numba_cache_dir(source)
    if cache is None:
        return
    digest = hashlib.sha256()
    for path in [*sorted(source.parent.glob("*.py")), *(Path(p).resolve() for p in owners)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    stamp = cache / f"lowbit-sources-{source.stem}.sha256"
    try:
        if stamp.read_text() == digest.hexdigest():
            return
    except OSError:
        pass
    try:
        for old in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            old.unlink(missing_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
        tmp.write_text(digest.hexdigest())
        os.replace(tmp, stamp)
    except OSError:  # another process may be clearing it too; Numba recompiles what is gone
        pass


def _numba_cache_dir(source: Path) -> Path | None:
    """The folder Numba caches the kernels of ``source`` in (by its own locators, in its order),
    or None where it caches nowhere (or JIT is off)."""
    import numba
    from numba.core import caching

    if getattr(numba.config, "DISABLE_JIT", False):
        return None

    def probe():
        pass

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    for locator_class in getattr(impl, "_locator_classes", ()):
        try:
            locator = locator_class.from_function(probe, str(source))
        except Exception:  # a locator that cannot serve a plain source file
            continue
        if locator is not None:
            return Path(locator.get_cache_path())
    return None


def _openblas_functions(name: str) -> list[tuple[str, Any]]:
    """(path, function ``name``) of every OpenBLAS loaded in this process that exports it under
    one of its builds' prefixes and suffixes (SciPy's and NumPy's wheels: ``scipy_``, ``64_``),
    in path order; none where there is no ``/proc/self/maps`` (Linux only)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return []
    found = []
    for path in sorted(p for p in paths if os.path.isfile(p)):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in (f"{prefix}{name}{suffix}" for prefix in ("scipy_", "")
                       for suffix in ("", "64_")):
            function = getattr(lib, symbol, None)
            if function is not None:
                found.append((path, function))
                break
    return found


@functools.lru_cache(maxsize=None)
def _blas_thread_controls() -> tuple[tuple[Callable[[], int], Callable[[int], None]], ...]:
    """(get, set) ctypes pairs of every OpenBLAS loaded in this process (Linux; else none)."""
    setters = dict(_openblas_functions("openblas_set_num_threads"))
    controls: list[tuple[Callable[[], int], Callable[[int], None]]] = []
    for path, getter in _openblas_functions("openblas_get_num_threads"):
        if path in setters:
            getter.restype = ctypes.c_int
            setters[path].argtypes = (ctypes.c_int,)
            controls.append((getter, setters[path]))
    return tuple(controls)


@functools.lru_cache(maxsize=None)
def numpy_blas_kernel() -> str | None:
    """The kernel family NumPy's BLAS runs on this CPU: OpenBLAS's core name as it reports it
    (``openblas_get_corename``: "Haswell", "SkylakeX", "Zen", ...; what ``threadpoolctl``
    reports as its architecture, ``OPENBLAS_CORETYPE`` included), "mkl" for oneMKL, None where
    it cannot be told (another BLAS, or no ``/proc/self/maps``)."""
    try:
        name = str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]).lower()
    except Exception:  # NumPy before 1.25, or a build without that record
        return None
    if "mkl" in name:
        return "mkl"
    if "openblas" not in name:
        return None
    home = os.path.dirname(os.path.dirname(np.__file__))
    # NumPy's own copy (numpy.libs/ of a wheel) before any other OpenBLAS of the process
    for _, get in sorted(_openblas_functions("openblas_get_corename"),
                         key=lambda found: "numpy" not in found[0][len(home):]):
        get.restype = ctypes.c_char_p
        core = get()
        return core.decode() if core else None
    return None


def read_only(*arrays: np.ndarray) -> Any:
    """Read-only views of host arrays, for the Numba kernels that only read them.

    Numba compiles one specialization per argument type, and types a read-only array apart from
    a writable one: a user's read-only input (a read-only memory map, an array a test froze)
    would compile every kernel a second time (81 s of the suite's cold compiles). Handing the
    kernels read-only views of their inputs, always, keeps one specialization; Numba then also
    refuses to compile a kernel that writes one. Returns one view, or a list for several.
    """
    views: list[np.ndarray] = []
    for a in arrays:
        view = a.view()
        view.flags.writeable = False
        views.append(view)
    return views[0] if len(views) == 1 else views


#: Guards the nesting count and OpenBLAS's saved thread counts of ``single_threaded_blas``.
_blas_lock = threading.Lock()
#: Blocks of ``single_threaded_blas`` open now, in every thread.
_blas_depth = 0
#: The thread counts the first entrant found (restored by the last one to leave).
_blas_saved: list[int] = []


@contextlib.contextmanager
def single_threaded_blas(active: bool = True) -> Iterator[None]:
    """Run OpenBLAS (NumPy's and SciPy's, the one ``np.dot`` calls from Numba) on one thread
    inside the block, process-wide, and restore the previous counts after it.

    For code whose Numba parallel regions already occupy every core and whose BLAS calls come
    between them: OpenBLAS's worker threads keep spinning after a call and take the cores from
    Numba's (measured on 2 cores: a BDH training step 1.32 s with two BLAS threads, 0.17 s with
    one). ``active=False`` makes it a no-op (for callers on other backends).

    Thread-safe and reentrant: the setting is process-wide, so the blocks open in every thread
    share it through a nesting count under a lock. The first block to enter saves the counts and
    sets one thread; the last to leave restores them, whatever order the threads leave in.
    """
    global _blas_depth
    if not active:
        yield
        return
    # SciPy's BLAS is loaded once Numba links it; load it first so that it is controlled too.
    import scipy.linalg.cython_blas  # noqa: F401

    controls = _blas_thread_controls()
    with _blas_lock:
        if _blas_depth == 0:
            _blas_saved[:] = [getter() for getter, _ in controls]
            for _, setter in controls:
                setter(1)
        _blas_depth += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_depth -= 1
            if _blas_depth == 0:
                for (_, setter), count in zip(controls, _blas_saved):
                    setter(count)
                _blas_saved.clear()


#: Caches that grow with the shapes seen, as (module, attribute): per-thread scratch buffers
#: (a ``threading.local``) and ``functools.lru_cache``d tables. Compiled kernels are not here:
#: they are bounded by the number of kernel sources and cannot be unloaded anyway.
_SHAPE_CACHES = (
    ("lowbit.ops.packed_matmul._numba._gemm_f64", "_WORK"),
    ("lowbit.ops.lowrank_residual._layer", "_rope_tables_host"),
    ("lowbit.ops.lowrank_residual._layer", "_rope_tables_device"),
    ("lowbit.ops.rotary", "_host_tables"),
    ("lowbit.ops.segmented_attention._numba_decode", "_plan"),
)


def clear_caches() -> None:
    """Release the buffers and tables that kernels keep between calls.

    Frees the packed GEMM's float64 workspaces of the calling thread (each at most
    ``WORKSPACE_MAX_BYTES``; another thread's are freed when that thread ends, or by calling this
    in it), the cached rotary tables and the decode attention's work plans. Only modules already imported are touched; the next
    call simply allocates afresh.
    """
    import sys

    for module_name, attribute in _SHAPE_CACHES:
        cache = getattr(sys.modules.get(module_name), attribute, None)
        if cache is None:
            continue
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
        else:
            vars(cache).clear()
