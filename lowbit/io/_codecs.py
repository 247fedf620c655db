"""Shared by ``gguf.py`` and ``hf_bitnet.py``: which conversion module runs (``codecs``:
``_numba.py`` where dispatch picks the numba backend, forced or automatic, else ``_numpy.py``,
also under a forced ``cudasim``, as these host byte shuffles have no CUDA kernel), the check
of a weight to export (``host_ternary``) and of an imported buffer and its shape
(``host_buffer``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from .. import _dispatch, _validate

if TYPE_CHECKING:
    from ..ops.quantize import PackedWeight


def codecs(*arrays: object) -> ModuleType:
    """The module of conversion functions for these host arrays."""
    name = _dispatch.select_backend(*arrays)
    return importlib.import_module(f"lowbit.io.{'_numba' if name == 'numba' else '_numpy'}")


def host_ternary(pw: object, name: str = "pw") -> PackedWeight:
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


def host_buffer(data: object, name: str, shape: object) -> tuple[int, int]:
    """``(K, N)`` of ``shape`` after checking that ``data`` (named ``name``) is a host numpy
    array and ``shape`` a pair of positive integers."""
    if not isinstance(_validate.as_array(data, name), np.ndarray):
        raise TypeError(f"{name} must be a host numpy array, got a cupy array; pass "
                        f"{name}.get()")
    if not (isinstance(shape, tuple) and len(shape) == 2):
        raise ValueError(f"shape must be a tuple (K, N), got {shape!r}")
    return (_validate.integer(shape[0], "shape[0]", minimum=1),
            _validate.integer(shape[1], "shape[1]", minimum=1))
