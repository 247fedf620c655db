"""setup.cfg lists every package, and the sources a wheel needs are where the loader looks."""

import configparser
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from lowbit import _kernels

ROOT = Path(__file__).resolve().parent.parent


def test_setup_cfg_lists_every_op_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    # every package under lowbit/, nested ones included (lowbit.ops.packed_matmul._numba)
    ops = {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "lowbit").rglob("*")
           if p.is_dir() and (p / "__init__.py").is_file()}
    expected = ops | {"lowbit", "lowbit.ops", "lowbit._cuda_src", "lowbit.reference"}
    assert listed == expected, f"missing {expected - listed}, stale {listed - expected}"


def test_kernel_sources_and_references_are_reachable():
    assert (_kernels.cuda_dir() / "common.cuh").is_file()
    import lowbit.reference.pack_bits  # noqa: F401

    assert lowbit.reference.__file__


# A bare checkout on sys.path, with any editable-install finder removed: only the alias in
# lowbit/__init__.py can make reference/ importable as lowbit.reference.
_CHECKOUT_IMPORTS = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if 'editable' not in (getattr(f, '__name__', '') + type(f).__name__).lower()]
sys.path.insert(0, {root!r})
import lowbit, lowbit.reference.pack_bits
assert lowbit.__file__.startswith({root!r}), lowbit.__file__
assert lowbit.reference.__file__.startswith({root!r}), lowbit.reference.__file__
for name in ("lowbit.bench", "lowbit.lowbit", "lowbit.tests.helpers"):
    try:
        __import__(name)
    except ImportError:
        continue
    raise SystemExit(name + " imported")
print("ok")
"""


def test_checkout_aliases_reference_alone(tmp_path):
    code = _CHECKOUT_IMPORTS.format(root=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.parametrize("name", ["lowbit.bench", "lowbit.lowbit", "lowbit.tests.helpers"])
def test_repository_folders_are_not_lowbit_packages(name):
    with pytest.raises(ImportError):
        importlib.import_module(name)
