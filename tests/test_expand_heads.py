"""Tests of ``lowbit.expand_heads`` / ``lowbit.expand_heads_backward``.

Op: ``lowbit/ops/expand_heads/`` (array-generic, no backend kernels); reference:
``expand_heads_ref`` / ``expand_heads_bwd_ref`` in ``reference/segmented_attention.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_equal

import lowbit
from lowbit import _backend
from lowbit.reference.segmented_attention import expand_heads_bwd_ref, expand_heads_ref


@pytest.fixture(autouse=True)
def poisoned():
    """Every output starts as NaN: an element the op forgets to write fails the comparison."""
    previous = _backend.set_poison_outputs(True)
    yield
    _backend.set_poison_outputs(previous)


def test_issue_example():
    x = np.array([1, 2, 3, 4], dtype=np.float32).reshape(1, 2, 2)
    out = lowbit.expand_heads(x, 1, 4)
    assert_equal("out", np.array([1, 2, 1, 2, 3, 4, 3, 4], dtype=np.float32).reshape(1, 4, 2),
                 out)


@pytest.mark.parametrize("shape, axis, target", [
    ((5, 2, 3), 1, 8), ((5, 3, 1), -2, 3), ((1, 1, 7), 1, 5), ((4, 6), 0, 12), ((3,), 0, 9),
    ((2, 3, 4, 5), 2, 8),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8])
def test_matches_reference(rng, shape, axis, target, dtype):
    x = (rng.standard_normal(shape) * 10).astype(dtype)
    out = lowbit.expand_heads(x, axis, target)
    assert_equal("out", expand_heads_ref(x, axis, target), out)


@pytest.mark.parametrize("shape, axis, source", [
    ((5, 8, 3), 1, 2), ((5, 3, 1), -2, 3), ((1, 5, 7), 1, 1), ((12, 6), 0, 4), ((9,), 0, 3),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_matches_reference(rng, shape, axis, source, dtype):
    dy = rng.standard_normal(shape).astype(dtype)
    dx = lowbit.expand_heads_backward(dy, axis, source)
    assert dx.dtype == dtype
    assert_close("dx", expand_heads_bwd_ref(dy, axis, source), dx,
                 1e-6 if dtype == np.float32 else 1e-15)


def test_backward_is_adjoint(rng):
    x = rng.standard_normal((7, 3, 4))
    dy = rng.standard_normal((7, 12, 4))
    lhs = np.sum(lowbit.expand_heads(x, 1, 12) * dy)
    rhs = np.sum(x * lowbit.expand_heads_backward(dy, 1, 3))
    assert abs(lhs - rhs) <= 1e-12 * abs(lhs) + 1e-12


def test_inputs_not_modified(rng):
    x = rng.standard_normal((3, 2, 4))
    keep = x.copy()
    lowbit.expand_heads(x, 1, 6)
    lowbit.expand_heads_backward(x, 1, 1)
    assert_equal("x", keep, x)


@pytest.mark.parametrize("call, error, word", [
    (lambda x: lowbit.expand_heads(x.tolist(), 1, 4), TypeError, "x"),
    (lambda x: lowbit.expand_heads(np.float32(1.0), 0, 1), TypeError, "x"),
    (lambda x: lowbit.expand_heads(np.zeros(()), 0, 1), ValueError, "x"),
    (lambda x: lowbit.expand_heads(x, 3, 4), ValueError, "axis"),
    (lambda x: lowbit.expand_heads(x, 1.0, 4), TypeError, "axis"),
    (lambda x: lowbit.expand_heads(x[:, :0], 1, 4), ValueError, "head count"),
    (lambda x: lowbit.expand_heads(x, 1, 5), ValueError, "target_heads"),
    (lambda x: lowbit.expand_heads(x, 1, 0), ValueError, "target_heads"),
    (lambda x: lowbit.expand_heads(x, 1, 4.0), TypeError, "target_heads"),
    (lambda x: lowbit.expand_heads_backward(x.tolist(), 1, 1), TypeError, "dy"),
    (lambda x: lowbit.expand_heads_backward(x, -4, 1), ValueError, "axis"),
    (lambda x: lowbit.expand_heads_backward(x, 1, 3), ValueError, "source_heads"),
    (lambda x: lowbit.expand_heads_backward(x, 1, 0), ValueError, "source_heads"),
    (lambda x: lowbit.expand_heads_backward(x, 1, True), TypeError, "source_heads"),
], ids=["x-list", "x-scalar", "x-0d", "axis-range", "axis-float", "no-heads", "not-multiple",
        "target-zero", "target-float", "dy-list", "bwd-axis-range", "not-divisor",
        "source-zero", "source-bool"])
def test_validation(call, error, word):
    x = np.ones((3, 2, 4), dtype=np.float32)
    with pytest.raises(error, match=word):
        call(x)
