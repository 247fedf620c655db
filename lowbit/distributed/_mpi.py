"""Data parallelism across processes through mpi4py; cupy arrays go through NCCL (``_nccl.py``).

Every collective is non-blocking underneath and polled, so that a rank waiting for the others
also watches a second communicator for a failure notice: a rank that raises inside ``guard()``
prints its traceback, tells every other rank, waits a moment for them to say so too, then calls
``Abort``; the others raise ``RankFailedError`` at their next collective, print why they stop
and abort as well. Nothing hangs, and every rank that is still communicating says why it ends.

Siblings: ``_base.py`` (the interface, the bucket, the size-1 communicator), ``__init__.py``;
tests ``tests/test_distributed.py``; bench ``bench/train_distributed.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import sys
import time
import traceback
from typing import Any, Callable, Iterator

import numpy as np

from .. import _backend
from .._typing import Array
from ._base import Bucket, Communicator, RankFailedError

#: Shown when MPI is needed (a launcher started us, or an mpi4py communicator was asked for).
MPI_MISSING = ('lowbit.distributed needs mpi4py and an MPI library for more than one process: '
               'pip install "lowbit[mpi]" (mpi4py with the mpich wheel, which brings mpiexec)')
#: Tag of the failure notices on the alarm communicator.
ALARM_TAG = 17
#: Bytes of a failure notice (longer messages are cut).
ALARM_BYTES = 4096
#: Seconds a failing rank waits for the others to report before it aborts the job.
GRACE_S = 10.0
#: Seconds between a rank's last word and its ``Abort``: the launcher forwards the output of every
#: rank through pipes, and ``Abort`` ends the job before they are read.
FLUSH_S = 0.5
#: Polls of a pending collective before the poll loop starts sleeping, and its longest sleep:
#: a waiting rank must not take a core from a rank still computing (2 ranks on 2 cores).
SPIN_POLLS = 200
MAX_SLEEP_S = 1e-3


def mpi() -> Any:
    """The ``mpi4py.MPI`` module, or ImportError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(MPI_MISSING) from exc
    return MPI


class MPICommunicator(Communicator):
    """A communicator over an mpi4py communicator (default ``MPI.COMM_WORLD``).

    numpy arrays travel through MPI (``Ibcast`` / ``Iallreduce`` of one bucket); cupy arrays
    through NCCL, whose communicator is made at the first cupy collective on the current device
    (select each rank's device before that, e.g. ``cupy.cuda.Device(rank % n_gpus).use()``).
    """

    def __init__(self, comm: Any = None) -> None:
        MPI = self._MPI = mpi()
        self._world = MPI.COMM_WORLD if comm is None else comm
        # Collectives and notices on communicators of their own: a user's messages on the
        # world communicator never match ours.
        self._comm = self._world.Dup()
        self._alarm = self._world.Dup()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self._bucket = Bucket()
        self._nccl: Any = None
        self._heard: set[int] = set()
        self._alarm_buf = np.zeros(ALARM_BYTES, np.uint8)
        self._alarm_status = MPI.Status()
        self._alarm_req = self._listen()
        # Runs before mpi4py's own exit handler (registered earlier): a receive still posted at
        # MPI_Finalize is an error.
        atexit.register(self._close)

    # -- the collectives -----------------------------------------------------------------------

    def _broadcast(self, arrays: list[Array], root: int) -> None:
        buf = self._bucket.pack(arrays, np.uint8)
        if _backend.is_cupy_array(buf):
            self._gpu().broadcast(buf, root)
        else:
            self._wait(self._comm.Ibcast([buf, self._MPI.BYTE], root=root).Test)
        if self.rank != root:
            self._bucket.unpack(buf, arrays)

    def _allreduce_mean(self, arrays: list[Array]) -> None:
        buf = self._bucket.pack(arrays, arrays[0].dtype)
        if _backend.is_cupy_array(buf):
            self._gpu().allreduce_sum(buf)
        else:
            self._wait(self._comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._MPI.SUM).Test)
        buf /= self.size
        self._bucket.unpack(buf, arrays)

    def allgather_object(self, value: object) -> list[Any]:
        data = np.frombuffer(pickle.dumps(value), np.uint8)
        counts = np.zeros(self.size, np.int64)
        self._wait(self._comm.Iallgather(np.array([data.size], np.int64), counts).Test)
        out = np.empty(int(counts.sum()), np.uint8)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self._wait(self._comm.Iallgatherv(
            data, [out, counts.tolist(), displs.tolist(), self._MPI.BYTE]).Test)
        return [pickle.loads(out[d:d + c].tobytes()) for d, c in zip(displs, counts)]

    def _gpu(self) -> Any:
        if self._nccl is None:
            from ._nccl import NCCLCommunicator

            self._nccl = NCCLCommunicator(self)
        return self._nccl

    # -- waiting, failure notices, abort --------------------------------------------------------

    def _wait(self, done: Callable[[], object]) -> None:
        """Poll ``done()`` until it is true, raising ``RankFailedError`` on a failure notice."""
        polls = 0
        while not done():
            self._check_alarm()
            polls += 1
            if polls > SPIN_POLLS:
                time.sleep(min(MAX_SLEEP_S, 1e-6 * (polls - SPIN_POLLS)))

    def _listen(self) -> Any:
        self._alarm_buf[:] = 0
        return self._alarm.Irecv([self._alarm_buf, self._MPI.BYTE], source=self._MPI.ANY_SOURCE,
                                 tag=ALARM_TAG)

    def _check_alarm(self) -> None:
        if self._alarm_req.Test(self._alarm_status):
            self._heard.add(self._alarm_status.Get_source())
            message = self._alarm_buf.tobytes().rstrip(b"\0").decode(errors="replace")
            self._alarm_req = self._listen()
            raise RankFailedError(message)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:  # noqa: B036 -- any way out of a rank must end the job
            self._abort(exc)

    def _abort(self, exc: BaseException) -> None:
        where = f"rank {self.rank} of {self.size}"
        if isinstance(exc, RankFailedError):
            cause = str(exc)
            text = f"lowbit.distributed: {where} stops because {cause}; aborting the job"
        else:
            cause = f"{where} failed with {type(exc).__name__}: {exc}"
            text = (f"{''.join(traceback.format_exception(exc))}lowbit.distributed: {cause}; "
                    f"aborting the job on every rank")
        print(text, file=sys.stderr, flush=True)
        notice = np.zeros(ALARM_BYTES, np.uint8)
        payload = cause.encode()[:ALARM_BYTES - 1]
        notice[:len(payload)] = np.frombuffer(payload, np.uint8)
        sends = [self._alarm.Isend([notice, self._MPI.BYTE], dest=r, tag=ALARM_TAG)
                 for r in range(self.size) if r != self.rank]
        deadline = time.monotonic() + GRACE_S
        while len(self._heard - {self.rank}) < self.size - 1 and time.monotonic() < deadline:
            with contextlib.suppress(RankFailedError):
                self._check_alarm()
            time.sleep(MAX_SLEEP_S)
        time.sleep(FLUSH_S)
        del sends
        self._world.Abort(1)

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            self._alarm_req.Cancel()
            self._alarm_req.Wait()
