"""cudasim: run lowbit's CUDA kernels (``cuda/*.cu``) on the CPU, built with g++.

``load_module(code, name_expressions, include_dirs)`` compiles a .cu source against the
emulation header ``cuda/cudasim.cuh`` into a shared library and returns a ``SimModule`` that
answers ``get_function(name)(grid, block, args, shared_mem=0)`` like ``cupy.RawModule``.
``lowbit/_kernels.py`` picks it for numpy arrays; the launchers in ``lowbit/ops/<op>/_cuda.py``
are shared with the cuda backend. This module is the launcher (trampolines, ``SimModule``,
``SimKernel``); the g++ command and the content-hashed build cache are in its sibling
``lowbit/_cudasim_build.py``. Tests: ``tests/test_cudasim.py`` and
``tests/test_cudasim_runtime.py`` with ``tests/cuda/*.cu``.

Trampolines: for every name expression an ``extern "C"`` trampoline
``lowbit_sim_entry_<i>(void** argv)`` is appended to the source; it calls the kernel with
argument ``i`` read from ``argv[i]`` as the parameter type C++ deduces from the function pointer.
``lowbit_sim_params_<i>`` reports the parameter sizes and kinds, which ``SimKernel`` checks
before every launch.

Argument rules (checked before anything runs; ``TypeError`` on a mismatch):

* numpy arrays are passed as their data pointer (strides are ignored, as in cupy) and must meet
  pointer parameters;
* numpy scalars (``np.int32(n)``, ``np.float32(x)``, ...) are passed by value and must have the
  parameter's byte size and family (integer or floating point; signedness is not checked,
  like on the GPU where only the bytes travel);
* Python ``int``/``float``/``bool`` are rejected: on a GPU their width is ambiguous (cupy picks
  one that need not match the kernel's parameter), so launchers must say ``np.int32`` /
  ``np.int64`` / ``np.float32`` explicitly.

Execution: ``cuda/cudasim.cuh`` runs one OS thread per CUDA thread (stack 256 KiB), the blocks
one after another; deadlocks and divergent barriers raise ``RuntimeError``. Every thread of a
block counts as running from the moment the block is launched until it returns, whether or not
its OS thread has started yet, so a deadlock is reported exactly (never because a thread was
slow to start on a loaded machine). A barrier wait during which no thread of the block makes
progress for ``timeout`` seconds (default ``$LOWBIT_CUDASIM_TIMEOUT`` or 60) also raises, once
the thread that keeps the others waiting finishes. A kernel that loops forever outside any
barrier, crashes or overflows its stack cannot be caught. ``$LOWBIT_CUDASIM_JITTER_US``
(debugging) delays thread start-up and exit at random to shake out races.

Loaded modules are kept in memory for the life of the process, keyed like the disk cache.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Sequence

import numpy as np

from . import _cudasim_build as _build
# The build cache's names that callers and tests reach through this module.
from ._cudasim_build import (  # noqa: F401
    _file_sha256,
    _insecure_reason,
    available,
    cache_dir,
    unavailable_reason,
)

__all__ = ["available", "unavailable_reason", "load_module", "SimModule", "SimKernel"]

#: Barrier wait without any progress of the block before a launch is aborted. Generous: real
#: deadlocks are detected exactly and at once; this only catches a thread that loops forever
#: while others wait, and must never fire on a slow, heavily loaded machine.
DEFAULT_TIMEOUT_S = 60.0
#: Debugging knob: with ``$LOWBIT_CUDASIM_JITTER_US=N`` every kernel thread sleeps a random
#: 0..N microseconds when it is handed its CUDA thread and again around its exit, which makes
#: the thread start-up and hand-off races of a loaded machine likely
#: (tests/test_cudasim_runtime.py).
JITTER_ENV = "LOWBIT_CUDASIM_JITTER_US"
MAX_JITTER_US = 1_000_000
#: cupy's default limit on dynamic shared memory without the opt-in attribute.
DEFAULT_MAX_DYNAMIC_SHARED = 48 * 1024
#: The largest opt-in dynamic shared memory of current GPUs (sm_90: 227 KiB).
MAX_DYNAMIC_SHARED_OPT_IN = 227 * 1024
MAX_BLOCK_THREADS = 1024
MAX_BLOCK_DIMS = (1024, 1024, 64)
MAX_GRID_DIMS = (2**31 - 1, 65535, 65535)
_ERRBUF_BYTES = 4096
_MAX_PARAMS = 256

_PARAM_KINDS = {0: "pointer", 1: "signed integer", 2: "unsigned integer", 3: "floating point",
                4: "bool", 5: "struct"}

_lock = threading.Lock()
_modules: dict[str, SimModule] = {}
_key_locks: dict[str, threading.Lock] = {}


def __getattr__(name: str):
    # build_count changes with every build: read it live from the build cache.
    if name == "build_count":
        return _build.build_count
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------

_NAME_EXPR_FORBIDDEN = re.compile(r"[;{}\n\r\"'#\\]")


def _check_name_expressions(name_expressions: Sequence[str]) -> tuple[str, ...]:
    if isinstance(name_expressions, str):
        raise TypeError("name_expressions must be a sequence of strings, not one string")
    names = tuple(name_expressions)
    for n in names:
        if not isinstance(n, str) or not n.strip() or _NAME_EXPR_FORBIDDEN.search(n):
            raise ValueError(f"invalid kernel name expression {n!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate name expressions in {names}")
    return names


def _full_source(code: str, names: tuple[str, ...]) -> str:
    lines = [code, "", '#line 1 "lowbit-cudasim-trampolines"']
    for i, n in enumerate(names):
        lines.append(
            f'extern "C" LOWBIT_SIM_EXPORT void lowbit_sim_entry_{i}(void** argv) '
            f"{{ ::lowbit_sim::invoke(&{n}, argv); }}"
        )
        lines.append(
            f'extern "C" LOWBIT_SIM_EXPORT int lowbit_sim_params_{i}(long long* sizes, '
            f"int* kinds, int capacity) {{ return ::lowbit_sim::describe(&{n}, sizes, kinds, "
            f"capacity); }}"
        )
        lines.append(
            f'extern "C" LOWBIT_SIM_EXPORT const char* lowbit_sim_signature_{i}() '
            f"{{ return ::lowbit_sim::signature_of(&{n}); }}"
        )
    return "\n".join(lines) + "\n"


def load_module(code: str, name_expressions: Sequence[str],
                include_dirs: Sequence[str]) -> SimModule:
    """Build (or load from the cache) the CPU module of a CUDA source.

    Args:
        code: the full .cu source text; its ``#include "..."`` are found through
            ``include_dirs``.
        name_expressions: every kernel that will be launched, as cupy name expressions:
            a template instantiation (``"pack_bits<2>"``) or a plain kernel name.
        include_dirs: folders passed to g++ with ``-I``; every header below them (by suffix,
            recursively) enters the cache key.

    Returns:
        The loaded module.

    Raises:
        RuntimeError: cudasim is unavailable or the source does not compile (g++'s messages
            are included).
        ValueError: a malformed or duplicated name expression.
    """
    if not _build.available():
        raise RuntimeError(_build.unavailable_reason())
    names = _check_name_expressions(name_expressions)
    build = _build.prepare(_full_source(code, names), include_dirs)

    with _lock:
        mod = _modules.get(build.key)
        if mod is not None:
            return mod
        key_lock = _key_locks.setdefault(build.key, threading.Lock())
    with key_lock:
        with _lock:
            mod = _modules.get(build.key)
        if mod is None:
            mod = SimModule(_build.load_or_build(build), names)
            with _lock:
                _modules[build.key] = mod
    return mod


def _clear_loaded_modules() -> None:
    """Forget the in-memory modules (tests use it to exercise the disk cache)."""
    with _lock:
        _modules.clear()


# ------------------------------------------------------------------------------------------
# Modules and launches
# ------------------------------------------------------------------------------------------

class SimModule:
    """A built cudasim library: the counterpart of ``cupy.RawModule``."""

    def __init__(self, lib: ctypes.CDLL, name_expressions: tuple[str, ...]):
        self._lib = lib
        self._names = name_expressions
        self._kernels: dict[str, SimKernel] = {}
        launch = lib.lowbit_sim_launch
        launch.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)] + \
            [ctypes.c_uint] * 6 + [ctypes.c_ulonglong, ctypes.c_longlong, ctypes.c_uint,
                                   ctypes.c_char_p, ctypes.c_int]
        launch.restype = ctypes.c_int
        self._launch = launch

    @property
    def name_expressions(self) -> tuple[str, ...]:
        return self._names

    def get_function(self, name_expression: str) -> SimKernel:
        """The kernel for one of the module's name expressions.

        Raises:
            KeyError: ``name_expression`` was not given to ``load_module``.
        """
        kernel = self._kernels.get(name_expression)
        if kernel is None:
            try:
                index = self._names.index(name_expression)
            except ValueError:
                raise KeyError(
                    f"cudasim: kernel {name_expression!r} is not among the module's name "
                    f"expressions {list(self._names)}"
                ) from None
            kernel = SimKernel(self, index, name_expression)
            self._kernels[name_expression] = kernel
        return kernel


def _dims(value, what: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        items = [value]
    elif isinstance(value, (tuple, list)) and 1 <= len(value) <= 3:
        items = list(value)
    else:
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
    dims = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}")
        dims.append(int(v))
    dims += [1] * (3 - len(dims))
    for axis, (d, lim) in enumerate(zip(dims, limits)):
        if not 1 <= d <= lim:
            raise ValueError(f"{what} dimension {'xyz'[axis]} is {d}; it must lie in [1, {lim}]")
    return dims[0], dims[1], dims[2]


def _jitter_us() -> int:
    text = os.environ.get(JITTER_ENV, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${JITTER_ENV} must be an integer number of microseconds, "
                         f"got {text!r}") from None
    if not 0 <= value <= MAX_JITTER_US:
        raise ValueError(f"${JITTER_ENV} must lie in [0, {MAX_JITTER_US}], got {value}")
    return value


class SimKernel:
    """One kernel of a ``SimModule``: the counterpart of ``cupy.RawKernel``.

    Attributes:
        max_dynamic_shared_size_bytes: the largest ``shared_mem`` a launch may ask for; 48 KiB
            unless raised (up to 227 KiB), as cupy requires on a GPU.
    """

    def __init__(self, module: SimModule, index: int, name: str):
        self._module = module
        self.name = name
        lib = module._lib
        self._entry = ctypes.cast(getattr(lib, f"lowbit_sim_entry_{index}"), ctypes.c_void_p)
        params = getattr(lib, f"lowbit_sim_params_{index}")
        params.argtypes = [ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_int),
                           ctypes.c_int]
        params.restype = ctypes.c_int
        sizes = (ctypes.c_longlong * _MAX_PARAMS)()
        kinds = (ctypes.c_int * _MAX_PARAMS)()
        n = params(sizes, kinds, _MAX_PARAMS)
        if n > _MAX_PARAMS:
            raise RuntimeError(f"cudasim: kernel {name} has more than {_MAX_PARAMS} parameters")
        self.param_sizes = tuple(sizes[i] for i in range(n))
        self.param_kinds = tuple(_PARAM_KINDS[kinds[i]] for i in range(n))
        sig = getattr(lib, f"lowbit_sim_signature_{index}")
        sig.restype = ctypes.c_char_p
        text = sig().decode(errors="replace")
        m = re.search(r"P = \{(.*)\}\]", text)
        self.signature = f"{name}({m.group(1) if m else '...'})"
        self._max_dyn = DEFAULT_MAX_DYNAMIC_SHARED

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dyn

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        value = int(value)
        if not 0 <= value <= MAX_DYNAMIC_SHARED_OPT_IN:
            raise ValueError(f"max_dynamic_shared_size_bytes must lie in [0, "
                             f"{MAX_DYNAMIC_SHARED_OPT_IN}], got {value}")
        self._max_dyn = value

    @property
    def num_params(self) -> int:
        return len(self.param_sizes)

    def _marshal(self, args) -> tuple[ctypes.Array, list]:
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"cudasim: kernel {self.signature}: args must be a tuple, "
                            f"got {type(args).__name__}")
        if len(args) != self.num_params:
            raise TypeError(f"cudasim: kernel {self.signature} takes {self.num_params} "
                            f"arguments, got {len(args)}")
        keep = []
        argv = (ctypes.c_void_p * max(1, len(args)))()
        for i, (a, size, kind) in enumerate(zip(args, self.param_sizes, self.param_kinds)):
            where = f"cudasim: kernel {self.signature}, argument {i}"
            expected = f"a {size}-byte {kind}"
            if isinstance(a, np.ndarray):
                if kind != "pointer":
                    raise TypeError(f"{where}: expected {expected} (a numpy scalar), got an array")
                if a.dtype.hasobject:
                    raise TypeError(f"{where}: arrays of Python objects cannot be passed")
                buf = ctypes.c_void_p(a.ctypes.data)
                keep.append(a)
            elif isinstance(a, np.generic):
                if kind == "pointer":
                    raise TypeError(f"{where}: expected an array (pointer parameter), got "
                                    f"{type(a).__name__}")
                dk = a.dtype.kind
                ok_kind = {"signed integer": "iu", "unsigned integer": "iu",
                           "floating point": "f", "bool": "b"}.get(kind)
                if a.dtype.itemsize != size or (ok_kind is not None and dk not in ok_kind):
                    raise TypeError(f"{where}: expected {expected}, got {a.dtype.name} "
                                    f"({a.dtype.itemsize} bytes)")
                buf = ctypes.create_string_buffer(a.tobytes(), max(size, 8))
            elif isinstance(a, (bool, int, float, complex)):
                raise TypeError(f"{where}: got a Python {type(a).__name__}; pass a numpy scalar "
                                f"of the parameter's type ({expected}), e.g. np.int32(...) — "
                                "a Python number's width is ambiguous on a GPU")
            else:
                raise TypeError(f"{where}: expected {expected}, got {type(a).__name__}")
            keep.append(buf)
            argv[i] = ctypes.addressof(buf)
        return argv, keep

    def __call__(self, grid, block, args, shared_mem: int = 0, *,
                 timeout: float | None = None) -> None:
        """Launch the kernel and wait for it.

        Args:
            grid: blocks per grid, an int or a tuple of up to 3 ints.
            block: threads per block, an int or a tuple of up to 3 ints (at most 1024 in all).
            args: tuple of numpy arrays (passed by data pointer) and numpy scalars.
            shared_mem: bytes of dynamic shared memory per block.
            timeout: seconds a barrier wait may last without any thread of the block making
                progress (starting, arriving at a barrier, exiting) before the launch is
                aborted (default ``$LOWBIT_CUDASIM_TIMEOUT`` or 60). Deadlocks are reported
                at once regardless; the timeout only catches a thread that loops forever.

        Raises:
            TypeError: arguments that do not match the kernel's parameters.
            ValueError: an invalid launch configuration.
            RuntimeError: the kernel deadlocked, diverged at a barrier, trapped or timed out.
        """
        g = _dims(grid, "grid", MAX_GRID_DIMS)
        b = _dims(block, "block", MAX_BLOCK_DIMS)
        if b[0] * b[1] * b[2] > MAX_BLOCK_THREADS:
            raise ValueError(f"block {b} has {b[0] * b[1] * b[2]} threads; at most "
                             f"{MAX_BLOCK_THREADS} are allowed")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)):
            raise TypeError(f"shared_mem must be an int, got {shared_mem!r}")
        shared_mem = int(shared_mem)
        if not 0 <= shared_mem <= self._max_dyn:
            raise ValueError(
                f"shared_mem={shared_mem} bytes exceeds max_dynamic_shared_size_bytes="
                f"{self._max_dyn} of kernel {self.name} (raise it like on cupy)"
            )
        if timeout is None:
            timeout = float(os.environ.get("LOWBIT_CUDASIM_TIMEOUT", DEFAULT_TIMEOUT_S))
        timeout_ms = max(1, int(timeout * 1000))
        jitter_us = _jitter_us()
        argv, keep = self._marshal(args)
        err = ctypes.create_string_buffer(_ERRBUF_BYTES)
        rc = self._module._launch(self._entry, argv, *g, *b, shared_mem, timeout_ms, jitter_us,
                                  err, _ERRBUF_BYTES)
        del keep
        if rc != 0:
            raise RuntimeError(f"cudasim: kernel {self.name} grid={g} block={b}: "
                               f"{err.value.decode(errors='replace')}")

    def __repr__(self) -> str:
        return f"<SimKernel {self.signature}>"
