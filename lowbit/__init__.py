"""lowbit: framework-free array functions for low-bit neural computation.

The public API, re-exported from ``lowbit/ops/<op>/``; see ``../README.md`` and DESIGN.md.
Backends: numpy and numba on numpy arrays, cuda on cupy arrays, cudasim (the CUDA kernels
compiled for the CPU) when forced.
"""

import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path


def _alias_reference():
    """Register a checkout's ``reference/`` (beside ``lowbit/``) as ``lowbit.reference``.

    The wheel maps ``reference/`` to ``lowbit/reference`` (setup.cfg ``package_dir``), and an
    editable install's finder does the same; a bare checkout on ``sys.path`` has neither. Only
    that one package is aliased: nothing else of the repository becomes part of ``lowbit``.
    """
    name = f"{__name__}.reference"
    if name in _sys.modules or _util.find_spec(name) is not None:
        return
    init = _Path(__file__).resolve().parent.parent / "reference" / "__init__.py"
    if not init.is_file():
        return
    spec = _util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = _util.module_from_spec(spec)
    _sys.modules[name] = module
    spec.loader.exec_module(module)
    globals()["reference"] = module


_alias_reference()

from ._ctx import MemoryReport, memory_report
from ._backend import clear_caches
from ._dispatch import BackendUnavailableError, available_backends, use_backend
from .ops.pack_bits import pack_bits, unpack_bits
from .ops.adamw import AdamW
from .ops.cross_entropy import (CrossEntropyCtx, cross_entropy, cross_entropy_backward,
                                cross_entropy_forward)
from .ops.embedding import EmbeddingCtx, embedding, embedding_backward, embedding_forward
from .ops.layer_norm import LayerNormCtx, layer_norm, layer_norm_backward, layer_norm_forward

# -- formats and matmul (issue 3) --
from .ops.packed_matmul import LinearCtx, linear_backward, linear_forward, packed_matmul
from .ops.quantize import (PackedWeight, QuantizedActivation, fake_quantize_activation,
                           fake_quantize_weight, quantize_activation, quantize_weight)
# -- saved activations (issue 4) --
from .ops.saved_activation import (PackedActivation, PackedMask, SavedConfig, pack_activation,
                                   pack_mask)
# -- segmented attention (issue 5) --
from .ops.expand_heads import expand_heads, expand_heads_backward
from .ops.segmented_attention import (
    SegmentedAttentionCtx,
    segmented_attention,
    segmented_attention_backward,
    segmented_attention_forward,
)
# -- scans (issue 6) --
from .ops.gated_delta_scan import (GatedDeltaScanCtx, gated_delta_scan,
                                   gated_delta_scan_backward, gated_delta_scan_forward)
from .ops.selective_scan import (SelectiveScanCtx, selective_scan, selective_scan_backward,
                                 selective_scan_forward)
# -- lowrank residual (issue 7) --
from ._profile import profile
from .ops.lowrank_residual import (BlockPattern, LowBitPlan, LowrankResidualCtx, lowrank_residual,
                                   lowrank_residual_backward, lowrank_residual_forward,
                                   quantize_layer_weights)

__version__ = "0.1.0"
