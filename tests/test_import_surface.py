"""The import surface of ``lowbit/__init__.py``: lazy subpackages (PEP 562), ``__all__``,
``dir()``, the error for an unknown name, and the optional packages left unimported."""

import os
import subprocess
import sys
import textwrap

import pytest

import lowbit

#: Optional packages that ``import lowbit`` and its subpackages must not import by themselves.
_OPTIONAL = ("mpi4py", "gguf", "cupy", "torch")


def _run(code: str) -> subprocess.CompletedProcess:
    # No MPI launcher variables: communicator() must then be the size-1 one.
    launcher = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=env)


def test_subpackages_load_lazily_without_optional_packages(tmp_path):
    out = _run(f"""
        import sys
        import numpy as np
        import lowbit
        optional = {_OPTIONAL!r}
        lazy = ("lowbit.io", "lowbit.models", "lowbit.distributed", "lowbit.reference")
        assert not [m for m in optional if m in sys.modules], sys.modules.keys() & set(optional)
        assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]
        names = dir(lowbit)
        assert {{"io", "models", "distributed", "reference"}} <= set(names), names

        # lowbit.io: a checkpoint round trip through the attribute alone
        path = {str(tmp_path / "ckpt.safetensors")!r}
        lowbit.io.save(path, {{"w": np.arange(6, dtype=np.float32).reshape(2, 3)}})
        back = lowbit.io.load(path)
        assert (back["w"] == np.arange(6, dtype=np.float32).reshape(2, 3)).all(), back

        # lowbit.models.bdh and .train reached as attributes
        config = lowbit.models.bdh.BDHConfig()
        assert callable(lowbit.models.bdh.forward) and config is not None
        assert "lowbit.models.train" not in sys.modules
        assert lowbit.models.train.__name__ == "lowbit.models.train"

        # without a launcher: the size-1 communicator, mpi4py never imported
        comm = lowbit.distributed.communicator()
        assert (comm.rank, comm.size) == (0, 1), (comm.rank, comm.size)
        assert lowbit.reference.__name__ == "lowbit.reference"
        loaded = [m for m in optional if m in sys.modules]
        assert not loaded, loaded
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_unknown_attribute_raises_a_clear_attribute_error():
    with pytest.raises(AttributeError, match=r"module 'lowbit' has no attribute 'no_such_op'"):
        lowbit.no_such_op  # noqa: B018
    assert not hasattr(lowbit, "pack_bitz")
    with pytest.raises(AttributeError, match=r"'lowbit.models' has no attribute 'gpt'"):
        lowbit.models.gpt  # noqa: B018


def test_all_names_resolve_and_are_listed_by_dir():
    assert len(lowbit.__all__) == len(set(lowbit.__all__))
    for name in lowbit.__all__:
        assert getattr(lowbit, name) is not None, name
    assert set(lowbit.__all__) <= set(dir(lowbit))
    assert {"io", "models", "distributed", "reference", "pack_bits", "backend_status",
            "BackendImportWarning", "__version__"} <= set(lowbit.__all__)


def test_all_lists_every_public_name_bound_at_import():
    public = {name for name, value in vars(lowbit).items()
              if not name.startswith("_") and not isinstance(value, type(sys))}
    missing = public - set(lowbit.__all__)
    assert not missing, f"public names missing from lowbit.__all__: {sorted(missing)}"


def test_star_import_gives_the_public_api():
    namespace: dict = {}
    exec("from lowbit import *", namespace)
    assert {"pack_bits", "quantize_weight", "io", "models", "distributed"} <= set(namespace)


def test_version_comes_from_the_version_module():
    from lowbit import _version

    assert lowbit.__version__ == _version.__version__


def test_module_docstring_points_at_the_docs():
    doc = lowbit.__doc__
    assert "docs/architecture" in doc
    assert "DESIGN.md" not in doc and "issue" not in doc.lower()
