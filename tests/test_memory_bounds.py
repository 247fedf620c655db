"""Memory: repeated calls of every public op do not grow the process, and the workspaces kernels
keep between calls are bounded and released by ``lowbit.clear_caches()``.

The calls are ``tests/properties/catalogue.py``'s (forward and backward of every op family).
After a warm-up, up to ``CALLS`` rounds (a soak of 10,000 rounds cut to fit the suite's time budget
on two cores: a round of all seven families costs ~1.5 ms on an idle machine but up to 200 ms on
numba under heavy load, so the rounds also stop after ``TIME_BOX_S``, with at least
``MIN_CALLS`` done) must grow resident memory by less than ``RSS_BOUND`` and live Python
allocations (``tracemalloc``) by less than ``PY_BOUND``: a leaked ctx (~1 KiB), workspace or
compiled kernel per call would exceed ``PY_BOUND`` within ``MIN_CALLS`` rounds.
"""

import gc
import os
import threading
import time
import tracemalloc

import numpy as np
import pytest
from properties.catalogue import calls

import lowbit
from lowbit import _dispatch

WARMUP = 20
CALLS = 2000
MIN_CALLS = 100
TIME_BOX_S = 5.0
RSS_BOUND = 8 << 20
PY_BOUND = 256 << 10


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_repeated_calls_do_not_grow_memory(backend):
    if _dispatch.backend_unavailable_reason(backend) is not None:
        pytest.skip(f"{backend} unavailable")
    runs = calls()
    with lowbit.use_backend(backend):
        for _ in range(WARMUP):
            for run in runs.values():
                run()
        gc.collect()
        rss0 = _rss()
        tracemalloc.start()
        try:
            py0, _ = tracemalloc.get_traced_memory()
            start = time.perf_counter()
            for done in range(1, CALLS + 1):
                for run in runs.values():
                    run()
                if done >= MIN_CALLS and time.perf_counter() - start > TIME_BOX_S:
                    break
            gc.collect()
            py1, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        rss1 = _rss()
    assert py1 - py0 < PY_BOUND, f"Python allocations grew by {py1 - py0} B in {done} rounds"
    assert rss1 - rss0 < RSS_BOUND, f"resident memory grew by {rss1 - rss0} B in {done} rounds"


@pytest.mark.skipif(_dispatch.backend_unavailable_reason("numba") is not None,
                    reason="numba unavailable")
def test_gemm_workspace_is_bounded_and_released(monkeypatch):
    from lowbit.ops.packed_matmul import _numba as pm_numba
    from lowbit.ops.packed_matmul._numba import _gemm_f64

    monkeypatch.setattr(pm_numba, "USE_VNNI", False)  # the float64-field BLAS GEMM keeps them
    monkeypatch.setattr(pm_numba, "USE_AVX2", False)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((67, 1100)).astype(np.float32)
    pw = lowbit.quantize_weight(rng.standard_normal((1100, 70)).astype(np.float32), "ternary")

    def held():
        return {k: v.nbytes for k, v in vars(_gemm_f64._WORK).items()}

    with lowbit.use_backend("numba"):
        lowbit.packed_matmul(x, pw)
        after_one = held()
        for _ in range(20):
            lowbit.packed_matmul(x, pw)
        assert held() == after_one, "the workspace grew on repeated calls of one shape"
        assert after_one and all(n <= _gemm_f64.WORKSPACE_MAX_BYTES for n in after_one.values())
        lowbit.clear_caches()
        assert held() == {}, "clear_caches left this thread's GEMM workspace"
        other = {}

        def in_thread():
            with lowbit.use_backend("numba"):
                lowbit.packed_matmul(x, pw)
            other.update(held())

        t = threading.Thread(target=in_thread)
        t.start()
        t.join(60)
        assert other and held() == {}, "workspaces are per thread"
