"""The ``backend`` fixture (numpy, numba, cudasim, cuda) and a seeded ``rng``.

Each backend is skipped with its reason where it cannot run, never replaced by another. Inside
the fixture the backend is forced (strict dispatch) and every output a backend allocates is
poisoned with NaN, so an element a kernel forgets to write fails its comparison. Tests with the
cuda parameter carry the ``gpu`` mark (``pytest -m gpu``, run by ``python -m bench.gpu``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import lowbit
from lowbit import _backend, _dispatch


@dataclasses.dataclass(frozen=True)
class Backend:
    """The backend under test, with its array module for moving test data."""

    name: str

    @property
    def xp(self):
        return _backend.cupy_module() if self.name == "cuda" else np

    def to(self, x):
        """Host array -> this backend's array kind (``None`` passes through)."""
        if x is None or self.name != "cuda":
            return x
        return self.xp.asarray(x)

    def __str__(self):
        return self.name


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
