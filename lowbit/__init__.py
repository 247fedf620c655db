"""lowbit: framework-free array functions for low-bit neural computation.

The public API, re-exported from ``lowbit/ops/<op>/``; see ``../README.md`` and DESIGN.md.
Backends: numpy and numba on numpy arrays, cuda on cupy arrays, cudasim (the CUDA kernels
compiled for the CPU) when forced.
"""

from pathlib import Path as _Path

# A source checkout keeps reference/ beside lowbit/; the wheel maps it to lowbit/reference
# (setup.cfg package_dir). Let a checkout import it under the same name.
if not (_Path(__file__).parent / "reference").is_dir():
    __path__.append(str(_Path(__file__).resolve().parent.parent))  # noqa: F821

from ._ctx import MemoryReport, memory_report
from ._dispatch import BackendUnavailableError, available_backends, use_backend
from .ops.pack_bits import pack_bits, unpack_bits

# -- formats and matmul (issue 3) --
# -- saved activations (issue 4) --
# -- segmented attention (issue 5) --
# -- scans (issue 6) --
# -- lowrank residual (issue 7) --

__version__ = "0.1.0"
