"""Strategies and checks shared by the property tests in ``tests/properties/test_*.py``.

Shapes come from ``dims`` (0, 1, primes and the kernels' block boundaries that each module
names), layouts from ``LAYOUTS`` through ``relayout`` (C and Fortran order, negative strides, a
strided slice of a larger buffer, read-only), values from ``values`` (ordinary, zeros, ties at
.5, huge, tiny and subnormal magnitudes). ``on_backends`` runs one call on every CPU backend that
can run here (cudasim only at small sizes: each emulated CUDA thread is an OS thread) and checks
that no input changed. Profiles: ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib

import numpy as np
from helpers import assert_close
from hypothesis import strategies as st

import lowbit
from lowbit import _dispatch

PRIMES = (2, 3, 5, 7, 13, 37, 113)
LAYOUTS = ("C", "F", "reversed", "strided", "readonly")
#: Largest element count of one input run under cudasim (a few blocks of OS threads).
SIM_MAX_ELEMENTS = 4096


def dims(*boundaries, low=1, high=None):
    """One dimension: ``low``, 1, a prime, or a kernel boundary and one past it."""
    fixed = {low, 1, *PRIMES, *boundaries, *(b + 1 for b in boundaries)}
    if high is not None:
        fixed = {d for d in fixed if d <= high}
    return st.sampled_from(sorted(d for d in fixed if d >= low))


def boundaries(module, *prefixes):
    """The positive integer constants of ``module`` whose names start with one of ``prefixes``:
    the kernels' block sizes, read from the kernel module so that a retuned block stays covered."""
    return sorted({v for k, v in vars(module).items() if k.isupper() and k.startswith(prefixes)
                   and isinstance(v, int) and not isinstance(v, bool) and v > 0})


def relayout(a: np.ndarray, layout: str) -> np.ndarray:
    """An array equal to ``a`` element for element, held in memory as ``layout`` says."""
    if layout == "C":
        return np.ascontiguousarray(a)
    if layout == "F":
        return np.asfortranarray(a)
    if layout == "reversed":
        # Negative strides on every axis: the values are stored back to front.
        index = (slice(None, None, -1),) * a.ndim
        buf = np.ascontiguousarray(a[index])
        return buf[index]
    if layout == "strided":
        buf = np.zeros(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype) if a.ndim else a.copy()
        if not a.ndim:
            return buf
        view = buf[..., 1::2]
        view[...] = a
        return view
    if layout == "readonly":
        out = a.copy()
        out.flags.writeable = False
        return out
    raise ValueError(f"unknown layout {layout!r}")


def values(dtype, *, huge=1e30, extremes=True):
    """Finite floats of ``dtype``: ordinary ones, zeros, .5 ties and (``extremes``) huge, tiny
    and subnormal magnitudes."""
    info = np.finfo(dtype)
    ordinary = st.floats(-8, 8, width=info.bits)
    special = [st.just(0.0), st.sampled_from([0.5, -0.5, 1.5, -2.5, 127.5, -126.5])]
    if extremes:
        special += [st.sampled_from([huge, -huge, float(info.tiny), -float(info.tiny),
                                     float(info.smallest_subnormal), 1e-30])]
    return st.one_of(ordinary, *special)


@st.composite
def arrays(draw, shape, dtype=np.float32, elements=None):
    """A C-order array of ``shape`` whose elements mix ``values(dtype)`` (or ``elements``)."""
    elements = values(dtype) if elements is None else elements
    size = int(np.prod(shape))
    flat = draw(st.lists(elements, min_size=size, max_size=size)) if size <= 64 else None
    if flat is None:
        # Big arrays: draw a seed and a few special values, fill the rest with normal noise.
        seed = draw(st.integers(0, 2**32 - 1))
        out = np.random.default_rng(seed).standard_normal(size)
        specials = draw(st.lists(elements, max_size=8))
        out[: len(specials)] = specials
        np.random.default_rng(seed).shuffle(out)
        return out.astype(dtype).reshape(shape)
    return np.asarray(flat, dtype=np.float64).astype(dtype).reshape(shape)


def assert_near(name, ref, out, rtol, floor):
    """``assert_close``, or a largest absolute error within ``floor``: for results that cancel
    far below the scale of the terms they sum (a layer norm's gradient over one or two features,
    a softmax gradient at a uniform row), where a relative error says nothing. Callers pass
    ``floor = rtol x`` that scale."""
    err = np.abs(np.asarray(out, dtype=np.float64) - np.asarray(ref, dtype=np.float64))
    if err.size and np.all(np.isfinite(err)) and float(err.max()) <= floor:
        return
    assert_close(name, ref, out, rtol)


def cpu_backends(elements: int = 0):
    """The CPU backends that run here; cudasim only up to ``SIM_MAX_ELEMENTS`` elements."""
    names = [b for b in ("numpy", "numba", "cudasim")
             if _dispatch.backend_unavailable_reason(b) is None]
    return [b for b in names if b != "cudasim" or elements <= SIM_MAX_ELEMENTS]


def _copy(value):
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def assert_same(name, before, after):
    """Bitwise equality of arrays (and of dicts/lists/tuples of them), NaNs included."""
    if isinstance(before, np.ndarray):
        assert after.shape == before.shape and after.dtype == before.dtype, name
        assert before.tobytes() == np.ascontiguousarray(after).tobytes(), f"{name} changed"
    elif isinstance(before, dict):
        for k in before:
            assert_same(f"{name}[{k!r}]", before[k], after[k])
    elif isinstance(before, (list, tuple)):
        for i, (b, a) in enumerate(zip(before, after)):
            assert_same(f"{name}[{i}]", b, a)


@contextlib.contextmanager
def unchanged(**inputs):
    """Fail if any of the named inputs (arrays or containers of arrays) changes in the block."""
    before = {name: _copy(value) for name, value in inputs.items()}
    yield
    for name, value in inputs.items():
        assert_same(name, before[name], value)


def on_backends(call, elements: int = 0, **inputs):
    """``{backend: call()}`` over ``cpu_backends(elements)``, each forced, inputs unchanged."""
    results = {}
    for name in cpu_backends(elements):
        with lowbit.use_backend(name), unchanged(**inputs):
            results[name] = call()
    return results
