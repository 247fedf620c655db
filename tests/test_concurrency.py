"""Concurrency: every public op called from eight threads at once, ``use_backend`` per thread and
per asyncio task, and two processes sharing one Numba cache and one cudasim build cache.

The calls are ``tests/properties/catalogue.py``'s (one forward and backward of every op family).
Threads run on numba and cudasim (and numpy) with the backend forced per thread; each result must
equal the single-threaded one bit for bit. A deadlock fails by timeout, not by hanging the run.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from properties.catalogue import assert_bitwise, calls, run_all

import lowbit
from lowbit import _dispatch

THREADS = 8
ROUNDS = 2
TIMEOUT_S = 240
CPU = [b for b in ("numba", "cudasim", "numpy") if _dispatch.backend_unavailable_reason(b) is None]


def _in_threads(work, count=THREADS):
    """Run ``work(i)`` in ``count`` daemon threads; re-raise the first error; fail on timeout."""
    errors = []

    def target(i):
        try:
            work(i)
        except BaseException as exc:  # reported on the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive(), f"a thread did not finish within {TIMEOUT_S} s (deadlock?)"
    if errors:
        raise errors[0]


def test_eight_threads_equal_single_threaded():
    runs = calls()
    want = {}
    for backend in CPU:
        with lowbit.use_backend(backend):
            want[backend] = run_all(runs)

    def work(i):
        # Threads 0, 3, 6 numba, 1, 4, 7 cudasim, 2, 5 numpy (as available); the families in a
        # rotated order, so that different ops overlap.
        backend = CPU[i % len(CPU)]
        names = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
        rounds = 1 if backend == "cudasim" else ROUNDS
        with lowbit.use_backend(backend):
            for _ in range(rounds):
                got = run_all({n: runs[n] for n in names})
                assert _dispatch.forced_backend() == backend
                assert_bitwise(f"thread {i} ({backend})", {n: want[backend][n] for n in names},
                               got)

    _in_threads(work)


def test_use_backend_is_per_thread():
    barrier = threading.Barrier(THREADS)
    seen = {}

    def work(i):
        name = CPU[i % len(CPU)]
        with lowbit.use_backend(name):
            barrier.wait(TIMEOUT_S)  # every thread inside its own block at once
            seen[i] = _dispatch.select_backend()
            barrier.wait(TIMEOUT_S)
        seen[-i - 1] = _dispatch.forced_backend()

    _in_threads(work)
    assert all(seen[i] == CPU[i % len(CPU)] for i in range(THREADS))
    assert all(seen[-i - 1] is None for i in range(THREADS)) or os.environ.get("LOWBIT_BACKEND")


def test_use_backend_is_per_asyncio_task():
    async def task(name, started, release):
        with lowbit.use_backend(name):
            started.set()
            await release.wait()  # the other task sets its backend meanwhile
            return _dispatch.forced_backend()

    async def main():
        events = [asyncio.Event() for _ in CPU]
        release = asyncio.Event()
        tasks = [asyncio.create_task(task(n, e, release)) for n, e in zip(CPU, events)]
        for e in events:
            await e.wait()
        release.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    assert asyncio.run(main()) == CPU


_CHILD = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import lowbit
    errors, lines = [], []
    def work(backend):
        try:
            with lowbit.use_backend(backend):
                packed = lowbit.pack_bits(np.arange(37) % 4, 2)
                codes = lowbit.unpack_bits(packed, 2, 37)
            lines.append(f"{backend} {packed.tobytes().hex()} {codes.sum()}")
        except BaseException as exc:
            errors.append(repr(exc))
    threads = [threading.Thread(target=work, args=(b,)) for b in ("numba", "cudasim") * 2]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(chr(10).join(lines))  # after the joins: two threads printing would interleave
    sys.exit(bool(errors) and print(errors) or 0)
""")


@pytest.mark.slow
@pytest.mark.skipif("numba" not in CPU or "cudasim" not in CPU, reason="needs numba and g++")
def test_two_processes_share_one_cold_cache(tmp_path):
    """Both processes compile the same kernels into one empty Numba cache and one empty cudasim
    build cache at the same moment (two threads each, so the first compile races in-process
    too); both succeed with the same results."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               LOWBIT_CACHE_DIR=str(tmp_path / "lowbit"))
    env.pop("LOWBIT_BACKEND", None)
    root = Path(lowbit.__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], cwd=root, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(2)]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"a process did not finish within {TIMEOUT_S} s")
        assert p.returncode == 0, out
        outputs.append(sorted(out.split("\n")))
    assert outputs[0] == outputs[1] and len([ln for ln in outputs[0] if ln]) == 4
    assert any((tmp_path / "lowbit").rglob("*.so")), "the cudasim build cache stayed empty"
    assert any((tmp_path / "numba").rglob("*.nbi")), "the Numba cache stayed empty"
