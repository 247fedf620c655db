"""The prepared GPU check ``bench/gpu.py``, rehearsed on this CPU: ``python -m bench.gpu --dry-run``.

The dry run takes every step of the GPU call: environment, compile every kernel module (cudasim
builds), the cudasim tests of a few ops under the per-test limit, and a suite at quick shapes;
the other tests drive its failure paths (a test past its limit, zero device tests, no cupy).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from lowbit import _cudasim

pytestmark = pytest.mark.skipif(not _cudasim.available(),
                                reason=f"cudasim unavailable: {_cudasim.unavailable_reason()}")

REPO = Path(__file__).resolve().parent.parent


def _check(out: Path, *args: str, timeout: float = 150) -> tuple[int, dict, str]:
    env = {**os.environ, "OUT": str(out)}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    report = json.loads((out / "gpu.json").read_text())
    return proc.returncode, report, proc.stdout + proc.stderr


def test_dry_run_takes_every_step_and_passes(tmp_path):
    code, report, output = _check(tmp_path, "--dry-run", "--deadline", "120")
    assert code == 0, output[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json", "gpu.log", "junit.xml"]
    env = report["environment"]
    assert env["dry_run"] and env["numpy"] and env["python"] and "cudasim" in env["device"]
    steps = report["steps"]
    assert list(steps) == ["compile", "tests", "adamw"]
    # Every op's kernel module was built and timed apart.
    launchers = sorted(p.parent.name for p in (REPO / "lowbit" / "ops").glob("*/_cuda.py"))
    assert len(steps["compile"]["compile_s"]) == len(launchers)
    tests = steps["tests"]
    assert tests["device_tests_ran"] > 0 and tests["counts"].get("failed", 0) == 0
    cases = ET.parse(tmp_path / "junit.xml").getroot().findall("testcase")
    assert len(cases) == sum(tests["counts"].values())
    assert all("cudasim" in c.get("name") for c in cases)
    assert steps["adamw"]["exit"] == 0 and steps["adamw"]["rows"]
    assert all(row["suite"] == "adamw" for row in steps["adamw"]["rows"])
    assert report["failed_steps"] == []
    # Progress lines of the suites go to stderr: the log keeps them.
    assert "adamw/copy ..." in (tmp_path / "gpu.log").read_text()


def test_a_test_past_its_limit_is_reported_and_the_rest_still_runs(tmp_path):
    tests = tmp_path / "check_tests"
    tests.mkdir()
    (tests / "test_hang.py").write_text(
        "import sys, time\n"
        "def test_a_cudasim():\n    pass\n"
        "def test_b_cudasim():\n    print('about to hang', file=sys.stderr)\n"
        "    time.sleep(60)\n"
        "def test_c_cudasim():\n    assert 1 + 1 == 3\n"
        "def test_d_cudasim():\n    pass\n")
    out = tmp_path / "out"
    code, report, output = _check(out, "--dry-run", "--tests", str(tests), "--test-limit", "3",
                                  "--suites", "--deadline", "60")
    assert code == 1, output[-3000:]
    step = report["steps"]["tests"]
    assert [h.split("::")[1] for h in step["hung"]] == ["test_b_cudasim"]
    assert step["counts"] == {"passed": 2, "failed": 2}
    assert len(step["runs"]) == 2 and report["failed_steps"] == ["tests"]
    log = (out / "gpu.log").read_text()
    # The killed test's stderr and faulthandler's traceback are in the log.
    assert "about to hang" in log and "Timeout" in log and "in test_b_cudasim" in log
    names = {c.get("name"): c for c in ET.parse(out / "junit.xml").getroot()}
    assert names["test_b_cudasim"].find("failure") is not None
    assert names["test_c_cudasim"].find("failure") is not None
    assert names["test_d_cudasim"].find("failure") is None


def test_zero_device_tests_fail_the_call(tmp_path):
    tests = tmp_path / "check_tests"
    tests.mkdir()
    (tests / "test_skip.py").write_text(
        "import pytest\n"
        "def test_cudasim():\n    pytest.skip('no device')\n")
    code, report, output = _check(tmp_path / "out", "--dry-run", "--tests", str(tests),
                                  "--suites", "--deadline", "60")
    assert code == 1, output[-3000:]
    assert report["steps"]["tests"]["device_tests_ran"] == 0
    assert report["failed_steps"] == ["tests"]


def test_without_cupy_the_gpu_call_fails_loudly(tmp_path):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed here")
    code, report, output = _check(tmp_path, "--deadline", "30")
    assert code == 2
    assert "cupy does not import" in report["error"] and "cupy" in output
