"""Data-parallel training (``lowbit/distributed/``, ``train(..., comm=)``): the size-1
communicator, the bucket, and, under ``mpiexec -n 2``, the collectives, the equivalence of 2 ranks
of batch b with 1 process of batch 2b made of the same rows (dropout off and on), resuming every
rank from rank 0's checkpoint, a failing rank and mismatched configs ending the job on every rank.

The MPI runs are subprocesses of ``WORKER`` (written to a temporary folder) with a timeout, so a
hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import assert_close, assert_equal

import lowbit.distributed as distributed
from lowbit.distributed._base import ALIGN, Bucket
from lowbit.models import bdh, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(n_layer=1, n_embd=16, n_head=2, mlp_internal_dim_multiplier=4)
RUN = dict(block=16, batch=2, steps=4, corpus_bytes=20000)
#: One run under mpiexec must never take longer than this (a hang fails here).
TIMEOUT_S = 120
#: Parameters of 2 ranks against 1 process after RUN["steps"] AdamW steps: the two compute the
#: same sums in another order (a matmul over 2b rows against two over b and an fp32 add), so
#: they agree to fp32 rounding, not bitwise: measured max difference 2.3e-7 (lm_head), while the
#: steps moved every parameter array by about 9e-3.
PARAM_ATOL = 2e-6
LOSS_RTOL = 1e-5


def _mpiexec():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip('mpi4py is not installed: pip install "lowbit[mpi]"')
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep +
                         os.environ.get("PATH", ""))
    if found is None:
        pytest.skip('no mpiexec on PATH: pip install "lowbit[mpi]" (the mpich wheel brings it)')
    return found


WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from lowbit import AdamW
    from lowbit.distributed import communicator
    from lowbit.models import bdh, train

    mode, out = sys.argv[1], sys.argv[2]
    TINY, RUN = {tiny!r}, {run!r}
    comm = communicator()
    r = comm.rank
    corpus = train.default_corpus()[:RUN["corpus_bytes"]]

    def run(dropout, steps=RUN["steps"], total=RUN["steps"], checkpoint=None, resume=None,
            callback=None, **shape):
        config = bdh.BDHConfig(**dict(TINY, dropout=dropout, **shape))
        params = bdh.init_params(config, seed=1 + 10 * r)  # rank 0's must win the broadcast
        batches = train.Batches(corpus, RUN["block"], RUN["batch"], seed=0, rank=r)
        schedule = train.Schedule("fp32", lr=3e-3, warmup=2, steps=total)
        optimizer, start = None, 0
        if resume:
            ckpt = train.load_checkpoint(resume)
            params, start = ckpt["params"], ckpt["step"]
            batches.set_state(ckpt["batches"])
            optimizer = AdamW()
            optimizer.load_state_dict(ckpt["optimizer"])
        history = train.train(config, params, batches, schedule, steps=steps, seed=3,
                              start_step=start, optimizer=optimizer, progress=False, comm=comm,
                              checkpoint=checkpoint, callback=callback)
        return params, history

    if mode == "collectives":
        a = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r
        big = np.full((4, 6), float(r))
        c = np.array([r, -r, 7], np.int16)
        arrays = [a, big[:, ::2], c]
        same = comm.broadcast(arrays, root=1) is arrays
        x = np.random.default_rng(r).standard_normal(1000).astype(np.float32)
        y = np.random.default_rng(10 + r).standard_normal((3, 5)).astype(np.float32)
        comm.allreduce_mean([x, y])
        try:
            comm.check_same({{"n_embd": 16 + r}}, "the configs")
            mismatch = ""
        except ValueError as exc:
            mismatch = str(exc)
        comm.check_same({{"n_embd": 16}}, "the configs")
        np.savez(f"{{out}}/rank{{r}}.npz", a=a, big=big, c=c, x=x, y=y, same=same,
                 gathered=repr(comm.allgather_object(("rank", r))), mismatch=mismatch,
                 size=comm.size)
    elif mode == "train":
        res = {{}}
        for dropout in (0.0, 0.1):
            params, history = run(dropout)
            res.update({{f"{{dropout}}/{{k}}": v for k, v in params.items()}})
            res[f"{{dropout}}/loss"] = [loss for _, loss in history["train"]]
            res[f"{{dropout}}/val"] = history["val"][-1][1]
        straight, _ = run(0.1, steps=4, total=4)
        run(0.1, steps=2, total=4, checkpoint=f"{{out}}/ckpt.npz")
        resumed, _ = run(0.1, steps=4, total=4, resume=f"{{out}}/ckpt.npz")
        res.update({{f"straight/{{k}}": v for k, v in straight.items()}})
        res.update({{f"resumed/{{k}}": v for k, v in resumed.items()}})
        np.savez(f"{{out}}/rank{{r}}.npz", **res)
    elif mode == "fail":
        def fail(step, record):
            if r == 1 and step == 2:
                raise RuntimeError("rank 1 stops here on purpose")
        run(0.0, callback=fail)
    elif mode == "mismatch":
        run(0.0, n_embd=16 + 8 * r)
    elif mode == "nccl":
        import cupy
        cupy.cuda.Device(r % cupy.cuda.runtime.getDeviceCount()).use()
        a = cupy.arange(6, dtype=cupy.float32) + 10 * r
        c = cupy.asarray(np.array([r, 7], np.int16))
        comm.broadcast([a, c], root=comm.size - 1)
        x = cupy.asarray(np.random.default_rng(r).standard_normal(1000).astype(np.float32))
        comm.allreduce_mean([x])
        config = bdh.BDHConfig(**dict(TINY, dropout=0.1))
        params = bdh.init_params(config, seed=1 + 10 * r, xp=cupy)
        batches = train.Batches(corpus, RUN["block"], RUN["batch"], seed=0, rank=r)
        train.train(config, params, batches, train.Schedule("fp32", lr=3e-3, warmup=2, steps=2),
                    seed=3, progress=False, comm=comm)
        np.savez(f"{{out}}/rank{{r}}.npz", a=a.get(), c=c.get(), x=x.get(), size=comm.size,
                 **{{k: v.get() for k, v in params.items()}})
""")


def _mpirun(tmp_path, mode, ranks=2):
    """Run ``WORKER mode`` under ``mpiexec -n ranks``; returns (exit code, output)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tiny=TINY, run=RUN))
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([_mpiexec(), "-n", str(ranks), sys.executable, str(script), mode,
                               str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec {mode} hung for {TIMEOUT_S} s: {exc.stdout}{exc.stderr}")
    return done.returncode, done.stdout + done.stderr


def _ranks(tmp_path, n=2):
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(n)]


# -- one process ---------------------------------------------------------------------------------

@pytest.fixture
def no_launcher(monkeypatch):
    for name in distributed.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_world", None)


def test_without_a_launcher_the_communicator_is_size_one_and_does_nothing(no_launcher):
    comm = distributed.communicator()
    assert (comm.rank, comm.size) == (0, 1) and distributed.communicator() is comm
    a, b = np.arange(5, dtype=np.float32), np.ones((2, 3), np.float32)
    arrays = [a, b]
    assert comm.broadcast(arrays) is arrays and comm.allreduce_mean(arrays) is arrays
    assert_equal("a", np.arange(5, dtype=np.float32), a)
    assert_equal("b", np.ones((2, 3), np.float32), b)
    assert comm.allgather_object({"x": 1}) == [{"x": 1}]
    comm.check_same(("anything",))
    with pytest.raises(KeyError), comm.guard():
        raise KeyError("size 1: exceptions pass through the guard")


def test_importable_without_mpi4py_and_says_how_to_get_it(no_launcher, monkeypatch):
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "import lowbit.distributed as d, lowbit.models.train\n"
            "assert d.communicator().size == 1\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=TIMEOUT_S)
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(ImportError, match=r'pip install "lowbit\[mpi\]"'):
        distributed.communicator()


def _read_only(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("call, exc, name", [
    (lambda c: c.broadcast(np.ones(3, np.float32)), TypeError, "arrays"),
    (lambda c: c.broadcast([np.ones(3)], root=1), ValueError, "root"),
    (lambda c: c.broadcast([np.ones(3)], root=-1), ValueError, "root"),
    (lambda c: c.broadcast([np.ones(3)], root=0.5), TypeError, "root"),
    (lambda c: c.allreduce_mean([np.ones(3), np.ones(3, np.float32)]), TypeError, "arrays"),
    (lambda c: c.allreduce_mean([np.ones(3, np.int32)]), TypeError, "arrays"),
    (lambda c: c.allreduce_mean([np.ones(3), _read_only(np.ones(2))]), ValueError,
     r"arrays\[1\] is read-only"),
    (lambda c: c.allreduce_mean(["not an array"]), TypeError, r"arrays\[0\]"),
])
def test_bad_arguments_name_the_argument(no_launcher, call, exc, name):
    with pytest.raises(exc, match=name):
        call(distributed.communicator())


def test_bucket_round_trip_of_mixed_dtypes_and_strided_arrays():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((3, 5)).astype(np.float32)[:, ::2],
              rng.integers(-5, 5, 7).astype(np.int16), rng.standard_normal(4)[::-1],
              np.array(2.5, np.float32)]
    originals = [a.copy() for a in arrays]
    bucket = Bucket()
    buf = bucket.pack(arrays, np.uint8)
    # Each array starts at an ALIGN-byte boundary: 3x3 float32 = 36 bytes -> 48, int16 14 -> 16.
    assert buf.size == 48 + 16 + 32 + 16
    targets = [np.zeros_like(a) for a in arrays]
    bucket.unpack(buf, targets)
    for i, (want, got) in enumerate(zip(originals, targets)):
        assert_equal(f"arrays[{i}]", want, got)
        assert_equal(f"input {i} unchanged", want, arrays[i])
    assert ALIGN == 16


def test_a_training_run_checks_its_batch_stream_rank(no_launcher):
    config = bdh.BDHConfig(**TINY)
    batches = train.Batches(train.default_corpus()[:20000], 16, 2, rank=1)
    with pytest.raises(ValueError, match="batches.rank"):
        train.train(config, bdh.init_params(config), batches, train.Schedule(steps=1),
                    progress=False, comm=distributed.communicator())


def test_rank_zero_draws_what_one_process_draws_and_other_ranks_differ():
    corpus = train.default_corpus()[:20000]
    one = train.Batches(corpus, 16, 4, seed=5).sample()[0]
    assert_equal("rank 0", one, train.Batches(corpus, 16, 4, seed=5, rank=0).sample()[0])
    assert not np.array_equal(one, train.Batches(corpus, 16, 4, seed=5, rank=1).sample()[0])


# -- mpiexec -n 2 --------------------------------------------------------------------------------

def test_collectives_under_mpiexec(tmp_path):
    code, out = _mpirun(tmp_path, "collectives")
    assert code == 0, out
    ranks = _ranks(tmp_path)
    x = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in (0, 1)]
    y = [np.random.default_rng(10 + r).standard_normal((3, 5)).astype(np.float32) for r in (0, 1)]
    for r, got in enumerate(ranks):
        assert int(got["size"]) == 2 and bool(got["same"])
        assert_equal("a from root 1", np.arange(6, dtype=np.float32).reshape(2, 3) + 10, got["a"])
        big = np.full((4, 6), float(r))
        big[:, ::2] = 1.0  # only the strided view was broadcast
        assert_equal("big", big, got["big"])
        assert_equal("c", np.array([1, -1, 7], np.int16), got["c"])
        # Two fp32 addends: one rounding, the same in any order, so numpy's fp32 sum is exact.
        assert_equal("mean x", (x[0] + x[1]) / np.float32(2), got["x"])
        assert_equal("mean y", (y[0] + y[1]) / np.float32(2), got["y"])
        assert_close("mean x vs float64", (x[0].astype(np.float64) + x[1]) / 2, got["x"], 1e-7)
        assert str(got["gathered"]) == "[('rank', 0), ('rank', 1)]"
        assert "the configs differ across the 2 ranks" in str(got["mismatch"])
        assert f"rank {r} has {{'n_embd': {16 + r}}}" in str(got["mismatch"])


class _SameRows:
    """One process's batches of 2b rows: rank 0's b rows of a step, then rank 1's."""

    def __init__(self, corpus, ranks):
        self.streams = [train.Batches(corpus, RUN["block"], RUN["batch"], seed=0, rank=r)
                        for r in range(ranks)]
        self.rank, self.block, self.batch = 0, RUN["block"], RUN["batch"] * ranks

    def sample(self, split="train", rng=None):
        if rng is not None:  # validation: not compared
            return self.streams[0].sample(split, rng)
        parts = [s.sample(split) for s in self.streams]
        return tuple(np.concatenate(p) for p in zip(*parts))


def _one_process(dropout):
    config = bdh.BDHConfig(**TINY, dropout=dropout)
    params = bdh.init_params(config, seed=1)
    batches = _SameRows(train.default_corpus()[:RUN["corpus_bytes"]], 2)
    schedule = train.Schedule("fp32", lr=3e-3, warmup=2, steps=RUN["steps"])
    history = train.train(config, params, batches, schedule, seed=3, progress=False)
    return params, [loss for _, loss in history["train"]]


def test_two_ranks_train_as_one_process_of_the_same_rows_and_resume(tmp_path):
    code, out = _mpirun(tmp_path, "train")
    assert code == 0, out
    ranks = _ranks(tmp_path)
    for key in ranks[0]:  # every rank holds the same bits: the reduction is one per bucket
        assert_equal(f"rank 1 {key}", ranks[0][key], ranks[1][key])
    for dropout in (0.0, 0.1):
        params, losses = _one_process(dropout)
        init = bdh.init_params(bdh.BDHConfig(**TINY), seed=1)
        for name in bdh.PARAMS:
            got = ranks[0][f"{dropout}/{name}"]
            assert_close(f"dropout {dropout} {name}", params[name], got, 1e-4, atol=PARAM_ATOL)
            # Training moved the parameters far more than the tolerance.
            assert np.abs(params[name] - init[name]).max() > 100 * PARAM_ATOL
        assert_close(f"dropout {dropout} losses", np.array(losses), ranks[0][f"{dropout}/loss"],
                     LOSS_RTOL)
    for name in bdh.PARAMS:  # every rank resumed its own stream from rank 0's checkpoint
        assert_equal(f"resumed {name}", ranks[0][f"straight/{name}"], ranks[0][f"resumed/{name}"])


def test_dropout_masks_follow_the_global_row(tmp_path):
    """Dropout on changes the parameters: the dropout-on comparison above is not vacuous."""
    off, _ = _one_process(0.0)
    on, _ = _one_process(0.1)
    assert np.abs(off["decoder"] - on["decoder"]).max() > 100 * PARAM_ATOL


def test_a_failing_rank_ends_the_job_with_a_message_on_every_rank(tmp_path):
    code, out = _mpirun(tmp_path, "fail")
    assert code != 0, out
    assert "rank 1 of 2 failed with RuntimeError: rank 1 stops here on purpose" in out, out
    assert "rank 0 of 2 stops because rank 1 of 2 failed with RuntimeError" in out, out


def test_mismatched_configs_are_rejected_at_the_start(tmp_path):
    code, out = _mpirun(tmp_path, "mismatch")
    assert code != 0, out
    for r in (0, 1):
        assert (f"rank {r} of 2 failed with ValueError: the configs, parameter shapes and "
                f"training arguments differ across the 2 ranks") in out, out
        assert f"n_embd={16 + 8 * r}" in out, out


@pytest.mark.gpu
def test_nccl_collectives_and_training_on_cupy_arrays(tmp_path, no_launcher):
    """2 GPUs: 2 ranks through NCCL; 1 GPU: one rank through NCCL (NCCL takes one rank per
    device) and the size-1 communicator."""
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device")
    a = cupy.arange(3, dtype=cupy.float32)
    assert distributed.communicator().allreduce_mean([a])[0] is a
    assert_equal("size 1", np.arange(3, dtype=np.float32), a.get())
    n = min(2, cupy.cuda.runtime.getDeviceCount())
    code, out = _mpirun(tmp_path, "nccl", ranks=n)
    assert code == 0, out
    ranks = _ranks(tmp_path, n)
    x = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in range(n)]
    for got in ranks:
        assert int(got["size"]) == n
        assert_equal("a from the last rank", np.arange(6, dtype=np.float32) + 10 * (n - 1),
                     got["a"])
        assert_equal("c from the last rank", np.array([n - 1, 7], np.int16), got["c"])
        assert_equal("mean x", sum(x[1:], x[0]) / np.float32(n), got["x"])
        for name in bdh.PARAMS:
            assert_equal(f"{name} as rank 0's", ranks[0][name], got[name])
