"""The one registry of backends: which implementation of an op runs for given arrays.

Each op lives in ``lowbit/ops/<op>/`` with one module (a file or a package) per backend family:
``_numpy`` (backend ``numpy``), ``_numba`` (``numba``) and ``_cuda`` (``cuda`` on cupy arrays,
``cudasim`` on numpy arrays: the same launchers, another module object). The op's ``__init__``
validates, then calls ``resolve(op, *arrays)`` and the returned module's functions, which keep
the contract of ``lowbit/ops/__init__.py``.

Forcing (``use_backend`` or ``LOWBIT_BACKEND``) is strict: a forced backend that cannot run
raises ``BackendUnavailableError`` (missing package) or ``TypeError`` (wrong array kind).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from types import ModuleType
from typing import Iterator

from . import _backend

BACKENDS = ("numpy", "numba", "cudasim", "cuda")
_MODULE_OF_BACKEND = {"numpy": "_numpy", "numba": "_numba", "cudasim": "_cuda", "cuda": "_cuda"}
_ARRAYS_OF_BACKEND = {"numpy": "numpy", "numba": "numpy", "cudasim": "numpy", "cuda": "cupy"}
_HOW_TO_GET = {
    "numba": "install numba (`pip install numba`, a default dependency of lowbit)",
    "cuda": "install cupy for your CUDA version (`pip install lowbit[cuda12]` or "
    "`lowbit[cuda13]`) on a machine with an NVIDIA GPU",
}

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowbit_backend", default=None)


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run on this machine; the message says how to get it."""


def _check_name(name: str) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def backend_unavailable_reason(name: str) -> str | None:
    """None when ``name`` can run here, else why not and how to get it."""
    _check_name(name)
    if name == "numpy":
        return None
    if name == "numba":
        if _backend.numba_available():
            return None
        missing = _backend.numba_unavailable_reason() or "numba is not installed"
        return f"{missing}: {_HOW_TO_GET[name]}"
    if name == "cudasim":
        from . import _cudasim

        return None if _cudasim.available() else _cudasim.unavailable_reason()
    if _backend.cupy_module() is None:
        missing = _backend.cupy_unavailable_reason() or "cupy is not installed"
        return f"{missing}: {_HOW_TO_GET[name]}"
    if _backend.cuda_device_count() == 0:
        return f"cupy found no CUDA device: {_HOW_TO_GET[name]}"
    return None


def available_backends() -> list[str]:
    """The backends that can run on this machine, in dispatch order (see ``backend_status``
    for why the others cannot)."""
    return [b for b in BACKENDS if backend_unavailable_reason(b) is None]


def backend_status() -> dict[str, str | None]:
    """Every backend, in dispatch order, mapped to None (it can run here) or the reason it
    cannot and how to get it.

    A package that is installed but fails to import (a NumPy ABI mismatch, a missing CUDA
    library) is reported with its exception, e.g. ``{"numpy": None, "numba": "numba is
    installed but failed to import (ImportError: ...): install numba ...", ...}``; the first
    such failure also issues a ``lowbit.BackendImportWarning``.

    Example:
        >>> for name, reason in lowbit.backend_status().items():
        ...     print(f"{name:8} {reason or 'available'}")
    """
    return {b: backend_unavailable_reason(b) for b in BACKENDS}


def forced_backend() -> str | None:
    """The backend forced by ``use_backend`` (innermost wins) or ``LOWBIT_BACKEND``, if any."""
    name = _forced.get()
    if name is None:
        env = os.environ.get("LOWBIT_BACKEND", "").strip()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"LOWBIT_BACKEND must be one of {BACKENDS}, got {env!r}")
            name = env
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Force a backend inside a ``with`` block (a ContextVar: thread- and task-local).

    Example:
        >>> with lowbit.use_backend("numpy"):
        ...     packed = lowbit.pack_bits(codes, 2)
    """
    token = _forced.set(_check_name(name))
    try:
        yield name
    finally:
        _forced.reset(token)


def select_backend(*arrays: object) -> str:
    """The backend that runs for these arrays (forced, or chosen by array kind)."""
    kind = _backend.array_kind(*arrays) or "numpy"
    name = forced_backend()
    if name is None:
        if kind == "cupy":
            name = "cuda"
        else:
            name = "numba" if _backend.numba_available() else "numpy"
    elif _ARRAYS_OF_BACKEND[name] != kind:
        raise TypeError(
            f"backend {name!r} runs on {_ARRAYS_OF_BACKEND[name]} arrays, got {kind} arrays; "
            f"{'move them to the host (cupy.asnumpy)' if kind == 'cupy' else 'use cupy arrays'} "
            "or force another backend"
        )
    reason = backend_unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} cannot run: {reason}")
    return name


#: (op, backend) -> the backend module, imported once (a decode step resolves hundreds of ops).
_MODULES: dict[tuple[str, str], ModuleType] = {}


def resolve(op: str, *arrays: object) -> tuple[str, ModuleType]:
    """Return ``(backend_name, module)`` implementing ``op`` for these arrays."""
    name = select_backend(*arrays)
    module = _MODULES.get((op, name))
    if module is None:
        module = importlib.import_module(f"lowbit.ops.{op}.{_MODULE_OF_BACKEND[name]}")
        _MODULES[op, name] = module
    return name, module
