"""Models composed only of public lowbit ops: ``bdh`` (the BDH byte-level language model), the
training beside it (``train``: batches, schedules, checkpoints, the loop), and ``bitnet``
(inference of the published BitNet b1.58 models from Hugging Face folders and GGUF files).

``import lowbit.models.bdh`` / ``lowbit.models.train`` / ``lowbit.models.bitnet``, or reach them
as attributes (``lowbit.models.bdh``: imported on first access); parameters are dicts of arrays
under the reference implementation's names.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["bdh", "bitnet", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (its modules: "
                         f"{', '.join(__all__)})")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
