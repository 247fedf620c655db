"""Argument checks shared by the ops' ``__init__`` modules; every message names the argument."""

from __future__ import annotations

import numbers

import numpy as np

from . import _backend


def as_array(x, name: str):
    """Return ``x`` if it is a numpy or cupy array, else raise TypeError naming ``name``."""
    if isinstance(x, np.ndarray) or _backend.is_cupy_array(x):
        return x
    raise TypeError(f"{name} must be a numpy or cupy array, got {type(x).__name__}")


def integer(value, name: str, *, minimum: int | None = None) -> int:
    """A Python/NumPy integer (not bool), optionally >= minimum."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def axis(value, ndim: int, name: str = "axis") -> int:
    """Normalize an axis index for an array of rank ``ndim``."""
    value = integer(value, name)
    if not -ndim <= value < ndim:
        raise ValueError(f"{name} {value} is out of range for an array of rank {ndim}")
    return value % ndim


def finite_scalar(value, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def floating(x, name: str):
    """Require a float32 or float64 array."""
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")
    return x


def all_finite(x, name: str):
    xp = _backend.array_module(x)
    if x.size and not bool(xp.isfinite(x).all()):
        raise ValueError(f"{name} must be finite, got non-finite values")
    return x
