"""The backend contract of ``lowbit/ops/__init__.py``, held for every op found on disk.

An op's backend API is what its own code calls through dispatch (``impl.<name>(...)`` in the
op's non-backend modules). Every backend module of the op (``_numpy``, ``_numba``, ``_cuda``)
defines each of those functions with the same parameters; a backward takes the incoming gradient
first; no backend function reuses a public name of lowbit or of its op.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import lowbit
import lowbit.ops

OPS_DIR = Path(lowbit.ops.__file__).parent
BACKEND_MODULES = ("_numpy", "_numba", "_cuda")
OPS = sorted(p.name for p in OPS_DIR.iterdir() if (p / "__init__.py").is_file())
CALL = re.compile(r"\bimpl\.([A-Za-z_][A-Za-z0-9_]*)\s*\(")
#: Backward functions: named ``*backward*`` or ``<something>_d<input>`` (``matmul_dx``).
BACKWARD = re.compile(r"backward|_d[a-z]$")


def _backend_modules(op):
    here = OPS_DIR / op
    return [m for m in BACKEND_MODULES
            if (here / f"{m}.py").is_file() or (here / m / "__init__.py").is_file()]


def _api(op):
    """Names the op's own (non-backend) modules call through dispatch."""
    names = set()
    for path in (OPS_DIR / op).glob("*.py"):
        if path.stem not in BACKEND_MODULES:
            names.update(CALL.findall(path.read_text()))
    return sorted(names)


def _signature(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


OPS_WITH_BACKENDS = [op for op in OPS if _backend_modules(op)]


def test_discovery_finds_the_ops():
    assert {"packed_matmul", "segmented_attention", "gated_delta_scan"} <= set(OPS_WITH_BACKENDS)


@pytest.mark.parametrize("op", OPS_WITH_BACKENDS)
def test_every_backend_defines_the_api_with_one_signature(op):
    api = _api(op)
    assert api, f"{op}: no impl.<name>(...) call found in its own modules"
    modules = {m: importlib.import_module(f"lowbit.ops.{op}.{m}") for m in _backend_modules(op)}
    assert set(modules) == set(BACKEND_MODULES), f"{op} lacks {set(BACKEND_MODULES) - set(modules)}"
    for name in api:
        signatures = {}
        for m, module in modules.items():
            fn = getattr(module, name, None)
            assert inspect.isfunction(fn), f"lowbit.ops.{op}.{m} does not define {name}()"
            signatures[m] = _signature(fn)
        first = signatures["_numpy"]
        for m, sig in signatures.items():
            assert sig == first, (f"{op}.{m}.{name}{[p[0] for p in sig]} differs from "
                                  f"_numpy's {[p[0] for p in first]}")


@pytest.mark.parametrize("op", OPS_WITH_BACKENDS)
def test_backwards_take_the_gradient_first(op):
    module = importlib.import_module(f"lowbit.ops.{op}._numpy")
    for name in _api(op):
        if BACKWARD.search(name):
            params = list(inspect.signature(getattr(module, name)).parameters)
            assert params and params[0].startswith("d"), (
                f"{op} backend {name}({', '.join(params)}) must take the incoming gradient first")


@pytest.mark.parametrize("op", OPS_WITH_BACKENDS)
def test_backend_names_are_not_public_names(op):
    package = importlib.import_module(f"lowbit.ops.{op}")
    public = set(dir(lowbit)) | {n for n in dir(package) if not n.startswith("_")}
    clash = sorted(set(_api(op)) & public)
    assert not clash, f"{op} backend functions reuse public names: {clash}"
