"""What the Numba kernel files share: the float32 scale floor, the status bits, and the
stochastic-rounding noise (splitmix64's finalizer).

Package ``lowbit/ops/saved_activation/_numba/``: imported by ``_pack_dense.py`` and
``_sparse.py``; ``noise`` is the same function as ``_numpy.noise`` (and
``cuda/saved_activation.cu``). The values come from their owners: the scale floor from
``lowbit/ops/quantize`` (``EPS``), the status bits and the hash multipliers from
``lowbit/ops/saved_activation/__init__.py``.

Numba caches each kernel keyed on its own file only; ``__init__.py``'s ``numba_cache_guard``
clears the package's cached kernels when this file or those owners change, so the kernels that
inline ``noise`` recompile.
"""
import numba
import numpy as np

from ...quantize import EPS as _EPS
from .. import MIX1 as _MIX1
from .. import MIX2 as _MIX2
from .. import STATUS_NEGATIVE, STATUS_NONFINITE  # noqa: F401 (re-exported to the kernels)

#: The scale floor in float32, as the kernels compute.
EPS = np.float32(_EPS)
MIX1 = np.uint64(_MIX1)
MIX2 = np.uint64(_MIX2)
SHIFT30, SHIFT27, SHIFT31, SHIFT40 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(40)
INV_2_24 = np.float32(2.0**-24)


@numba.njit(inline="always")
def noise(index, key):
    """float32 noise in [0, 1) of flat element ``index`` in the stream ``key`` (top 24 bits)."""
    z = np.uint64(index) + key
    z = (z ^ (z >> SHIFT30)) * MIX1
    z = (z ^ (z >> SHIFT27)) * MIX2
    z = z ^ (z >> SHIFT31)
    return np.float32(z >> SHIFT40) * INV_2_24
