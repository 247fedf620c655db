"""One subpackage per op: ``__init__`` (public API, validation, ctx), ``_numpy``, ``_numba``,
``_cuda`` (launchers for ``cuda/<op>.cu``, used by the cuda and cudasim backends)."""
