"""setup.cfg lists every package, and the sources a wheel needs are where the loader looks."""

import configparser
from pathlib import Path

from lowbit import _kernels

ROOT = Path(__file__).resolve().parent.parent


def test_setup_cfg_lists_every_op_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    ops = {f"lowbit.ops.{p.name}" for p in (ROOT / "lowbit" / "ops").iterdir()
           if (p / "__init__.py").is_file()}
    expected = ops | {"lowbit", "lowbit.ops", "lowbit._cuda_src", "lowbit.reference"}
    assert listed == expected, f"missing {expected - listed}, stale {listed - expected}"


def test_kernel_sources_and_references_are_reachable():
    assert (_kernels.cuda_dir() / "common.cuh").is_file()
    import lowbit.reference.pack_bits  # noqa: F401

    assert lowbit.reference.__file__
