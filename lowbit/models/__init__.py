"""Models composed only of public lowbit ops: ``bdh`` (the BDH byte-level language model) and the
training beside it (``train``: batches, schedules, checkpoints, the loop).

``import lowbit.models.bdh`` / ``lowbit.models.train``, or reach them as attributes
(``lowbit.models.bdh``: imported on first access); parameters are dicts of arrays under the
reference implementation's names.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["bdh", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (its modules: "
                         f"{', '.join(__all__)})")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
