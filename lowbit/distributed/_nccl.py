"""The NCCL path of ``MPICommunicator``: cupy buckets reduced and broadcast by NCCL through
CuPy's ``cupy.cuda.nccl``, the NCCL unique id sent from rank 0 over MPI (as ChainerMN does).

The NCCL call is queued on the current stream; the host then polls the stream through the MPI
communicator's wait loop, so a rank that fails meanwhile still stops the job (``_mpi.py``).
Siblings: ``_mpi.py``, ``_base.py``; run on GPUs by ``tests/test_distributed.py`` when cupy sees
at least as many devices as ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ._mpi import MPICommunicator


class NCCLCommunicator:
    """NCCL over the ranks of an ``MPICommunicator``, bound to the current CUDA device.

    Args:
        mpi: the ``MPICommunicator`` whose ranks take part (its ``allgather_object`` carries the
            unique id, its wait loop watches for failures).
    """

    def __init__(self, mpi: MPICommunicator) -> None:
        import cupy
        from cupy.cuda import nccl

        self._cupy, self._nccl = cupy, nccl
        uid = nccl.get_unique_id() if mpi.rank == 0 else None
        uid = mpi.allgather_object(uid)[0]
        self._comm = nccl.NcclCommunicator(mpi.size, uid, mpi.rank)
        self._wait = mpi._wait
        self.device = cupy.cuda.Device().id
        self._dtypes = {np.dtype(np.uint8): nccl.NCCL_UINT8,
                        np.dtype(np.float16): nccl.NCCL_FLOAT16,
                        np.dtype(np.float32): nccl.NCCL_FLOAT32,
                        np.dtype(np.float64): nccl.NCCL_FLOAT64}

    def _args(self, buf: Any) -> tuple[int, int, Any]:
        if buf.device.id != self.device:
            raise ValueError(f"arrays live on device {buf.device.id}, but this rank's NCCL "
                             f"communicator was made on device {self.device}")
        if buf.dtype not in self._dtypes:
            raise TypeError(f"NCCL collectives take {sorted(map(str, self._dtypes))}, got "
                            f"{buf.dtype}")
        return buf.data.ptr, buf.size, self._dtypes[buf.dtype]

    def broadcast(self, buf: Any, root: int) -> None:
        """Broadcast the cupy buffer ``buf`` from rank ``root``, in place."""
        ptr, count, dtype = self._args(buf)
        stream = self._cupy.cuda.get_current_stream()
        self._comm.bcast(ptr, count, dtype, root, stream.ptr)
        self._wait(lambda: stream.done)

    def allreduce_sum(self, buf: Any) -> None:
        """Sum the cupy buffer ``buf`` over the ranks, in place."""
        ptr, count, dtype = self._args(buf)
        stream = self._cupy.cuda.get_current_stream()
        self._comm.allReduce(ptr, ptr, count, dtype, self._nccl.NCCL_SUM, stream.ptr)
        self._wait(lambda: stream.done)
