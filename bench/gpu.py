"""``python -m bench.gpu [--dry-run] [--deadline S]``: the prepared check for a GPU machine.

One call gives the whole picture: the environment (GPU, compute capability, driver, CUDA runtime,
CuPy, NumPy), every kernel module compiled once up front and timed apart (a cold kernel cache costs
its compile time there, not inside a test or a timed row), ``pytest -m gpu`` with a per-test time
limit and without ``-x``, then the main job (``main``: ``bench/train.py``'s three configurations
trained at the main job's shape on cupy arrays, with its table and targets, as ``python -m bench
--gpu``), then every speed suite of ``bench/`` on cupy arrays (``train``: one timed training
step per configuration; ``bitnet``: a small BitNet model's decode tokens/s at
contexts 128 and 1024, its logits checked first against the host's), then the kernel rows of
``bench/gpu_kernels.py``, one step per group (``gpu_kernels.gemv``, ``.gemm``, ``.attention``,
``.scans``; ``--suites gpu_kernels`` names them all). First, wheels in
``bench/results/wheels/`` (``--wheels``: for a machine without network access) of distributions
the environment lacks, e.g. fla-core for the scans' peer, are installed with ``pip install
--no-deps --no-index --target`` into the call's temporary folder, which goes on every step's
``PYTHONPATH``. The steps share one deadline: each gets its share of the time that is
left, so the last suite is not the first to be lost. Every step runs in a subprocess whose stdout
and stderr go to a file, so a step killed at its limit still leaves a readable log; a kernel group
also writes its rows as it finishes them, so it keeps those.

Results go to ``$OUT`` (default ``bench/results/gpu``), three files: ``gpu.log`` (every step's
output), ``gpu.json`` (what produced it: ``_harness.metadata``; environment, wheels, compile
times, test outcomes, every suite's rows), ``junit.xml`` (the tests). The exit status is
non-zero when cupy does not import, no device is visible, zero GPU tests ran, or any step failed
(a kernel row that raised fails its group's step).

``--dry-run`` rehearses the same steps on this CPU (CI runs it, ``tests/test_gpu_check.py``):
the kernels are built and the tests run on the cudasim backend (the cudasim tests of a few ops),
a suite and the main job at ``--quick`` shapes on numpy arrays, since cudasim is far too slow
for their shapes, and the kernel rows at tiny shapes on cudasim (the ceilings and CUDA peers skipped, each
saying so). The pytest plugin of the tests step is this module too (``-p bench.gpu``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from . import _harness
from .__main__ import SUITES
from .gpu_kernels import GROUPS, run_group

#: Steps of the kernel rows (``bench/gpu_kernels.py``): each group in its own process.
KERNEL_SUITES = tuple(f"gpu_kernels.{group}" for group in GROUPS)

#: Default wall-clock budget of the whole call, in seconds.
DEFAULT_DEADLINE_S = 420
#: Time kept back from the steps for writing the results.
RESERVE_S = 5
#: Relative share of the deadline of each step; unused time flows to the steps after it.
#: The scans' group compiles and autotunes fla's Triton kernels on its first calls.
WEIGHTS = {"compile": 1.0, "tests": 4.0, "main": 3.0, "train": 2.0, "gpu_kernels.attention": 1.5,
           "gpu_kernels.scans": 3.0}
#: Per-test limit: a test still running after this is reported as timed out, its tracebacks
#: dumped, and the tests after it run in a fresh pytest process.
TEST_LIMIT_S = 60
#: The dry run's tests and suites: cudasim tests of a few ops, a suite that is quick on numba.
DRY_TESTS = ("tests/test_pack_bits.py", "tests/test_quantize.py")
DRY_SUITES = ("main", "adamw", *KERNEL_SUITES)
#: Wheels to install before the steps (offline, from this folder), when the folder exists.
WHEELS_DIR = Path(__file__).resolve().parent / "results" / "wheels"
WHEELS_LIMIT_S = 120
#: Environment variables of the pytest plugin below.
PROGRESS_ENV = "LOWBIT_GPU_CHECK_PROGRESS"
DONE_ENV = "LOWBIT_GPU_CHECK_DONE"
LIMIT_ENV = "LOWBIT_GPU_CHECK_TEST_LIMIT"


# ------------------------------------------------------------------------------------------
# The pytest plugin of the tests step (loaded with -p bench.gpu; inert otherwise)
# ------------------------------------------------------------------------------------------

def pytest_collection_modifyitems(config, items):
    """Deselect the tests an earlier pytest process of this step already ran."""
    done_file = os.environ.get(DONE_ENV)
    if not done_file or not Path(done_file).exists():
        return
    done = set(Path(done_file).read_text().splitlines())
    kept = [item for item in items if item.nodeid not in done]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = kept


def _record(entry: dict) -> None:
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())


def pytest_runtest_logstart(nodeid, location):
    _record({"start": nodeid})


def pytest_runtest_logreport(report):
    # One outcome per test: the call phase, or the setup phase when it failed or skipped.
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        message = str(report.longrepr)[-4000:] if report.longrepr else ""
        _record({"test": report.nodeid, "outcome": report.outcome,
                 "seconds": round(report.duration, 3), "message": message,
                 "gpu": "gpu" in report.keywords})


def pytest_runtest_setup(item):
    # A hung kernel blocks in C, where no Python signal handler runs; faulthandler's watchdog
    # thread still dumps every traceback and ends the process, and the runner goes on after it.
    # Output is teed (--capture=tee-sys), so what the killed test printed is in the log too.
    limit = os.environ.get(LIMIT_ENV)
    if limit:
        import faulthandler

        faulthandler.dump_traceback_later(float(limit), exit=True, file=sys.__stderr__)


def pytest_runtest_teardown(item, nextitem):
    if os.environ.get(LIMIT_ENV):
        import faulthandler

        faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------------------------------
# Steps
# ------------------------------------------------------------------------------------------

class Deadline:
    """The call's one deadline, shared out between the steps still to run."""

    def __init__(self, seconds: float, weights: list[float]):
        self.end = time.monotonic() + seconds
        self.weights = list(weights)

    def left(self) -> float:
        return self.end - time.monotonic()

    def share(self) -> float:
        """Seconds for the next step: its weight's part of what is left (then pop it)."""
        weight = self.weights.pop(0)
        total = weight + sum(self.weights)
        return max(1.0, (self.left() - RESERVE_S) * weight / total)


def run_step(name: str, cmd: list[str], limit: float, log, env: dict) -> dict:
    """Run ``cmd`` with its stdout and stderr in a file; kill its process group at ``limit``.

    Returns ``{"exit", "seconds", "timed_out"}``; the step's output (decoded, whatever it held
    when it stopped) is appended to ``log`` under a header.
    """
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, timed_out = proc.wait(), True
        out.seek(0)
        text = out.read().decode(errors="replace")
    seconds = time.monotonic() - start
    status = f"timed out after {limit:.0f} s" if timed_out else f"exit {code}"
    header = f"\n===== {name}: {status} ({seconds:.1f} s)\n$ {shlex.join(cmd)}\n"
    log.write(header + text + ("\n(killed at its time limit)\n" if timed_out else ""))
    log.flush()
    print(header.strip() + "\n" + text[-2000:], flush=True)
    return {"exit": 124 if timed_out else code, "seconds": round(seconds, 2),
            "timed_out": timed_out}


def environment(dry_run: bool) -> dict:
    """Versions and the device. Raises RuntimeError when cupy or a device is missing (GPU)."""
    import numpy as np

    info = {"python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform(), "dry_run": dry_run}
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:
        info["numba"] = None
    if dry_run:
        from lowbit import _cudasim

        if not _cudasim.available():
            raise RuntimeError(f"the dry run needs cudasim: {_cudasim.unavailable_reason()}")
        info["device"] = "cudasim (CUDA kernels compiled by g++, run on the CPU)"
        return info
    try:
        import cupy
    except Exception as exc:
        raise RuntimeError(f"cupy does not import: {exc!r}") from None
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:
        raise RuntimeError(f"no CUDA device is visible: {exc!r}") from None
    if count < 1:
        raise RuntimeError("no CUDA device is visible (getDeviceCount() == 0)")
    props = runtime.getDeviceProperties(0)
    name = props["name"]
    info.update(
        cupy=cupy.__version__, devices=count,
        device=name.decode() if isinstance(name, bytes) else str(name),
        compute_capability=f"{props['major']}.{props['minor']}",
        multiprocessors=props["multiProcessorCount"],
        memory_gib=round(props["totalGlobalMem"] / 2**30, 1),
        shared_per_block_optin=props.get("sharedMemPerBlockOptin"),
        driver=runtime.driverGetVersion(), cuda_runtime=runtime.runtimeGetVersion())
    from lowbit import _kernels

    info.update(compiler=_kernels.compiler(), nvrtc_options=list(_kernels.NVRTC_OPTIONS))
    try:
        info["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    except Exception as exc:  # reported, not fatal: the compile step shows what NVRTC does
        info["nvrtc"] = f"unknown ({exc!r})"
    return info


def compile_all(dry_run: bool) -> dict:
    """Compile (or build for cudasim) every kernel of every op; seconds per module."""
    import pkgutil

    import numpy as np

    import lowbit.ops
    from lowbit import _kernels

    like = np.empty(1, np.float32)
    if not dry_run:
        import cupy

        like = cupy.empty(1, cupy.float32)
    times = {}
    for info in sorted(pkgutil.iter_modules(lowbit.ops.__path__), key=lambda i: i.name):
        try:
            launcher = importlib.import_module(f"lowbit.ops.{info.name}._cuda")
        except ModuleNotFoundError as exc:
            if exc.name != f"lowbit.ops.{info.name}._cuda":
                raise
            continue
        start = time.perf_counter()
        mod = _kernels.module(launcher.SOURCE, launcher.NAME_EXPRESSIONS, like)
        for name in launcher.NAME_EXPRESSIONS:
            mod.get_function(name)
        times[launcher.SOURCE] = round(time.perf_counter() - start, 3)
        print(f"{launcher.SOURCE}: {times[launcher.SOURCE]:.2f} s", flush=True)
    return times


def run_suite(name: str, dry_run: bool, to: Path) -> list[dict]:
    """The rows of one suite: on cupy arrays, or (dry run) at ``--quick`` shapes on numpy; a
    kernel group writes its rows to ``to`` as it goes (replacing the file: never half written)."""
    config = _harness.Config(quick=dry_run, gpu=not dry_run)

    def progress(message):
        print(message, file=sys.stderr, flush=True)

    def emit(rows):
        partial = to.with_suffix(".partial")
        partial.write_text(json.dumps(rows, default=str))
        os.replace(partial, to)

    if name in KERNEL_SUITES:
        rows = run_group(name.partition(".")[2], config, progress, emit)
    else:
        module = importlib.import_module(f"bench.{name}")
        rows = _harness.run_cases(module.cases(config), config, progress=progress, family=name)
    print(_harness.table(rows), flush=True)
    return rows


def tests_step(args, limit: float, log, env: dict, work: Path) -> dict:
    """``pytest -m gpu`` (dry run: the cudasim tests of ``DRY_TESTS``), restarted after a test
    that hit its limit, until every test ran or the step's time is spent."""
    progress, done = work / "progress.jsonl", work / "done.txt"
    end = time.monotonic() + limit
    selection = ["-k", "cudasim"] if args.dry_run else ["-m", "gpu"]
    selection += args.tests or (list(DRY_TESTS) if args.dry_run else ["tests"])
    env = {**env, PROGRESS_ENV: str(progress), DONE_ENV: str(done),
           LIMIT_ENV: str(args.test_limit)}
    runs, results, hung, seen = [], {}, [], 0
    if importlib.util.find_spec("pytest") is None:
        log.write("\n===== tests: pytest is not installed in this image; no test can run\n")
        return {"runs": [{"exit": 1, "seconds": 0, "timed_out": False}], "counts": {},
                "device_tests_ran": 0, "hung": [], "results": [], "error": "no pytest"}
    while time.monotonic() < end - 1:
        # A test module that cannot import (a missing optional package) must not stop the rest.
        cmd = [sys.executable, "-m", "pytest", "-p", "bench.gpu", "-q", "-p", "no:cacheprovider",
               "--capture=tee-sys", "--continue-on-collection-errors", "--no-header",
               *selection]
        runs.append(run_step(f"tests (run {len(runs) + 1})", cmd, end - time.monotonic(), log,
                             env))
        started = None
        lines = progress.read_text().splitlines() if progress.exists() else []
        for line in lines[seen:]:
            entry = json.loads(line)
            if "start" in entry:
                started = entry["start"]
            else:
                results[entry["test"]] = entry
                started = None if started == entry["test"] else started
        seen = len(lines)
        if started is None or runs[-1]["timed_out"]:
            break
        # The process died inside ``started`` (its limit, or a crash): record it, go on after it.
        hung.append(started)
        results[started] = {"test": started, "outcome": "failed", "seconds": args.test_limit,
                            "message": "timed out or crashed the test process; see gpu.log",
                            "gpu": not args.dry_run}
        done.write_text("\n".join(results) + "\n")
    counts = {}
    for entry in results.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    ran = sum(1 for e in results.values() if e["outcome"] != "skipped"
              and (e["gpu"] or args.dry_run))
    return {"runs": runs, "counts": counts, "device_tests_ran": ran, "hung": hung,
            "results": list(results.values())}


def write_junit(path: Path, results: list[dict]) -> None:
    suite = ET.Element("testsuite", name="bench.gpu", tests=str(len(results)))
    for entry in results:
        module, _, name = entry["test"].partition("::")
        case = ET.SubElement(suite, "testcase", classname=module, name=name,
                             time=str(entry["seconds"]))
        if entry["outcome"] == "failed":
            ET.SubElement(case, "failure", message="failed").text = entry["message"]
        elif entry["outcome"] == "skipped":
            ET.SubElement(case, "skipped", message=entry["message"][-300:])
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def main_job(dry_run: bool) -> list[dict]:
    """The main job's rows (``bench/train.py``'s comparison at its own shape: losses, tokens/s,
    peak step memory, saved bytes) and its targets, on cupy arrays (dry run: ``--quick`` on
    numpy; its targets are for the full shape and are reported, not required, there)."""
    from lowbit.models import train as training

    from . import train

    config = _harness.Config(quick=dry_run, gpu=not dry_run)
    run = train.shape(config)
    corpus = training.default_corpus()

    def progress(message):
        print(message, file=sys.stderr, flush=True)

    rows, _ = train.comparison(run, corpus, progress=progress, xp=_harness.xp(config))
    rows = [{"suite": "main", **r} for r in rows]
    print(_harness.table([{k: v for k, v in r.items() if k != "sample"} for r in rows]),
          flush=True)
    for what, measured, rel, bound, met in train.targets(rows, training.unigram_entropy(corpus)):
        print(f"  {'PASS' if met else 'FAIL'}  {what}: {measured:.4g} (target {rel} {bound:.4g})",
              flush=True)
        rows.append({"suite": "main", "case": f"target: {what}", "measured": measured,
                     "bound": bound, "relation": rel, "met": bool(met)})
    return rows


def _worker(args) -> int:
    """``--step compile|main|SUITE``: one step, run in its own process; results to ``--to``."""
    to = Path(args.to)
    result = (compile_all(args.dry_run) if args.step == "compile" else
              main_job(args.dry_run) if args.step == "main" else
              run_suite(args.step, args.dry_run, to))
    to.write_text(json.dumps(result, default=str))
    # A kernel row that failed is recorded in its row, and fails its step.
    return 1 if args.step in KERNEL_SUITES and any("error" in row for row in result) else 0


def install_wheels(folder: Path, target: Path, log, env: dict) -> dict:
    """Install, offline and without dependencies, the wheels in ``folder`` of distributions this
    environment lacks, into ``target`` (which the caller puts on the steps' ``PYTHONPATH``)."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    present, wanted = [], []
    for wheel in wheels:
        name = wheel.name.split("-")[0]
        try:
            present.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            wanted.append(wheel)
    result = {"folder": str(folder), "present": present, "installed": [w.name for w in wanted]}
    if wanted:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
               "--no-compile", "--target", str(target), *map(str, wanted)]
        result.update(run_step("wheels", cmd, WHEELS_LIMIT_S, log, env))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="rehearse every step on this CPU (cudasim kernels, quick suites)")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help=f"seconds for the whole call (default {DEFAULT_DEADLINE_S})")
    parser.add_argument("--test-limit", type=float, default=TEST_LIMIT_S,
                        help=f"seconds one test may run (default {TEST_LIMIT_S})")
    parser.add_argument("--suites", nargs="*", default=None, metavar="SUITE",
                        help="suites to run (default: main, the main job, then every suite, "
                             "then the kernel groups; "
                             "gpu_kernels names every group; dry run: "
                             f"{' '.join(DRY_SUITES)})")
    parser.add_argument("--tests", nargs="*", default=None, metavar="PATH",
                        help="test files or folders (default: tests; dry run: "
                             f"{' '.join(DRY_TESTS)})")
    parser.add_argument("--wheels", type=Path, default=WHEELS_DIR,
                        help=f"folder of wheels to install first (default {WHEELS_DIR})")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--to", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        return _worker(args)
    suites = args.suites if args.suites is not None else (DRY_SUITES if args.dry_run
                                                          else ("main",) + SUITES + KERNEL_SUITES)
    suites = [s for name in suites
              for s in (KERNEL_SUITES if name == "gpu_kernels" else (name,))]
    known = ("main",) + SUITES + KERNEL_SUITES
    unknown = sorted(set(suites) - set(known))
    if unknown:
        parser.error(f"unknown suites {unknown}; choose from gpu_kernels, {', '.join(known)}")
    out = Path(os.environ.get("OUT") or _harness.RESULTS_DIR / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    report = {"deadline_s": args.deadline, "test_limit_s": args.test_limit,
              "metadata": _harness.metadata(), "steps": {}}
    started = time.monotonic()

    def save():
        report["total_s"] = round(time.monotonic() - started, 1)
        (out / "gpu.json").write_text(json.dumps(report, indent=1, default=str))

    try:
        report["environment"] = environment(args.dry_run)
    except RuntimeError as exc:
        report["error"] = str(exc)
        (out / "gpu.log").write_text(f"{exc}\n")
        save()
        print(f"bench.gpu: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report["environment"], indent=1), flush=True)
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    deadline = Deadline(args.deadline, [WEIGHTS["compile"], WEIGHTS["tests"]]
                        + [WEIGHTS.get(s, 1.0) for s in suites])
    failed = []
    me = [sys.executable, "-m", "bench.gpu"] + (["--dry-run"] if args.dry_run else [])
    with open(out / "gpu.log", "w") as log, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        log.write(json.dumps(report["environment"], indent=1) + "\n")
        report["wheels"] = install_wheels(args.wheels, work / "site", log, env)
        if report["wheels"].get("exit"):
            failed.append("wheels")
        elif report["wheels"]["installed"]:
            env["PYTHONPATH"] = os.pathsep.join([str(work / "site"), env["PYTHONPATH"]])
        for step in ["compile", "tests", *suites]:
            limit = deadline.share()
            if step == "tests":
                result = tests_step(args, limit, log, env, work)
                write_junit(out / "junit.xml", result.pop("results"))
                zero = result["device_tests_ran"] == 0
                if zero:
                    log.write("\nzero device tests ran: every one skipped or none collected\n")
                if zero or result["hung"] or any(
                        r["exit"] not in (0, 5) for r in result["runs"]) or result["counts"].get(
                        "failed"):
                    failed.append(step)
            else:
                to = work / f"{step}.json"
                result = run_step(step, me + ["--step", step, "--to", str(to)], limit, log, env)
                if to.exists():
                    result["compile_s" if step == "compile" else "rows"] = json.loads(
                        to.read_text())
                if result["exit"] != 0:
                    failed.append(step)
            report["steps"][step] = result
            save()
    report["failed_steps"] = failed
    save()
    print(f"bench.gpu: {'FAILED ' + ', '.join(failed) if failed else 'all steps passed'} "
          f"({report['total_s']} s); results in {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
