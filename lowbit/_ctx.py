"""The ctx contract shared by every op: the saved-activation choke point and byte accounting.

Every tensor a backward needs is stored in its ctx through the saved-activation op's
``save(x, saved, kind=...)`` (``lowbit/ops/saved_activation``): with ``saved=None`` the array is
kept exact (``Exact``, defined here); otherwise it is packed (``PackedActivation``). This module
imports no op. ``Ctx.nbytes`` and
``Ctx.dense_nbytes`` walk the dataclass fields (nested ctxs, lists, dicts) and add up what was
saved; parameters the caller already holds (weights, their quantized forms) are plain fields and
are not counted. ``memory_report`` (re-exported as ``lowbit.memory_report``) lists every saved
tensor. Tests: ``tests/test_saved_activation.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from ._typing import Array


class Saved:
    """Interface of a saved tensor: ``unpack()``, ``shape``, ``format``, byte counts."""

    shape: tuple
    format: str

    @property
    def nbytes(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the same tensor held densely in float32."""
        return 4 * math.prod(self.shape)

    def unpack(self) -> Array:  # pragma: no cover - interface
        raise NotImplementedError


class Exact(Saved):
    """A tensor kept as is (``saved=None``): ``unpack()`` returns the very array."""

    format = "exact"

    def __init__(self, array: Array) -> None:
        self.array = array
        self.shape = tuple(array.shape)

    @property
    def nbytes(self) -> int:
        return int(self.array.itemsize * self.array.size)

    def unpack(self) -> Array:
        return self.array


class Ctx:
    """Mixin for every op's frozen ctx dataclass: byte accounting over its saved tensors."""

    @property
    def nbytes(self) -> int:
        """Bytes of every saved tensor this ctx (and its nested ctxs) holds."""
        return sum(row.nbytes for row in _walk(self, type(self).__name__))

    @property
    def dense_nbytes(self) -> int:
        """Bytes the same saved tensors would take held densely in float32."""
        return sum(row.dense_nbytes for row in _walk(self, type(self).__name__))


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """One saved tensor of a ctx: its path in the ctx, shape, format and byte counts."""

    name: str
    shape: tuple
    format: str
    nbytes: int
    dense_nbytes: int


def _walk(obj: Any, prefix: str) -> Iterator[MemoryRow]:
    if isinstance(obj, Saved):
        yield MemoryRow(prefix, tuple(obj.shape), obj.format, obj.nbytes, obj.dense_nbytes)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), f"{prefix}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{prefix}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from _walk(item, f"{prefix}[{key!r}]")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Rows of every saved tensor in a ctx, with totals; ``str()`` is a table."""

    rows: tuple
    nbytes: int
    dense_nbytes: int

    def __str__(self) -> str:
        header = ("tensor", "shape", "format", "bytes", "fp32 bytes", "ratio")
        lines = [
            (r.name, "x".join(map(str, r.shape)), r.format, f"{r.nbytes:,}", f"{r.dense_nbytes:,}",
             f"{r.nbytes / r.dense_nbytes:.3f}" if r.dense_nbytes else "-")
            for r in self.rows
        ]
        ratio = f"{self.nbytes / self.dense_nbytes:.3f}" if self.dense_nbytes else "-"
        lines.append(("total", "", "", f"{self.nbytes:,}", f"{self.dense_nbytes:,}", ratio))
        widths = [max(len(str(x[i])) for x in [header] + lines) for i in range(len(header))]
        fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths))  # noqa: E731
        rule = "  ".join("-" * w for w in widths)
        return "\n".join([fmt(header), rule] + [fmt(r) for r in lines])


def memory_report(ctx: Any) -> MemoryReport:
    """Every saved tensor of ``ctx`` (nested ctxs included): name, shape, format, bytes."""
    rows = tuple(_walk(ctx, type(ctx).__name__))
    return MemoryReport(rows, sum(r.nbytes for r in rows), sum(r.dense_nbytes for r in rows))
