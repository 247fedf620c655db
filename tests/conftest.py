"""The ``backend`` fixture (numpy, numba, cudasim, cuda) and a seeded ``rng``.

Each backend is skipped with its reason where it cannot run, never replaced by another. Inside
the fixture the backend is forced (strict dispatch) and every output a backend allocates is
poisoned with NaN, so an element a kernel forgets to write fails its comparison. Tests with the
cuda parameter carry the ``gpu`` mark (``pytest -m gpu``, run by ``python -m bench.gpu``).
The ``never_runs`` fixture proves that validation fires before any backend code.

Hypothesis profiles of the property tests (``tests/properties/``): ``ci`` (the default: 15
derandomized examples a test, no database, so a run is reproducible and nothing is written into
the repository) and ``thorough`` (``pytest --hypothesis-profile=thorough``: 400 random examples,
a database under the system temporary directory so a long run's failures replay on the next).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

import lowbit
import lowbit.ops
from lowbit import _backend, _dispatch

from helpers import Backend

#: Settings both profiles share (examples are slow to make: no deadline, no size checks).
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=15, database=None, derandomize=True, **_COMMON)
settings.register_profile(
    "thorough", max_examples=400, derandomize=False,
    database=DirectoryBasedExampleDatabase(
        os.path.join(tempfile.gettempdir(), "lowbit-hypothesis")),
    **_COMMON)
if settings.get_current_profile_name() == "default":
    settings.load_profile("ci")


BACKEND_PARAMS = [
    pytest.param("numpy"),
    pytest.param("numba"),
    pytest.param("cudasim"),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request):
    name = request.param
    reason = _dispatch.backend_unavailable_reason(name)
    if reason is not None:
        pytest.skip(f"backend {name} unavailable: {reason}")
    previous = _backend.set_poison_outputs(True)
    try:
        with lowbit.use_backend(name):
            yield Backend(name)
    finally:
        _backend.set_poison_outputs(previous)


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


class NeverRuns:
    """While armed, every backend function of every op raises: see ``never_runs``."""

    def __init__(self):
        self.armed = True

    @contextlib.contextmanager
    def paused(self):
        """Let backends run (to build a ctx for a backward's validation test)."""
        self.armed = False
        try:
            yield
        finally:
            self.armed = True


def _never(original, guard):
    def guarded(*args, **kwargs):
        if guard.armed:
            raise AssertionError(f"backend {original.__module__}.{original.__name__} ran before "
                                 "validation")
        return original(*args, **kwargs)

    return guarded


@pytest.fixture
def never_runs(monkeypatch):
    """Fail if any backend code runs: validation must come first.

    Forces the numpy backend and replaces every function of every op's ``_numpy`` module (the
    ones dispatch hands out) by one that raises while armed; ``never_runs.paused()`` lets them
    run, for example to build the ctx whose backward is then checked.
    """
    guard = NeverRuns()
    ops = Path(lowbit.ops.__file__).parent
    for path in sorted(ops.glob("*/_numpy.py")):
        module = importlib.import_module(f"lowbit.ops.{path.parent.name}._numpy")
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                monkeypatch.setattr(module, name, _never(fn, guard))
    with lowbit.use_backend("numpy"):
        yield guard
