"""Determinism: bitwise-identical outputs and gradients run to run, and across Numba thread
counts 1 and 2, for every public op (``tests/properties/catalogue.py``'s calls).

The op contract (docs/ops.rst) promises bitwise results run to run on one backend; the
thread-count check holds the numba kernels to results that do not depend on how their parallel
loops are split. Shapes at
``scale`` 8 give the numba kernels several parallel chunks.
"""

import numpy as np
import pytest
from properties.catalogue import assert_bitwise, calls, run_all

import lowbit
from lowbit import _dispatch

CPU = [b for b in ("numpy", "numba", "cudasim") if _dispatch.backend_unavailable_reason(b) is None]


@pytest.mark.parametrize("backend", CPU)
def test_runs_are_bitwise_identical(backend):
    runs = calls(1 if backend == "cudasim" else 8)
    with lowbit.use_backend(backend):
        first = run_all(runs)
        assert_bitwise(backend, first, run_all(runs))


@pytest.mark.skipif("numba" not in CPU, reason="numba is not installed")
@pytest.mark.parametrize("scale", [1, 8])
def test_numba_thread_count_does_not_change_results(scale):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba runs one thread here")
    runs = calls(scale)
    previous = numba.get_num_threads()
    try:
        with lowbit.use_backend("numba"):
            numba.set_num_threads(1)
            one = run_all(runs)
            numba.set_num_threads(2)
            two = run_all(runs)
    finally:
        numba.set_num_threads(previous)
    assert_bitwise(f"numba 1 vs 2 threads, scale {scale}", one, two)


def test_numba_thread_count_in_a_parallel_gemm():
    """The packed GEMM path (rows above the GEMV switch, K past a VNNI block) at 1 and 2
    threads."""
    import numba

    if "numba" not in CPU or numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs numba with two threads")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((67, 1100)).astype(np.float32)
    w = rng.standard_normal((1100, 70)).astype(np.float32)
    dy = rng.standard_normal((67, 70)).astype(np.float32)
    previous = numba.get_num_threads()
    results = []
    try:
        with lowbit.use_backend("numba"):
            for threads in (1, 2):
                numba.set_num_threads(threads)
                for fmt in ("ternary", "sign", "int8"):
                    y, ctx = lowbit.linear_forward(x, w, fmt, "int8")
                    results.append([y, *lowbit.linear_backward(dy, ctx)])
    finally:
        numba.set_num_threads(previous)
    half = len(results) // 2
    assert_bitwise("gemm 1 vs 2 threads", dict(enumerate(results[:half])),
                   dict(enumerate(results[half:])))
