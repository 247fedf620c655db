"""The reference builds without a warning: ``sphinx-build -W --keep-going -b html docs OUT``.

A broken docstring, a public name no page documents (``docs/_ext/lowbit_docs.py`` checks that)
or an op-table signature that no longer resolves fails here. Needs Sphinx (the ``docs`` extra,
``pip install ".[docs]"``); skipped, saying so, without it. ~10 s on two cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx", reason="the docs need Sphinx: pip install '.[docs]'")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "html" / "index.html").is_file()
