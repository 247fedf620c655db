"""Sphinx configuration of lowbit's reference (``sphinx-build -W --keep-going docs docs/_build``).

The API pages are autodoc over the installed (or checked-out) package, so signatures and
docstrings come from the code; ``_ext/lowbit_docs.py`` renders the op table's signatures from
the code too and warns about any public name no page documents. No network is used: intersphinx
is off and the theme is Sphinx's own alabaster.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# A bare checkout builds without an install: lowbit imports from the repository root.
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE / "_ext"))

import lowbit  # noqa: E402

project = "lowbit"
author = "The lowbit developers"
copyright = "the lowbit developers"  # noqa: A001 (Sphinx's name)
release = lowbit.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "lowbit_docs",
]

exclude_patterns = ["_build"]
templates_path: list[str] = []
root_doc = "index"
default_role = "code"
# The op table writes a signature right after each function's link.
add_function_parentheses = False

# -- autodoc / napoleon ---------------------------------------------------------------------
autodoc_default_options = {"member-order": "bysource"}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# ``Array`` is an alias of ``Any`` (numpy or cupy arrays): keep its name in signatures.
autodoc_type_aliases = {"Array": "Array", "Scalar": "Scalar"}
autodoc_preserve_defaults = True
# Every page lists its objects by hand; autosummary only draws the summary tables.
autosummary_generate = False

napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Argument and attribute lists render as one field each, so that the docstrings' grouped
# entries ("q, k: [B, T, H, K] ...") stay one entry; attributes are not registered as objects
# of their own (the dataclass fields are not autodoc members).
napoleon_use_param = False
napoleon_use_rtype = False
napoleon_custom_sections = [("Attributes", "params_style")]

# Off: the build must not need the network.
intersphinx_mapping: dict = {}
# Cross-references to NumPy or CuPy types cannot resolve without intersphinx.
nitpicky = False

# -- HTML -----------------------------------------------------------------------------------
html_theme = "alabaster"
html_theme_options = {
    "description": "low-bit neural computation on NumPy, Numba and CuPy",
    "page_width": "1180px",
    "sidebar_width": "240px",
    "fixed_sidebar": True,
}
html_static_path: list[str] = []
html_show_sourcelink = False
