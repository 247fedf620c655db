"""lowbit: framework-free array functions for low-bit neural computation.

The public API: the ops of ``lowbit/ops/<op>/``, re-exported here, and four subpackages loaded
on first use (``lowbit.io``, ``lowbit.models``, ``lowbit.distributed``, ``lowbit.reference``), so
that ``import lowbit`` imports none of mpi4py, gguf, cupy or torch. Backends: numpy and numba on
numpy arrays, cuda on cupy arrays, cudasim (the CUDA kernels compiled for the CPU) when forced;
:func:`backend_status` says why one cannot run. The layout is described in the documentation's
architecture page (``docs/architecture``).
"""

import importlib as _importlib
import importlib.abc as _abc
import importlib.machinery as _machinery
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path
from types import ModuleType as _ModuleType
from typing import Any as _Any, Sequence as _Sequence


class _ReferenceFinder(_abc.MetaPathFinder):
    """Finds ``lowbit.reference`` (and its modules) in a checkout's ``reference/`` folder."""

    def __init__(self, folder: _Path) -> None:
        self.folder = folder

    def find_spec(self, fullname: str, path: _Sequence[str] | None = None,
                  target: _ModuleType | None = None) -> _machinery.ModuleSpec | None:
        if fullname != f"{__name__}.reference":
            return None  # its modules are found through the package's __path__
        init = self.folder / "__init__.py"
        return _util.spec_from_file_location(fullname, init,
                                              submodule_search_locations=[str(self.folder)])


def _alias_reference() -> None:
    """Make a checkout's ``reference/`` (beside ``lowbit/``) importable as ``lowbit.reference``.

    The wheel maps ``reference/`` to ``lowbit/reference`` (pyproject.toml ``package-dir``), and
    an editable install's finder does the same; a bare checkout on ``sys.path`` has neither, so a
    finder for that one package is added (nothing else of the repository becomes part of
    ``lowbit``). Nothing is imported until ``lowbit.reference`` is first used.
    """
    name = f"{__name__}.reference"
    if name in _sys.modules or _util.find_spec(name) is not None:
        return
    folder = _Path(__file__).resolve().parent.parent / "reference"
    if (folder / "__init__.py").is_file():
        _sys.meta_path.append(_ReferenceFinder(folder))


_alias_reference()

from ._version import __version__
from ._ctx import MemoryReport, memory_report
from ._backend import BackendImportWarning, clear_caches
from ._dispatch import (BackendUnavailableError, available_backends, backend_status,
                        use_backend)
from ._profile import profile
from .ops.pack_bits import pack_bits, unpack_bits
from .ops.adamw import AdamW
from .ops.cross_entropy import (CrossEntropyCtx, cross_entropy, cross_entropy_backward,
                                cross_entropy_forward)
from .ops.embedding import EmbeddingCtx, embedding, embedding_backward, embedding_forward
from .ops.layer_norm import LayerNormCtx, layer_norm, layer_norm_backward, layer_norm_forward
from .ops.rotary import RotaryCtx, rotary, rotary_backward, rotary_forward
from .ops.rms_norm import RMSNormCtx, rms_norm, rms_norm_backward, rms_norm_forward
from .ops.packed_matmul import LinearCtx, linear_backward, linear_forward, packed_matmul
from .ops.quantize import (PackedWeight, QuantizedActivation, fake_quantize_activation,
                           fake_quantize_weight, quantize_activation, quantize_weight)
from .ops.saved_activation import (PackedActivation, PackedMask, SavedConfig, pack_activation,
                                   pack_mask)
from .ops.expand_heads import expand_heads, expand_heads_backward
from .ops.segmented_attention import (
    SegmentedAttentionCtx,
    segmented_attention,
    segmented_attention_backward,
    segmented_attention_forward,
)
from .ops.gated_delta_scan import (GatedDeltaScanCtx, gated_delta_scan,
                                   gated_delta_scan_backward, gated_delta_scan_forward)
from .ops.selective_scan import (SelectiveScanCtx, selective_scan, selective_scan_backward,
                                 selective_scan_forward)
from .ops.lowrank_residual import (BlockPattern, LowBitPlan, LowrankResidualCtx, lowrank_residual,
                                   lowrank_residual_backward, lowrank_residual_forward,
                                   quantize_layer_weights)

#: Subpackages imported on first attribute access (PEP 562), with their optional dependencies.
_LAZY_SUBMODULES = ("distributed", "io", "models", "reference")

__all__ = [
    # backends, caches, memory, profiling
    "BackendImportWarning", "BackendUnavailableError", "MemoryReport", "__version__",
    "available_backends", "backend_status", "clear_caches", "memory_report", "profile", "use_backend",
    # ops
    "AdamW", "BlockPattern", "CrossEntropyCtx", "EmbeddingCtx", "GatedDeltaScanCtx",
    "LayerNormCtx", "LinearCtx", "LowBitPlan", "LowrankResidualCtx", "PackedActivation",
    "PackedMask", "PackedWeight", "QuantizedActivation", "SavedConfig", "SegmentedAttentionCtx",
    "SelectiveScanCtx", "cross_entropy", "cross_entropy_backward", "cross_entropy_forward",
    "embedding", "embedding_backward", "embedding_forward", "expand_heads",
    "expand_heads_backward", "fake_quantize_activation", "fake_quantize_weight",
    "gated_delta_scan", "gated_delta_scan_backward", "gated_delta_scan_forward", "layer_norm",
    "layer_norm_backward", "layer_norm_forward", "linear_backward", "linear_forward",
    "lowrank_residual", "lowrank_residual_backward", "lowrank_residual_forward", "pack_activation",
    "pack_bits", "pack_mask", "packed_matmul", "quantize_activation", "quantize_layer_weights",
    "quantize_weight", "segmented_attention", "segmented_attention_backward",
    "segmented_attention_forward", "selective_scan", "selective_scan_backward",
    "selective_scan_forward", "unpack_bits",
    "RotaryCtx", "rotary", "rotary_backward", "rotary_forward",
    "RMSNormCtx", "rms_norm", "rms_norm_backward", "rms_norm_forward",
    # subpackages, loaded on first use
    *_LAZY_SUBMODULES,
]


def __getattr__(name: str) -> _Any:
    """Import ``lowbit.io``, ``lowbit.models``, ``lowbit.distributed``, ``lowbit.reference`` on
    first access; the import binds the attribute, so this runs once per subpackage."""
    if name in _LAZY_SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (its public names are "
                         f"listed in lowbit.__all__)")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
