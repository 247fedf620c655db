"""``lowbit.profile()``: per-stage time and bytes held, for composite layers.

Used by ``lowbit/ops/lowrank_residual/__init__.py`` (stages: x projection, attention, norms,
y projection, product, decoder tail, residual); tests in ``tests/test_lowrank_residual.py``.

Bytes held after a stage are measured as:

- cupy arrays: ``cupy.get_default_memory_pool().used_bytes()`` (the pool's live allocations);
- numpy arrays: ``tracemalloc``'s current traced size, i.e. the bytes of every Python and NumPy
  allocation made since tracing started that are still alive (NumPy reports its data buffers to
  tracemalloc; so, as measured here, do the arrays that Numba-compiled code allocates).
  ``profile()`` starts tracemalloc if it is not running and stops it on exit; memory allocated
  before that start is not seen. Each stage also records the peak reached while it ran
  (tracemalloc's peak, restarted at every stage boundary and folded into
  ``Profile.peak_bytes``, the peak over the whole ``with`` block). On GPU both are the pool's
  ``used_bytes`` at the end of stages.

On GPU the profile keeps out of what it measures: a stage records a pair of CUDA events on the
current stream (no synchronization inside the step), the times are read once, with one
synchronization, when the records are first read or the block ends, and tracemalloc (which
would slow every host allocation of the launches) is stopped at the first GPU stage if
``profile()`` started it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
import tracemalloc
from typing import Any, Iterator

from . import _backend

_active: contextvars.ContextVar["Profile | None"] = contextvars.ContextVar(
    "lowbit_profile", default=None)


@dataclasses.dataclass
class StageRecord:
    """One stage of one phase: calls, total seconds, bytes held after its last call."""

    phase: str
    stage: str
    calls: int = 0
    seconds: float = 0.0
    bytes_held: int = 0
    peak_bytes: int = 0


class Profile:
    """Records of every stage entered while the profile is active; ``str()`` is a table."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, str], StageRecord] = {}
        self.peak_bytes = 0
        self.device = "cpu"
        #: Whether ``profile()`` started tracemalloc (and so may stop it).
        self.started_tracing = False
        #: GPU stages whose events are not read yet: (record, start event, end event).
        self._pending: list[tuple[StageRecord, Any, Any]] = []

    @property
    def records(self) -> dict[tuple[str, str], StageRecord]:
        """Every stage's record, keyed by (phase, stage); GPU times are read on first access."""
        self._resolve()
        return self._records

    def _resolve(self) -> None:
        """Read the pending GPU stages' event times after one synchronization."""
        if not self._pending:
            return
        cp = _backend.cupy_module()
        self._pending[-1][2].synchronize()
        for record, start, end in self._pending:
            record.seconds += cp.cuda.get_elapsed_time(start, end) * 1e-3
        self._pending.clear()

    def _held(self, gpu: bool) -> int:
        if gpu:
            # The pool's bookkeeping is host-side: allocations are counted when they are made.
            return int(_backend.cupy_module().get_default_memory_pool().used_bytes())
        return tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0

    def fold_peak(self) -> int:
        """CPU: fold tracemalloc's peak since the last fold into ``peak_bytes``, restart it."""
        if not tracemalloc.is_tracing():
            return 0
        peak = tracemalloc.get_traced_memory()[1]
        self.peak_bytes = max(self.peak_bytes, peak)
        tracemalloc.reset_peak()
        return peak

    def add(self, phase: str, stage: str, seconds: float | tuple[Any, Any], gpu: bool) -> None:
        """Record one call: ``seconds`` a float, or on GPU the (start, end) CUDA events."""
        record = self._records.setdefault((phase, stage), StageRecord(phase, stage))
        record.calls += 1
        if isinstance(seconds, tuple):
            self._pending.append((record, *seconds))
        else:
            record.seconds += seconds
        record.bytes_held = self._held(gpu)
        if gpu:
            self.device = "gpu"
            self.peak_bytes = max(self.peak_bytes, record.bytes_held)
            record.peak_bytes = max(record.peak_bytes, record.bytes_held)
        else:
            record.peak_bytes = max(record.peak_bytes, self.fold_peak())

    def __str__(self) -> str:
        header = ("phase", "stage", "calls", "ms", "MiB held after", "MiB peak in stage")
        records = self.records
        rows = [(r.phase, r.stage, str(r.calls), f"{r.seconds * 1e3:.2f}",
                 f"{r.bytes_held / 2**20:.2f}", f"{r.peak_bytes / 2**20:.2f}")
                for r in records.values()]
        rows.append(("total", "", "", f"{sum(r.seconds for r in records.values()) * 1e3:.2f}",
                     "", f"{self.peak_bytes / 2**20:.2f}"))
        widths = [max(len(x[i]) for x in [header] + rows) for i in range(len(header))]
        fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths))  # noqa: E731
        return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


@contextlib.contextmanager
def profile() -> Iterator[Profile]:
    """Record per-stage time and bytes held for every lowbit layer call inside the block.

    Example:
        >>> with lowbit.profile() as prof:
        ...     y, ctx = lowbit.lowrank_residual_forward(x, enc, enc_v, dec)
        ...     grads = lowbit.lowrank_residual_backward(dy, ctx)
        >>> print(prof)
    """
    prof = Profile()
    prof.started_tracing = not tracemalloc.is_tracing()
    if prof.started_tracing:
        tracemalloc.start()
    token = _active.set(prof)
    try:
        yield prof
    finally:
        _active.reset(token)
        prof._resolve()
        if prof.device == "cpu":
            prof.fold_peak()
        if prof.started_tracing and tracemalloc.is_tracing():
            tracemalloc.stop()


@contextlib.contextmanager
def stage(phase: str, name: str, like: object = None) -> Iterator[None]:
    """Time the enclosed code as stage ``name`` of ``phase`` when a profile is active.

    Args:
        phase: "forward" or "backward".
        name: the stage name printed in the table.
        like: an array of the call (cupy arrays switch to the memory pool and synchronize).
    """
    prof = _active.get()
    if prof is None:
        yield
        return
    if _backend.is_cupy_array(like):
        cp = _backend.cupy_module()
        if prof.started_tracing and tracemalloc.is_tracing():
            tracemalloc.stop()  # cupy arrays are not seen by it; it would slow the launches
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        yield
        end.record()
        prof.add(phase, name, (start, end), True)
        return
    prof.fold_peak()  # the peak before this stage belongs to no stage of it
    start = time.perf_counter()
    yield
    prof.add(phase, name, time.perf_counter() - start, False)
