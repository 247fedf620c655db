"""The README's examples run: every fenced ```python block of README.md is executed.

Each block runs in a fresh namespace of this process (blocks are self-contained: they import what
they use), with its README line numbers in tracebacks. Every fence must name its language, so a
block is either run (```python) or visibly not meant to be (```bash, ```text, ...); nothing is
skipped silently. One kind of line is rewritten before a block runs, the marked step count of an
example that would take long: ``steps = 200  # tests/test_readme.py runs 3`` runs with
``steps = 3``; the marker says so in the README itself.

The docs build (``sphinx-build -W`` over ``docs/``, ~10 s) is a step of ``.ci/run``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
#: An opening fence, its info string (the language), the body, the closing fence.
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
#: A step count the test may lower: ``name = N  # tests/test_readme.py runs M``.
MARKED = re.compile(r"^(?P<lead>[ \t]*\w+ = )\d+(?P<note>[ \t]*# tests/test_readme\.py runs "
                    r"(?P<value>\d+))[ \t]*$", re.M)


def _blocks():
    """``(language, first line number of the body, body)`` of every fenced block."""
    text = README.read_text(encoding="utf-8")
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start(2)) + 1
        yield match.group(1).strip(), line, match.group(2)


PYTHON = [(line, body) for language, line, body in _blocks() if language == "python"]


def _runnable(body: str) -> str:
    """The block with each marked step count replaced by the value its marker names."""
    return MARKED.sub(lambda m: f"{m['lead']}{m['value']}{m['note']}", body)


def test_every_fence_names_its_language():
    unnamed = [line for language, line, _ in _blocks() if not language]
    assert not unnamed, (f"README.md fences at lines {unnamed} name no language: use ```python "
                         "for code the tests run, ```bash / ```text for the rest")


def test_the_readme_has_python_examples():
    assert len(PYTHON) >= 5, f"expected the README's examples, found {len(PYTHON)} python blocks"


def test_marked_step_counts_are_rewritten():
    body = "steps = 200  # tests/test_readme.py runs 3\nprint(steps)\n"
    assert _runnable(body).splitlines()[0] == "steps = 3  # tests/test_readme.py runs 3"


@pytest.mark.parametrize("line, body", PYTHON, ids=[f"README.md:{line}" for line, _ in PYTHON])
def test_python_block_runs(line, body):
    # Leading newlines put the block at its README line numbers in a traceback.
    code = compile("\n" * (line - 1) + _runnable(body), str(README), "exec")
    exec(code, {"__name__": "__readme__"})  # noqa: S102 (the README's own examples)
