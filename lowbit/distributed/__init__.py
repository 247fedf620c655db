"""Data-parallel training on existing engines: MPI for processes (mpi4py), NCCL for GPUs (CuPy).

``lowbit.distributed.communicator()`` is what a training script asks for::

    comm = lowbit.distributed.communicator()   # under mpiexec: MPI; else size 1, a no-op
    comm.broadcast(list(params.values()), root=0)
    comm.allreduce_mean(list(grads.values()))  # numpy: MPI; cupy: NCCL; one bucket per call

and ``lowbit.models.train.train(..., comm=comm)`` uses it. Files: ``_base.py`` (the interface,
the bucket, the size-1 communicator), ``_mpi.py`` (mpi4py; failure notices and ``Abort``),
``_nccl.py`` (cupy arrays); tests ``tests/test_distributed.py``; bench
``bench/train_distributed.py`` (``mpiexec -n 2 python -m bench train --distributed``).
mpi4py is the optional extra ``mpi`` (``pip install "lowbit[mpi]"``); this package imports
without it (mpi4py is imported when an ``MPICommunicator`` is made, cupy when NCCL is first used).
"""

from __future__ import annotations

import os
from typing import Any

from ._base import Communicator, RankFailedError, digest
from ._mpi import MPICommunicator
from ._nccl import NCCLCommunicator

#: Environment variables that MPI launchers set in the processes they start (MPICH's and Intel's
#: hydra and Slurm's PMI, Open MPI, PMIx): without any of them there is no job to join.
LAUNCHER_VARIABLES = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")

_world: Communicator | None = None


def communicator(comm: Any = None) -> Communicator:
    """The communicator of this process.

    Args:
        comm: an mpi4py communicator to run over; None: ``MPI.COMM_WORLD`` when an MPI launcher
            started this process (``mpiexec``), else the size-1 communicator whose collectives do
            nothing (and mpi4py is not imported).

    Returns:
        a ``Communicator`` with ``rank``, ``size``, ``broadcast(arrays, root=0)``,
        ``allreduce_mean(arrays)``, ``check_same(value, what)``, ``allgather_object(value)``
        and ``guard()``; the world's is made once and shared.

    Raises:
        ImportError: MPI is needed and mpi4py is missing (it says ``pip install "lowbit[mpi]"``).
    """
    global _world
    if comm is not None:
        return MPICommunicator(comm)
    if _world is None:
        launched = any(v in os.environ for v in LAUNCHER_VARIABLES)
        _world = MPICommunicator() if launched else Communicator()
    return _world


__all__ = ["Communicator", "MPICommunicator", "NCCLCommunicator", "RankFailedError",
           "communicator", "digest"]
