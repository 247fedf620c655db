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

import numpy as np


@functools.lru_cache(maxsize=None)
def cupy_module():
    """Return the cupy module, or None when it is not installed or unusable."""
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        import cupy
    except Exception:  # a broken CUDA install must not break `import lowbit`
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def cuda_device_count() -> int:
    cp = cupy_module()
    if cp is None:
        return 0
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


@functools.lru_cache(maxsize=None)
def numba_available() -> bool:
    if importlib.util.find_spec("numba") is None:
        return False
    try:
        import numba  # noqa: F401
    except Exception:
        return False
    return True


def is_cupy_array(x) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(x, cp.ndarray)


def array_kind(*arrays) -> str | None:
    """Return "numpy", "cupy" or None (no arrays) for the given inputs.

    Raises:
        TypeError: numpy and cupy arrays are mixed (data is never moved implicitly).
    """
    kinds = set()
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


def array_module(*arrays):
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


def empty(shape, dtype, xp=np):
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

    Numba (``cache=True``) keys each cached kernel on the stamp (mtime, size) of its own source
    file, and freezes the globals and inlined helpers it reads from other files. Called at the top
    of a kernel package's ``__init__`` (or of a kernel module, for the files beside it), this gives
    every ``.py`` file of that folder the newest mtime among them and the ``owners`` (the modules
    whose constants the kernels import), so an edit to any of them changes the stamp of every
    kernel file and the kernels recompile. Once equal, the stamps stay put: no recompiles on later
    imports. A read-only install is left as is (nothing there can be edited).

    Args:
        package_file: ``__file__`` of the package's ``__init__.py`` or of the kernel module.
        owners: paths of further source files the kernels depend on.
    """
    import os
    from pathlib import Path

    files = sorted(Path(package_file).parent.glob("*.py"))
    newest = max(os.stat(p).st_mtime_ns for p in [*files, *map(Path, owners)])
    for path in files:
        stat = os.stat(path)
        if stat.st_mtime_ns != newest:
            try:
                os.utime(path, ns=(stat.st_atime_ns, newest))
            except OSError:
                return


@functools.lru_cache(maxsize=None)
def _blas_thread_controls():
    """(get, set) ctypes pairs of every OpenBLAS loaded in this process (Linux; else none)."""
    controls = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return ()
    for path in sorted(p for p in paths if os.path.isfile(p)):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_", ""):
            for suffix in ("", "64_"):
                getter = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
                setter = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
                if getter is not None and setter is not None:
                    getter.restype = ctypes.c_int
                    setter.argtypes = (ctypes.c_int,)
                    controls.append((getter, setter))
                    break
            else:
                continue
            break
    return tuple(controls)


def read_only(*arrays):
    """Read-only views of host arrays, for the Numba kernels that only read them.

    Numba compiles one specialization per argument type, and types a read-only array apart from
    a writable one: a user's read-only input (a read-only memory map, an array a test froze)
    would compile every kernel a second time (81 s of the suite's cold compiles). Handing the
    kernels read-only views of their inputs, always, keeps one specialization; Numba then also
    refuses to compile a kernel that writes one. Returns one view, or a list for several.
    """
    views = []
    for a in arrays:
        view = a.view()
        view.flags.writeable = False
        views.append(view)
    return views[0] if len(views) == 1 else views


@contextlib.contextmanager
def single_threaded_blas(active: bool = True):
    """Run OpenBLAS (NumPy's and SciPy's, the one ``np.dot`` calls from Numba) on one thread
    inside the block, process-wide, and restore the previous counts after it.

    For code whose Numba parallel regions already occupy every core and whose BLAS calls come
    between them: OpenBLAS's worker threads keep spinning after a call and take the cores from
    Numba's (measured on 2 cores: a BDH training step 1.32 s with two BLAS threads, 0.17 s with
    one). ``active=False`` makes it a no-op (for callers on other backends).
    """
    if not active:
        yield
        return
    # SciPy's BLAS is loaded once Numba links it; load it first so that it is controlled too.
    import scipy.linalg.cython_blas  # noqa: F401

    controls = _blas_thread_controls()
    previous = [getter() for getter, _ in controls]
    for _, setter in controls:
        setter(1)
    try:
        yield
    finally:
        for (_, setter), count in zip(controls, previous):
            setter(count)


#: Caches that grow with the shapes seen, as (module, attribute): per-thread scratch buffers
#: (a ``threading.local``) and ``functools.lru_cache``d tables. Compiled kernels are not here:
#: they are bounded by the number of kernel sources and cannot be unloaded anyway.
_SHAPE_CACHES = (
    ("lowbit.ops.packed_matmul._numba._gemm_f64", "_WORK"),
    ("lowbit.ops.lowrank_residual._layer", "_rope_tables_host"),
    ("lowbit.ops.lowrank_residual._layer", "_rope_tables_device"),
)


def clear_caches() -> None:
    """Release the buffers and tables that kernels keep between calls.

    Frees the packed GEMM's float64 workspaces of the calling thread (each at most
    ``WORKSPACE_MAX_BYTES``; another thread's are freed when that thread ends, or by calling this
    in it) and the cached rotary tables. Only modules already imported are touched; the next
    call simply allocates afresh.
    """
    import sys

    for module_name, attribute in _SHAPE_CACHES:
        cache = getattr(sys.modules.get(module_name), attribute, None)
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
        elif cache is not None:
            vars(cache).clear()
