"""The prepared GPU check ``bench/gpu.py``, rehearsed here: ``python -m bench.gpu --dry-run``.

The dry run takes every step of the GPU call: environment, compile every kernel module (cudasim
builds), the cudasim tests of a few ops under the per-test limit, a suite at quick shapes, and
the kernel rows of ``bench/gpu_kernels.py`` at tiny shapes on cudasim; the other tests drive its
failure paths (a test past its limit, zero device tests, no cupy, a kernel row that raises) and
the offline install of carried wheels.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

import lowbit
from lowbit import _cudasim

REPO = Path(__file__).resolve().parent.parent
# bench/ is the checkout's (it is not installed): found at the end of the path, so that lowbit
# stays the installed one.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from bench import gpu, gpu_kernels  # noqa: E402
from bench._harness import Config  # noqa: E402

pytestmark = pytest.mark.skipif(not _cudasim.available(),
                                reason=f"cudasim unavailable: {_cudasim.unavailable_reason()}")


def _check(out: Path, *args: str, timeout: float = 150) -> tuple[int, dict, str]:
    env = {**os.environ, "OUT": str(out)}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    report = json.loads((out / "gpu.json").read_text())
    return proc.returncode, report, proc.stdout + proc.stderr


def _timed_or_skipped_for_a_reason(row) -> bool:
    """A kernel row of the dry run was timed, or skipped as the dry run's (ceilings, CUDA-only
    paths), or is a peer's whose package (torch, fla: not in the test extra) is missing."""
    why = row.get("skipped", "")
    return row.get("seconds", 0) > 0 or "dry run" in why or (
        "not installed" in why and any(peer in row["case"] for peer in ("torch", "fla")))


def test_dry_run_takes_every_step_and_passes(tmp_path):
    # The kernel groups take shares of the deadline: 640 s leaves compile (every module built
    # cold under cudasim: 20 s on a 2-core EPYC, over 30 s on a slow host, where 320 s failed
    # it) and tests theirs; unused time flows on, so a longer deadline costs no time.
    code, report, output = _check(tmp_path, "--dry-run", "--deadline", "640", timeout=680)
    assert code == 0, output[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu.json", "gpu.log", "junit.xml"]
    env = report["environment"]
    assert env["dry_run"] and env["numpy"] and env["python"] and "cudasim" in env["device"]
    steps = report["steps"]
    assert list(steps) == ["compile", "tests", "main", "adamw", *gpu.KERNEL_SUITES]
    # The main job: the three configurations trained (quick shape), then its targets.
    main = steps["main"]["rows"]
    assert steps["main"]["exit"] == 0
    assert [r["case"] for r in main[:3]] == ["fp32", "ternary+int8", "ternary+int8+sparse"]
    assert all(r["tokens/s"] > 0 and r["val loss"] > 0 for r in main[:3])
    assert len(main) == 3 + 5 and all(r["case"].startswith("target: ") for r in main[3:])
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
    # Every kernel row ran its code path: checked and timed on cudasim, or skipped (ceilings,
    # CUDA peers) with the reason; none raised.
    for step in gpu.KERNEL_SUITES:
        rows = steps[step]["rows"]
        assert steps[step]["exit"] == 0 and rows, step
        assert all(row["suite"] == step and "error" not in row for row in rows), rows
        assert all(_timed_or_skipped_for_a_reason(row) for row in rows), rows
        timed = [r for r in rows if "skipped" not in r]
        assert timed and all(set(r) & set(gpu_kernels.UNITS) for r in timed), rows
    # Float results record their error against the float64 reference (products: bit for bit).
    for step in ("gpu_kernels.attention", "gpu_kernels.scans"):
        lowbit_rows = [r for r in steps[step]["rows"] if r["case"].endswith(("fp32", "lowbit"))]
        assert lowbit_rows, steps[step]["rows"]
        for row in lowbit_rows:
            errors = [value for key, value in row.items() if key.endswith("vs float64")]
            assert errors and max(errors) <= gpu_kernels.REF_RTOL, row
    assert report["wheels"]["folder"]


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


def test_a_failing_kernel_row_is_recorded_and_the_next_rows_run(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel fault")

    monkeypatch.setattr(lowbit, "packed_matmul", broken)
    emitted = []
    rows = gpu_kernels.run_group("gemm", Config(quick=True), progress=lambda s: None,
                                 emit=lambda r: emitted.append([dict(x) for x in r]))
    assert [r["case"].split()[2] for r in rows] == ["f16", "ternary/int8", "int8/int8"]
    assert rows[0]["seconds"] > 0 and "error" not in rows[0]
    assert all(r["error"] == "RuntimeError: kernel fault" and "seconds" not in r
               for r in rows[1:])
    # Each row is written out as unfinished before it runs, then replaced by its result.
    assert emitted[0] == [{"suite": "gpu_kernels.gemm", "case": rows[0]["case"],
                           "error": "unfinished: killed at the step's limit, or crashed"}]
    assert len(emitted) == 2 * len(rows) and emitted[-1] == rows


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel of one module ``name``."""
    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "ANSWER = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n"
                                     f"{info}/RECORD,,\n")
    return path


def test_carried_wheels_are_installed_offline_unless_present(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(folder, "lowbit_check_wheel")
    (folder / "numpy-0.0-py3-none-any.whl").write_bytes(b"")  # installed here: left alone
    with open(tmp_path / "log", "w") as log:
        result = gpu.install_wheels(folder, tmp_path / "site", log, dict(os.environ))
    assert result["exit"] == 0, (tmp_path / "log").read_text()
    assert result["installed"] == ["lowbit_check_wheel-0.1-py3-none-any.whl"]
    assert [p.split()[0] for p in result["present"]] == ["numpy"]
    assert (tmp_path / "site" / "lowbit_check_wheel.py").read_text() == "ANSWER = 42\n"
    assert gpu.install_wheels(tmp_path / "none", tmp_path / "site", log, {})["installed"] == []
