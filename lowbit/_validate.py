"""Argument checks shared by the ops' ``__init__`` modules; every message names the argument.

One rule, one function: segment lengths (``offsets``), shapes (``shape``), scalars and arrays.
The ``saved=`` policy is parsed by its owner, ``lowbit.ops.saved_activation.saved_policy``.
"""

from __future__ import annotations

import numbers

import numpy as np
from numpy.typing import DTypeLike

from . import _backend, _kernels
from ._typing import Array


def as_array(x: object, name: str) -> Array:
    """Return ``x`` if it is a numpy or cupy array, else raise TypeError naming ``name``."""
    if isinstance(x, np.ndarray) or _backend.is_cupy_array(x):
        return x
    raise TypeError(f"{name} must be a numpy or cupy array, got {type(x).__name__}")


def integer(value: object, name: str, *, minimum: int | None = None) -> int:
    """A Python/NumPy integer (not bool), optionally >= minimum."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def axis(value: object, ndim: int, name: str = "axis") -> int:
    """Normalize an axis index for an array of rank ``ndim``."""
    value = integer(value, name)
    if not -ndim <= value < ndim:
        raise ValueError(f"{name} {value} is out of range for an array of rank {ndim}")
    return value % ndim


def finite_scalar(value: object, name: str) -> float:
    """A Python/NumPy real number (not bool) that is finite, as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def positive_scalar(value: object, name: str) -> float:
    """``finite_scalar`` that is also > 0 (an epsilon, a rotary base)."""
    value = finite_scalar(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def floating(x: Array, name: str) -> Array:
    """Require a float32 or float64 array."""
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")
    return x


def grad_dtype(x: Array, dtype: DTypeLike, name: str) -> Array:
    """A backward's incoming gradient must have the dtype of the forward output it pairs with
    (NumPy's rule: results follow the inputs' dtype, nothing is cast silently)."""
    if x.dtype != dtype:
        raise TypeError(f"{name} must have the forward output's dtype {np.dtype(dtype)}, got "
                        f"{x.dtype}")
    return x


def all_finite(x: Array, name: str) -> Array:
    """Require every element of ``x`` finite: a full pass and one read from the device, so hot
    paths check inside the kernels that read the data instead (a status word)."""
    xp = _backend.array_module(x)
    if x.size and _kernels.read_status(~xp.isfinite(x).all()):
        raise ValueError(f"{name} must be finite, got non-finite values")
    return x


def shape_error(name: str, expected: tuple, got: tuple, what: str = "") -> ValueError:
    """The one message of a shape disagreement: names the argument, expected and received."""
    whose = f"{what} " if what else ""
    return ValueError(f"{name} must have {whose}shape {tuple(expected)}, got {tuple(got)}")


def shape(x: Array, expected: tuple, name: str, what: str = "") -> Array:
    """Require ``x.shape == expected``; ``what`` says whose shape it is ("the forward output's")."""
    if tuple(x.shape) != tuple(expected):
        raise shape_error(name, expected, x.shape, what)
    return x


def offsets(lengths: object, tokens: int, name: str = "lengths") -> np.ndarray:
    """Validate segment lengths and return the int64 prefix table ``[0, l0, l0 + l1, ..., T]``.

    ``lengths`` is a non-empty 1-D host sequence or numpy array of positive integers (not bools)
    summing to ``tokens``. A cupy array is refused: segment bounds are needed on the host, and
    lowbit never moves data between device and host implicitly.
    """
    if _backend.is_cupy_array(lengths):
        raise TypeError(f"{name} must be a host sequence or numpy array, got a cupy array; "
                        f"pass {name}.get() (segment bounds are needed on the host)")
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise TypeError(f"{name} must be a 1-D sequence of integers, got "
                        f"{type(lengths).__name__}")
    if not isinstance(lengths, np.ndarray) and any(
            isinstance(x, (bool, np.bool_)) for x in np.ravel(np.asarray(lengths, dtype=object))):
        raise TypeError(f"{name} must hold integers, got a bool entry")
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a 1-D sequence of integers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must be non-empty, got 0 segments")
    if arr.dtype == object:
        values = list(arr)
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))
                   for x in values):
            raise TypeError(f"{name} must hold integers, got non-integer entries")
    elif arr.dtype.kind not in "iu":  # bool arrays too: a mask is not a list of lengths
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    else:
        values = arr.tolist()
    # Python integers: the running total cannot wrap, whatever the caller's integer width.
    total = 0
    table = [0]
    for i, length in enumerate(values):
        length = int(length)
        if length < 1:
            raise ValueError(f"{name} must all be positive, got {name}[{i}] = {length}")
        total += length
        if total > tokens:
            raise ValueError(
                f"{name} must sum to the token count {tokens}; the running total passes it at "
                f"{name}[{i}] ({total})")
        table.append(total)
    if total != tokens:
        raise ValueError(f"{name} must sum to the token count {tokens}, got {total}")
    return np.asarray(table, dtype=np.int64)
