"""pyproject.toml lists every package, its extras install on every platform, the version has
one source, and the sources a wheel needs are where the loader looks."""

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import lowbit
from lowbit import _kernels

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_lists_every_op_package():
    listed = set(PROJECT["tool"]["setuptools"]["packages"])
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


def test_version_has_one_source():
    from lowbit import _version

    assert PROJECT["project"]["dynamic"] == ["version"]
    version = PROJECT["tool"]["setuptools"]["dynamic"]["version"]
    assert version["attr"] == "lowbit._version.__version__"
    assert lowbit.__version__ == _version.__version__ == importlib.metadata.version("lowbit")
    files = [*ROOT.glob("*.cfg"), *ROOT.glob("*.toml"), *(ROOT / "lowbit").rglob("*.py")]
    others = [p for p in files
              if p.name != "_version.py" and f'"{lowbit.__version__}"' in p.read_text()]
    assert not others, f"the version string is written again in {others}"


def test_license_and_typed_marker_ship():
    assert PROJECT["project"]["license"] == "MIT"
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "lowbit" / "py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["lowbit"]


def _marker_env(sys_platform, machine):
    return {"sys_platform": sys_platform, "platform_machine": machine,
            "platform_system": {"linux": "Linux", "darwin": "Darwin",
                                "win32": "Windows"}[sys_platform],
            "python_version": "3.11", "python_full_version": "3.11.7", "extra": ""}


def _requirements(extra, env, seen=()):
    """The distributions an extra installs on a platform, self-references expanded."""
    names = set()
    for line in PROJECT["project"]["optional-dependencies"][extra]:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if req.name == "lowbit":
            for inner in req.extras - set(seen):
                names |= _requirements(inner, env, (*seen, extra))
        else:
            names.add(req.name)
    return names


# Wheels that exist only for some platforms (looked up on the package index when the markers were
# written): the NVIDIA tools for Linux and Windows, mpich for Linux and Apple silicon.
_NVIDIA = {"cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"}


@pytest.mark.parametrize("sys_platform, machine, nvidia, mpich", [
    ("linux", "x86_64", True, True), ("linux", "aarch64", True, True),
    ("win32", "AMD64", True, False), ("darwin", "arm64", False, True),
    ("darwin", "x86_64", False, False)])
def test_test_extra_installs_on_every_platform(sys_platform, machine, nvidia, mpich):
    names = _requirements("test", _marker_env(sys_platform, machine))
    assert {"pytest", "hypothesis", "gguf", "safetensors"} <= names
    assert (_NVIDIA <= names) is nvidia and not (names & _NVIDIA and not nvidia)
    assert ("mpich" in names) is mpich and ("mpi4py" in names) is mpich


def test_base_dependencies_have_no_platform_only_wheels():
    for line in PROJECT["project"]["dependencies"]:
        assert Requirement(line).name not in _NVIDIA | {"mpich", "mpi4py"}, line
