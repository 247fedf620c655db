"""``python -m bench.gpu``: the prepared check for a lent GPU, in one short call.

Runs ``pytest -m gpu`` (every backend test on its cuda parameter), then every speed suite on cupy
arrays, and writes the logs and JSON under ``$OUT`` (or ``bench/results/gpu``). Each step has a
time limit so the whole call stays under 8 minutes on one H200.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from . import _harness
from .__main__ import SUITES

TEST_LIMIT_S = 240
SUITE_LIMIT_S = 50


def main() -> int:
    out = Path(os.environ.get("OUT") or _harness.RESULTS_DIR / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    status = 0
    with open(out / "pytest_gpu.log", "w") as log:
        try:
            status = subprocess.run(
                [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-x", "--no-header", "tests"],
                stdout=log, stderr=subprocess.STDOUT, timeout=TEST_LIMIT_S, env=env).returncode
        except subprocess.TimeoutExpired:
            status = 124
    print(f"pytest -m gpu: exit {status} ({time.perf_counter() - start:.0f} s)", flush=True)
    print((out / "pytest_gpu.log").read_text()[-3000:], flush=True)
    for suite in SUITES:
        step = time.perf_counter()
        cmd = [sys.executable, "-m", "bench", suite, "--gpu", "--results", str(out)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=SUITE_LIMIT_S,
                                    env=env)
            text, code = result.stdout + result.stderr[-2000:], result.returncode
        except subprocess.TimeoutExpired as exc:
            text, code = str(exc.stdout or "") + "\n(timed out)", 124
        (out / f"{suite}.log").write_text(text)
        print(f"\n== {suite}: exit {code} ({time.perf_counter() - step:.0f} s)\n{text[-4000:]}",
              flush=True)
        status = status or code
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
