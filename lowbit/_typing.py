"""Type aliases shared by the public signatures (annotations only; nothing here is checked).

``Array`` stands for a numpy or cupy array: cupy is optional, so the alias is ``Any`` rather
than a union naming ``cupy.ndarray``. ``Scalar`` is a Python or NumPy real number.
"""

from __future__ import annotations

import numbers
from typing import Any

#: A numpy.ndarray or a cupy.ndarray.
Array = Any
#: A Python or NumPy real number.
Scalar = numbers.Real

__all__ = ["Array", "Scalar"]
