"""Shared by ``gguf.py`` and ``hf_bitnet.py``: which conversion module runs (``codecs``:
``_numba.py`` where dispatch picks the numba backend, forced or automatic, else ``_numpy.py``,
also under a forced ``cudasim``, as these host byte shuffles have no CUDA kernel) and the check
of a weight to export (``host_ternary``).
"""

import importlib

import numpy as np

from .. import _dispatch


def codecs(*arrays):
    """The module of conversion functions for these host arrays."""
    name = _dispatch.select_backend(*arrays)
    return importlib.import_module(f"lowbit.io.{'_numba' if name == 'numba' else '_numpy'}")


def host_ternary(pw, name="pw"):
    """``pw`` checked as a ternary ``PackedWeight`` on the host (contiguous data); messages name
    ``name``. A cupy-held weight is refused: lowbit never moves data off the GPU implicitly."""
    from ..ops.quantize import PackedWeight, checked_packed

    if not isinstance(pw, PackedWeight):
        raise TypeError(f"{name} must be a PackedWeight, got {type(pw).__name__}")
    pw = checked_packed(pw, name)
    if pw.format != "ternary":
        raise ValueError(f"{name}.format must be 'ternary' for this format, got {pw.format!r}")
    if not isinstance(pw.data, np.ndarray):
        raise TypeError(f"{name} must be held in numpy arrays, got cupy ones; move it to the "
                        "host first (e.g. PackedWeight(f, shape, data.get(), scale.get()))")
    return pw
