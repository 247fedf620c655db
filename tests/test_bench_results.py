"""``bench/_harness.write_json``: the result files ``python -m bench`` writes are strict JSON and
replace the previous file whole or not at all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# bench/ is the checkout's (it is not installed): found at the end of the path, so that lowbit
# stays the installed one.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from bench._harness import Config, write_json  # noqa: E402


def test_non_finite_values_are_written_as_null(tmp_path):
    rows = [{"case": "a", "ratio": float("nan"), "seconds": 0.5,
             "info": {"peak": float("inf"), "sizes": (1, float("-inf"))}}]
    path = write_json("suite", rows, Config(), tmp_path)
    text = path.read_text()
    payload = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    row = payload["rows"][0]
    assert row["ratio"] is None and row["seconds"] == 0.5
    assert row["info"] == {"peak": None, "sizes": [1, None]}
    assert [p.name for p in tmp_path.iterdir()] == ["suite.json"]  # no temporary left behind


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = write_json("suite", [{"case": "old"}], Config(), tmp_path)
    before = path.read_text()

    def broken(self, text, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", broken)
    with pytest.raises(OSError, match="disk full"):
        write_json("suite", [{"case": "new"}], Config(), tmp_path)
    monkeypatch.undo()
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["suite.json"]
