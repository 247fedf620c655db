"""``lowbit._backend.single_threaded_blas`` across threads: the process-wide OpenBLAS setting is
saved by the first block to enter and restored by the last to leave, whatever the order."""

import threading

import pytest

from lowbit import _backend


class _FakeBlas:
    """One OpenBLAS's thread count, behind the (getter, setter) pair the real controls give."""

    def __init__(self, threads: int):
        self.threads = threads
        self.lock = threading.Lock()
        self.history = [threads]

    def get(self) -> int:
        with self.lock:
            return self.threads

    def set(self, n: int) -> None:
        with self.lock:
            self.threads = n
            self.history.append(n)


@pytest.fixture
def blas(monkeypatch):
    fakes = (_FakeBlas(4), _FakeBlas(8))
    monkeypatch.setattr(_backend, "_blas_thread_controls",
                        lambda: tuple((f.get, f.set) for f in fakes))
    return fakes


def test_one_block_sets_one_thread_and_restores(blas):
    with _backend.single_threaded_blas():
        assert [f.threads for f in blas] == [1, 1]
        with _backend.single_threaded_blas():  # nested in one thread
            assert [f.threads for f in blas] == [1, 1]
        assert [f.threads for f in blas] == [1, 1]
    assert [f.threads for f in blas] == [4, 8]


def test_inactive_block_touches_nothing(blas):
    with _backend.single_threaded_blas(active=False):
        assert [f.threads for f in blas] == [4, 8]
    assert [f.history for f in blas] == [[4], [8]]


def test_overlapping_blocks_in_two_threads_restore_the_original(blas):
    # A enters, B enters, A leaves, B leaves: an unguarded save/restore lets B save A's "1" and
    # restore it last, leaving OpenBLAS on one thread for good.
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen_by_b_after_a_left = []
    errors = []

    def a():
        try:
            with _backend.single_threaded_blas():
                a_in.set()
                assert b_in.wait(10)
            a_out.set()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def b():
        try:
            assert a_in.wait(10)
            with _backend.single_threaded_blas():
                b_in.set()
                assert a_out.wait(10)
                seen_by_b_after_a_left.append([f.threads for f in blas])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen_by_b_after_a_left == [[1, 1]]  # B's block still runs single-threaded
    assert [f.threads for f in blas] == [4, 8]


def test_many_threads_leave_the_original_counts(blas):
    barrier = threading.Barrier(8)
    errors = []

    def worker():
        try:
            for step in range(50):
                with _backend.single_threaded_blas():
                    if step == 0:
                        barrier.wait(10)  # all eight blocks open at once
                    assert [f.threads for f in blas] == [1, 1]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [f.threads for f in blas] == [4, 8]


_KERNEL = """
import numpy as np, threadpoolctl
from lowbit import _backend
from lowbit.ops.packed_matmul import _numba
home = np.__file__.rsplit("numpy", 1)[0]
ours = [i for i in threadpoolctl.threadpool_info()
        if i["internal_api"] == "openblas" and "numpy" in i["filepath"][len(home):]]
print(_backend.numpy_blas_kernel(), ours[0]["architecture"] if ours else None, _numba.USE_FMA,
      _numba._fma.WIDE)
"""


@pytest.mark.parametrize("coretype", [None, "Haswell"])
def test_numpy_blas_kernel_is_what_openblas_reports(tmp_path, coretype):
    """``numpy_blas_kernel`` names the core type NumPy's OpenBLAS runs, as ``threadpoolctl``
    reports it, ``OPENBLAS_CORETYPE`` included, and the straight-through backward takes the
    AVX-512 tiles exactly where that kernel is not a 512-bit one (``_numba.USE_FMA``; the
    256-bit tiles of a CPU without AVX-512 never)."""
    import os
    import subprocess
    import sys

    import numpy as np

    pytest.importorskip("threadpoolctl")
    if "openblas" not in str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]):
        pytest.skip("NumPy's BLAS is not OpenBLAS")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")}
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    out = subprocess.run([sys.executable, "-c", _KERNEL], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    kernel, reported, use_fma, avx512 = out
    assert reported != "None" and kernel == reported
    if coretype:
        assert kernel.lower() == coretype.lower()
    assert use_fma == str(avx512 == "True" and kernel.lower() not in
                          {"skylakex", "cooperlake", "sapphirerapids"})
