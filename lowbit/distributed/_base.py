"""What every communicator shares: argument checks, the one contiguous bucket per call, the
config check, and the size-1 communicator that does nothing.

Siblings: ``__init__.py`` (``communicator()``), ``_mpi.py`` (processes through mpi4py),
``_nccl.py`` (GPUs through CuPy's NCCL); tests ``tests/test_distributed.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, ContextManager, Sequence, TypeVar

import numpy as np

from .. import _backend, _validate
from .._typing import Array

#: A list (or tuple) of arrays that a collective updates in place and returns.
Arrays = TypeVar("Arrays", bound=Sequence[Any])


class RankFailedError(RuntimeError):
    """Another rank of the job failed; raised by a collective that was waiting for it."""


def _arrays(arrays: object, name: str = "arrays") -> list[Array]:
    """The list of arrays of a collective: all numpy or all cupy, writable, non-empty list."""
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{name} must be a list of arrays, got {type(arrays).__name__}")
    out = [_validate.as_array(a, f"{name}[{i}]") for i, a in enumerate(arrays)]
    for i, a in enumerate(out):
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"{name}[{i}] is read-only; collectives write their result in place")
    _backend.array_kind(*out)
    return out


def _float_dtype(arrays: Sequence[Array], name: str = "arrays") -> np.dtype:
    """The one floating dtype of ``arrays`` (the bucket's): a mean needs one and only one."""
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) > 1:
        raise TypeError(f"{name} mix dtypes {sorted(str(d) for d in dtypes)}; allreduce_mean "
                        f"packs one bucket of one floating dtype per call")
    dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
    if dtype.kind != "f":
        raise TypeError(f"{name} must be floating arrays for a mean, got {dtype}")
    return dtype


#: Byte alignment of each array inside a byte bucket, so that views of it are aligned on GPUs too.
ALIGN = 16


class Bucket:
    """One contiguous buffer for a list of arrays, reused while the layout stays the same.

    ``pack`` copies the arrays in, one after another: as bytes (each array at an offset aligned
    to ``ALIGN``) for a broadcast, as elements of their common dtype for a reduction;
    ``unpack`` copies the buffer back into them.
    """

    def __init__(self) -> None:
        self._buffer: Array | None = None

    @staticmethod
    def _offsets(arrays: Sequence[Array], dtype: np.dtype) -> tuple[list[tuple[int, int]], int]:
        offsets: list[tuple[int, int]] = []
        at = 0
        for a in arrays:
            n = a.size * a.itemsize // dtype.itemsize
            offsets.append((at, n))
            at += -(-n // ALIGN) * ALIGN if dtype == np.uint8 else n
        return offsets, at

    def pack(self, arrays: Sequence[Array], dtype: Any) -> Array:
        """Copy ``arrays`` into the bucket; returns it (1-d, ``dtype``)."""
        dtype = np.dtype(dtype)
        xp = _backend.array_module(*arrays)
        offsets, total = self._offsets(arrays, dtype)
        buf = self._buffer
        if buf is None or buf.size != total or buf.dtype != dtype or \
                _backend.array_module(buf) is not xp:
            buf = self._buffer = xp.zeros(total, dtype)
        for a, (at, n) in zip(arrays, offsets):
            buf[at:at + n] = xp.ascontiguousarray(a).reshape(-1).view(dtype)
        return buf

    def unpack(self, buf: Array, arrays: Arrays) -> Arrays:
        """Copy the bucket back into ``arrays`` (in place); returns them."""
        offsets, _ = self._offsets(arrays, buf.dtype)
        for a, (at, n) in zip(arrays, offsets):
            a[...] = buf[at:at + n].view(a.dtype).reshape(a.shape)
        return arrays


def digest(value: object) -> bytes:
    """SHA-256 of ``repr(value)``: what ranks compare to prove they run the same thing (frozen
    dataclasses, tuples of shapes and dtype names have a repr that is stable across processes)."""
    return hashlib.sha256(repr(value).encode()).digest()


class Communicator:
    """The interface: ``rank``, ``size``, ``broadcast``, ``allreduce_mean``, ``check_same``,
    ``allgather_object``, ``guard``. This base is the size-1 communicator: every collective
    checks its arguments and leaves the arrays as they are."""

    rank: int = 0
    size: int = 1

    def broadcast(self, arrays: Arrays, root: int = 0) -> Arrays:
        """Copy rank ``root``'s arrays into every rank's arrays, in place, as one bucket of bytes.

        Args:
            arrays: list of numpy (MPI) or cupy (NCCL) arrays, the same shapes and dtypes on
                every rank (``check_same`` proves that at the start of a job).
            root: the rank whose values everyone gets.

        Returns:
            ``arrays`` (the same list, its arrays updated).
        """
        checked = _arrays(arrays)
        root = self._root(root)
        if checked:
            self._broadcast(checked, root)
        return arrays

    def allreduce_mean(self, arrays: Arrays) -> Arrays:
        """Replace every array by its mean over the ranks, in place, as one bucket per call.

        Args:
            arrays: list of floating arrays of one dtype (numpy: MPI; cupy: NCCL).

        Returns:
            ``arrays``. Every rank gets the same bits: the sum is one MPI/NCCL reduction of the
            bucket in the arrays' dtype (its order is the library's, the same on every rank),
            then a division by ``size``.
        """
        checked = _arrays(arrays)
        _float_dtype(checked)
        if checked:
            self._allreduce_mean(checked)
        return arrays

    def check_same(self, value: object, what: str = "value") -> None:
        """Raise ``ValueError`` on every rank unless ``repr(value)`` is the same on every rank.

        Args:
            value: e.g. ``(config, parameter shapes and dtypes)``.
            what: names it in the message.
        """
        mine = digest(value)
        everyone = self.allgather_object(mine)
        if any(d != mine for d in everyone):
            groups: dict[str, list[int]] = {}
            for r, d in enumerate(everyone):
                groups.setdefault(d.hex()[:12], []).append(r)
            seen = "; ".join(f"ranks {ranks}: digest {h}" for h, ranks in groups.items())
            raise ValueError(f"{what} differ across the {self.size} ranks ({seen}); rank "
                             f"{self.rank} has {value!r}")

    def allgather_object(self, value: object) -> list[Any]:
        """Every rank's ``value`` (a picklable object), in rank order."""
        return [value]

    def guard(self) -> ContextManager[None]:
        """Context manager: an exception inside takes the whole job down, with a message on every
        rank, instead of leaving the other ranks waiting (size 1: exceptions pass as usual)."""
        return contextlib.nullcontext()

    def _root(self, root: object) -> int:
        root = _validate.integer(root, "root", minimum=0)
        if root >= self.size:
            raise ValueError(f"root must be a rank below size {self.size}, got {root}")
        return root

    def _broadcast(self, arrays: list[Array], root: int) -> None:
        pass

    def _allreduce_mean(self, arrays: list[Array]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"
