"""Reference cross-entropy over the last axis: float64, explicit loops over rows and classes.

Checked against: lowbit/ops/cross_entropy/ (every backend), tests/test_cross_entropy.py.
Definition (``torch.nn.functional.cross_entropy`` with ``reduction="mean"``): the mean over the
rows whose target is not ``ignore_index`` of ``logsumexp(row) - row[target]``; NaN when no row
counts.
"""

import math

import numpy as np


def _rows(logits, targets):
    logits = np.asarray(logits, dtype=np.float64)
    classes = logits.shape[-1]
    return logits.reshape(-1, classes), np.asarray(targets).reshape(-1), classes


def _logsumexp(row):
    top = max(float(v) for v in row)
    total = 0.0
    for v in row:
        total += math.exp(float(v) - top)
    return top + math.log(total)


def cross_entropy_ref(logits, targets, ignore_index=-100):
    """Mean cross-entropy of ``logits`` [..., V] against integer ``targets`` [...].

    Returns:
        float: the mean loss over counted rows (NaN if none counts).
    """
    rows, flat, _ = _rows(logits, targets)
    total = 0.0
    count = 0
    for r in range(rows.shape[0]):
        t = int(flat[r])
        if t == ignore_index:
            continue
        total += _logsumexp(rows[r]) - float(rows[r, t])
        count += 1
    return total / count if count else math.nan


def cross_entropy_bwd_ref(dloss, logits, targets, ignore_index=-100):
    """Gradient of ``dloss * cross_entropy_ref(logits, targets)`` with respect to the logits.

    Returns:
        float64 array shaped like ``logits``: ``dloss * (softmax - onehot) / count`` in counted
        rows, zero in ignored rows.
    """
    rows, flat, classes = _rows(logits, targets)
    grad = np.zeros_like(rows)
    count = sum(1 for t in flat if int(t) != ignore_index)
    for r in range(rows.shape[0]):
        t = int(flat[r])
        if t == ignore_index:
            continue
        lse = _logsumexp(rows[r])
        for j in range(classes):
            p = math.exp(float(rows[r, j]) - lse)
            grad[r, j] = float(dloss) * (p - (1.0 if j == t else 0.0)) / count
    return grad.reshape(np.shape(logits))
