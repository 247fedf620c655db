"""``bench/_harness``: the result files ``python -m bench`` writes are strict JSON and replace
the previous file whole or not at all (``write_json``); a paired case is timed in alternation
with its baseline and its ratio is the median of the pairs' ratios (``time_pair``), checked on a
simulated clock (no timed assertion)."""

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

from bench import _harness  # noqa: E402
from bench._harness import Case, Config, run_cases, write_json  # noqa: E402


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


def _clocked(monkeypatch, costs):
    """A simulated ``perf_counter_ns``: each call of ``fns[name]`` advances it by the next of
    ``costs[name]`` (cycled); the calls are logged in order."""
    now, log = [0], []
    monkeypatch.setattr(_harness.time, "perf_counter_ns", lambda: now[0])
    monkeypatch.setattr(_harness, "SETTLE_S", 0)
    counts = {name: 0 for name in costs}

    def make(name):
        def fn():
            seq = costs[name]
            now[0] += seq[counts[name] % len(seq)]
            counts[name] += 1
            log.append(name)
        return fn

    return {name: make(name) for name in costs}, log


def test_a_paired_case_alternates_with_its_baseline(monkeypatch):
    fns, log = _clocked(monkeypatch, {"base": [3_000_000], "fn": [1_000_000]})
    config = Config(repeats=3, min_time_s=0.0)
    rows = run_cases([Case("s", "base", fn=fns["base"]),
                      Case("s", "fn", fn=fns["fn"], baseline="base", paired=True, target=2.5)],
                     config, progress=lambda *a: None)
    row = rows[1]
    assert row["ratio"] == pytest.approx(3.0) and row["met"] is True
    assert row["seconds"] == pytest.approx(1e-3)
    assert row["baseline ms (paired)"] == pytest.approx(3.0)
    # After the base case's own timing (2 + 3 calls) and both warm-ups (2 calls each),
    # 2 * repeats + 1 pairs, the order within a pair alternating.
    pairs = log[5 + 4:]
    assert pairs == ["base", "fn", "fn", "base"] * 3 + ["base", "fn"]


def test_the_paired_ratio_is_immune_to_a_slow_spell(monkeypatch):
    # The host runs at a third of its speed from 16 ms on (simulated time): timed one after
    # the other, the baseline sees the fast host and the case the slow one; in alternation both
    # members of every pair see the same host, and the median of the pairs' ratios stays 3.
    now = [0]
    monkeypatch.setattr(_harness.time, "perf_counter_ns", lambda: now[0])
    monkeypatch.setattr(_harness, "SETTLE_S", 0)

    def costing(ns):
        def fn():
            now[0] += ns * (3 if now[0] >= 16_000_000 else 1)
        return fn

    base, fn = costing(3_000_000), costing(1_000_000)
    apart = _harness.time_cpu(base, 3, 0.0) / _harness.time_cpu(fn, 3, 0.0)
    now[0] = 0
    *_, ratio = _harness.time_pair(base, fn, 3, 0.0)
    assert apart == pytest.approx(1.0) and ratio == pytest.approx(3.0)
