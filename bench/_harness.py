"""Cases, timing and tables shared by every suite (``bench/<suite>.py``).

A suite module defines ``cases(config) -> iterable of Case``. Each case is checked against the
reference (``check``) before anything is timed; its time is the median over repeats
(``time.perf_counter_ns`` on CPU, CUDA events through ``cupyx.profiler.benchmark`` on GPU), and
its ratio is the named baseline's median divided by its own, measured in the same run.
``python -m bench`` prints the tables and writes JSON under ``bench/results/``;
``bench/test_bench.py`` runs the same cases under pytest-benchmark.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lowbit.io._files import atomic_path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass
class Config:
    """What to run: ``quick`` (CI-sized shapes), ``gpu`` (cupy arrays), forced ``backend``."""

    quick: bool = False
    gpu: bool = False
    backend: str | None = None
    repeats: int = 7
    min_time_s: float = 0.2


def xp(config: Config):
    """The array module of a run: cupy with ``config.gpu``, else numpy."""
    if config.gpu:
        import cupy

        return cupy
    return np


@dataclasses.dataclass
class Case:
    """One timed (or report-only) row of a suite.

    Attributes:
        suite, name: where the row is printed.
        fn: zero-argument callable that is timed; ``None`` for a report-only row.
        check: zero-argument callable run once before timing; raises on a wrong result.
        baseline: name of the case in the same suite this one is compared with.
        target: minimum speedup over the baseline (``baseline_time / time``), reported PASS/FAIL.
        nbytes: bytes a call moves, for GB/s; flops: floating-point operations, for GFLOP/s.
        info: extra columns (formats, byte counts, errors, ...).
        paired: time this case and its baseline in alternation (``time_pair``), the ratio the
            median of the pairs' ratios: for rows whose verdict a drift in the host's speed over
            a few seconds would otherwise flip (the two calls of a pair see the same machine). On a
            GPU (CUDA events: no host drift) the case is timed on its own.
    """

    suite: str
    name: str
    fn: Callable[[], Any] | None = None
    check: Callable[[], None] | None = None
    baseline: str | None = None
    target: float | None = None
    nbytes: float | None = None
    flops: float | None = None
    info: dict = dataclasses.field(default_factory=dict)
    paired: bool = False


#: Kernel families whose first call has been announced in this process (``first_call``).
_ANNOUNCED: set = set()
#: How many announced first calls are running (a first call nested in one is part of it).
_announcing = [0]


def _announce(family: str) -> bool:
    """Print the line before the first (cold) call of ``family``; False (nothing printed) when
    it was announced before or runs inside an announced first call."""
    if family in _ANNOUNCED or _announcing[0]:
        return False
    _ANNOUNCED.add(family)
    print(f"compiling {family} kernels (first call) ...", file=sys.stderr, flush=True)
    return True


def _announced_took(family: str, seconds: float) -> None:
    print(f"  {family}: first call took {seconds:.1f} s", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _cold(announced: bool):
    """The body runs as (part of) an announced first call: first calls nested in it are quiet."""
    _announcing[0] += announced
    try:
        yield
    finally:
        _announcing[0] -= announced


@contextlib.contextmanager
def first_call(family: str):
    """Announce the first (cold) call of a kernel family on stderr: a line before the body (its
    JIT compilation or kernel loading can take minutes), its time after. Later calls of the
    family, and first calls nested in an announced one (part of its time), print nothing."""
    announced = _announce(family)
    start = time.perf_counter()
    with _cold(announced):
        yield
    if announced:
        _announced_took(family, time.perf_counter() - start)


def missed_targets(rows: list[dict]) -> list[str]:
    """``suite/case: key`` of every verdict in ``rows`` that is False (a ``met`` column or one
    ending in `` met``: the targets of ``Case.target`` and of the suites' own checks)."""
    return [f"{r.get('suite', '-')}/{r.get('case', '-')}: {key}" for r in rows
            for key, value in r.items()
            if (key == "met" or key.endswith(" met")) and isinstance(value, (bool, np.bool_))
            and not value]


def threads() -> dict:
    """Thread counts in force (printed with every table)."""
    out = {"cpus": os.cpu_count()}
    try:
        import numba

        out["numba_threads"] = numba.get_num_threads()
    except ImportError:
        pass
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            out[var] = os.environ[var]
    return out


#: Pause before timing a case: OpenBLAS's worker threads keep spinning for a while after a BLAS
#: call and, on a small machine, would take a core from the next case's Numba threads (measured
#: here: a packed GEMV timed right after NumPy's went from 0.28 ms to 0.5-13 ms).
SETTLE_S = 0.3


def time_cpu(fn, repeats: int, min_time_s: float) -> float:
    """Median seconds of ``fn()``, each sample long enough to be above timer noise."""
    time.sleep(SETTLE_S)
    inner = _calls_per_sample(fn, repeats, min_time_s)
    return statistics.median([_sample(fn, inner) for _ in range(repeats)])


def _calls_per_sample(fn, repeats: int, min_time_s: float) -> int:
    """Calls of ``fn`` per sample so that ``repeats`` samples last ``min_time_s``, after a
    warm-up call (JIT compilation, caches) and one timed call."""
    fn()
    once = max(_sample(fn, 1), 1e-7)
    return max(1, int(min_time_s / repeats / once))


def _sample(fn, calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) * 1e-9 / calls


def time_pair(base, fn, repeats: int, min_time_s: float) -> tuple[float, float, float]:
    """``base`` and ``fn`` timed in alternation: (median seconds of ``fn``, of ``base``, median
    over pairs of base / fn).

    ``2 * repeats + 1`` pairs, each sample long enough to be above timer noise; the order within
    a pair alternates (base first, then fn first), so that a steady drift favours neither.
    """
    time.sleep(SETTLE_S)
    inner = [_calls_per_sample(f, repeats, min_time_s) for f in (base, fn)]
    base_s, fn_s = [], []
    for i in range(2 * repeats + 1):
        if i % 2:
            fn_s.append(_sample(fn, inner[1]))
            base_s.append(_sample(base, inner[0]))
        else:
            base_s.append(_sample(base, inner[0]))
            fn_s.append(_sample(fn, inner[1]))
    ratios = [b / f for b, f in zip(base_s, fn_s)]
    return statistics.median(fn_s), statistics.median(base_s), statistics.median(ratios)


def time_gpu(fn, repeats: int) -> float:
    from cupyx.profiler import benchmark

    result = benchmark(fn, n_repeat=max(repeats, 10), n_warmup=3)
    return float(statistics.median(result.gpu_times[0]))


def run_cases(cases, config: Config, progress=print, family: str | None = None) -> list[dict]:
    """Check, then time, every case; return one result dict per case.

    ``family`` (the suite's name, say): its first (cold) calls are announced on stderr before
    the first case is built (a suite's setup between cases calls its ops too), and their time,
    the untimed work (building the cases, their checks) up to the first check, after it.
    Without it, the first check of each suite is announced.
    """
    rows = []
    by_name, fns = {}, {}
    cases = iter(cases)
    cold = family is not None and _announce(family)
    cold_s = 0.0
    while True:
        begin = time.perf_counter()
        with _cold(cold):
            case = next(cases, None)
            if case is not None:
                progress(f"  {case.suite}/{case.name} ...")
                if case.check is not None:
                    with first_call(family or case.suite):
                        case.check()
        if cold:
            cold_s += time.perf_counter() - begin
            if case is None or case.check is not None:
                _announced_took(family, cold_s)
                cold = False
        if case is None:
            break
        seconds = pair = None
        if case.paired and case.fn is not None and not config.gpu:
            seconds, base_seconds, ratio = time_pair(fns[case.baseline], case.fn,
                                                     config.repeats, config.min_time_s)
            pair = {"baseline ms (paired)": base_seconds * 1e3}
        elif case.fn is not None:
            seconds = (time_gpu(case.fn, config.repeats) if config.gpu
                       else time_cpu(case.fn, config.repeats, config.min_time_s))
        fns[case.name] = case.fn
        row = {"suite": case.suite, "case": case.name, "seconds": seconds, **case.info,
               **(pair or {})}
        if seconds and case.nbytes:
            row["GB/s"] = case.nbytes / seconds / 1e9
        if seconds and case.flops:
            row["GFLOP/s"] = case.flops / seconds / 1e9
        if case.baseline is not None:
            base = by_name[case.baseline]
            row["baseline"] = case.baseline
            row["ratio"] = ratio if pair else base["seconds"] / seconds
            if case.target is not None:
                row["target"] = case.target
                row["met"] = row["ratio"] >= case.target
        by_name[case.name] = row
        rows.append(row)
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "PASS" if value else "FAIL"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(rows: list[dict]) -> str:
    """A plain-text table of result rows; time in ms."""
    if not rows:
        return "(no rows)"
    columns = []
    for row in rows:
        for key in row:
            if key not in columns and key != "suite":
                columns.append(key)
    shown = [{**r, "seconds": None if r.get("seconds") is None else r["seconds"] * 1e3}
             for r in rows]
    header = ["ms" if c == "seconds" else c for c in columns]
    cells = [[_fmt(r.get(c)) for c in columns] for r in shown]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


REPO = Path(__file__).resolve().parent.parent


def metadata() -> dict:
    """What produced a result file (every JSON writer of ``bench/`` stores it): the lowbit
    version, the checkout's git commit (None outside a git checkout), the CPU model, the
    versions of numpy, numba and cupy (None when not installed; read from the installed
    distributions, so nothing is imported for it), and ``bench/cpu.py``'s facts: the CPU's
    deciding flags, NumPy's BLAS and its kernel family, ``OPENBLAS_CORETYPE``, the kernel
    family of each numba op."""
    import lowbit

    from . import cpu

    return {"lowbit": lowbit.__version__, "git_commit": _git_commit(), "cpu": _cpu_model(),
            **{name: _version(name) for name in ("numpy", "numba", "cupy")},
            "cpu_facts": cpu.facts()}


@functools.lru_cache(maxsize=None)
def _git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=10)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def _version(module: str) -> str | None:
    """The version of the distribution that provides ``module`` (``cupy``: ``cupy-cuda12x``
    and the like), None when none is installed."""
    names = importlib.metadata.packages_distributions().get(module) or [module]
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def write_json(name: str, rows: list[dict], config: Config, directory: Path | None = None) -> Path:
    directory = Path(directory) if directory is not None else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    payload = {
        "config": dataclasses.asdict(config),
        "threads": threads(),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "metadata": metadata(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": rows,
    }
    # Strict JSON (a NaN or inf, say a ratio with no baseline, is written as null), written
    # whole or not at all: to a temporary file that then replaces the old one.
    text = json.dumps(_strict(payload), indent=1, default=str, allow_nan=False)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)
    return path


def _strict(value):
    """``value`` with every non-finite float (nested in dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value
