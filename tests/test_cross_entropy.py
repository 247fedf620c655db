"""Tests of ``lowbit/ops/cross_entropy`` on every backend.

Reference: ``reference/cross_entropy.py``; kernels: ``cuda/cross_entropy.cu``. Every backend's
loss and gradient are compared with the float64 reference, which is itself checked against
central finite differences.
"""

import numpy as np
import pytest
from helpers import assert_close, assert_equal, numerical_grad, to_numpy

import lowbit
from lowbit._ctx import Exact
from lowbit.reference.cross_entropy import cross_entropy_bwd_ref, cross_entropy_ref

RTOL = {np.float32: 2e-6, np.float64: 1e-12}
CLASSES = (1, 3, 37, 256)
ROWS = (1, 3, 37, 300)


def _problem(rng, rows, classes, dtype, ignored=0.0, lead=None):
    shape = (rows,) if lead is None else lead
    logits = (rng.standard_normal(shape + (classes,)) * 3).astype(dtype)
    targets = rng.integers(0, classes, shape)
    if ignored:
        drop = rng.random(shape) < ignored
        drop.flat[0] = False  # at least one row counts: the loss is finite
        targets[drop] = -100
    return logits, targets


def _check(backend, logits, targets, rtol, dloss=0.75, **kwargs):
    keep_logits, keep_targets = logits.copy(), targets.copy()
    x, t = backend.to(logits), backend.to(targets)
    loss, ctx = lowbit.cross_entropy_forward(x, t, **kwargs)
    assert isinstance(loss, backend.xp.ndarray) and loss.shape == () and loss.dtype == x.dtype
    ref = np.asarray(cross_entropy_ref(logits, targets, **kwargs))
    assert_close("loss", ref, loss, rtol)
    assert_equal("inference loss", to_numpy(loss), to_numpy(lowbit.cross_entropy(x, t, **kwargs)))
    grad = lowbit.cross_entropy_backward(dloss, ctx)
    assert isinstance(grad, backend.xp.ndarray) and grad.dtype == x.dtype
    assert_close("dlogits", cross_entropy_bwd_ref(dloss, logits, targets, **kwargs), grad, rtol)
    np.testing.assert_array_equal(to_numpy(x), keep_logits)
    np.testing.assert_array_equal(to_numpy(t), keep_targets)
    return loss, ctx, grad


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("classes", CLASSES)
def test_matches_reference(backend, rng, classes, dtype):
    # 37 rows are 10 blocks of the row kernels, 300 rows 75 (0.4 s under cudasim).
    for rows in ROWS:
        logits, targets = _problem(rng, rows, classes, dtype, ignored=0.2)
        _, ctx, _ = _check(backend, logits, targets, RTOL[dtype])
        counted = int((targets != -100).sum())
        assert ctx.count == counted and ctx.ignore_index == -100 and ctx.dtype == dtype
        assert isinstance(ctx.logits, Exact) and isinstance(ctx.lse, Exact)
        assert ctx.lse.unpack().dtype == np.float64 and ctx.targets.unpack().dtype == np.int64
        assert ctx.nbytes == logits.nbytes + 8 * rows + 8 * rows


@pytest.mark.parametrize("lead", [(), (2, 5)], ids=["0-d", "2x5"])
def test_leading_shapes(backend, rng, lead):
    logits, targets = _problem(rng, 0, 37, np.float32, lead=lead)
    targets = np.asarray(targets)
    assert targets.shape == lead
    _, _, grad = _check(backend, logits, targets, RTOL[np.float32])
    assert grad.shape == lead + (37,)


def test_noncontiguous_logits_and_int32_targets(backend, rng):
    logits = (rng.standard_normal((37, 12)) * 2).astype(np.float32)[:, ::2]
    targets = rng.integers(0, 6, 37).astype(np.int32)
    targets[::4] = -100
    _check(backend, logits, targets, RTOL[np.float32])


def test_ignored_rows(backend, rng):
    logits, targets = _problem(rng, 37, 5, np.float64)
    targets[::3] = 2  # a class inside [0, V) used as ignore_index
    _, ctx, grad = _check(backend, logits, targets, RTOL[np.float64], ignore_index=2)
    assert ctx.count == int((targets != 2).sum())
    assert not to_numpy(grad)[targets == 2].any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_rows_ignored(backend, rng, dtype):
    logits, targets = _problem(rng, 5, 3, dtype)
    targets[:] = -100
    loss, ctx = lowbit.cross_entropy_forward(backend.to(logits), backend.to(targets))
    assert np.isnan(float(to_numpy(loss))) and ctx.count == 0  # as torch gives
    grad = lowbit.cross_entropy_backward(1.0, ctx)
    assert_equal("dlogits", np.zeros_like(logits), grad)


def test_no_rows(backend):
    logits = np.zeros((0, 4), np.float32)
    loss, ctx = lowbit.cross_entropy_forward(backend.to(logits),
                                             backend.to(np.zeros(0, np.int64)))
    assert np.isnan(float(to_numpy(loss))) and loss.dtype == np.float32
    assert lowbit.cross_entropy_backward(1.0, ctx).shape == (0, 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits(backend, rng, dtype):
    # Logits of magnitude 1e4: spread out (a near one-hot softmax) and offset by 1e4 with O(1)
    # differences, where a logsumexp rounded to float32 would be off by 1e-3.
    rows = 37
    spread = (rng.standard_normal((rows, 11)) * 1e4).astype(dtype)
    offset = (1e4 * np.sign(rng.standard_normal((rows, 1))) + rng.standard_normal((rows, 11)))
    for logits in (spread, offset.astype(dtype)):
        targets = rng.integers(0, 11, rows)
        _check(backend, logits, targets, RTOL[dtype])


def test_minus_inf_off_target(backend, rng):
    logits, targets = _problem(rng, 37, 9, np.float32)
    mask = rng.random(logits.shape) < 0.5
    mask[np.arange(37), targets] = False
    mask[0, :] = True
    mask[0, targets[0]] = False  # a row whose only finite logit is its target: loss 0
    logits[mask] = -np.inf
    loss, _, grad = _check(backend, logits, targets, RTOL[np.float32])
    assert not to_numpy(grad)[mask].any()
    assert np.isfinite(float(to_numpy(loss)))


def test_dloss_forms(backend, rng):
    logits, targets = _problem(rng, 3, 4, np.float32)
    _, ctx = lowbit.cross_entropy_forward(backend.to(logits), backend.to(targets))
    want = to_numpy(lowbit.cross_entropy_backward(0.5, ctx))
    for dloss in (np.float32(0.5), np.float64(0.5), backend.xp.asarray(0.5, np.float32)):
        assert_equal(f"dloss {type(dloss).__name__}", want,
                     lowbit.cross_entropy_backward(dloss, ctx))
    assert_close("dlogits", cross_entropy_bwd_ref(0.5, logits, targets), want, RTOL[np.float32])


def test_deterministic(backend, rng):
    logits, targets = _problem(rng, 37, 256, np.float32, ignored=0.1)
    x, t = backend.to(logits), backend.to(targets)
    runs = [lowbit.cross_entropy_forward(x, t) for _ in range(2)]
    assert_equal("loss", to_numpy(runs[0][0]), to_numpy(runs[1][0]))
    assert_equal("dlogits", to_numpy(lowbit.cross_entropy_backward(1.0, runs[0][1])),
                 to_numpy(lowbit.cross_entropy_backward(1.0, runs[1][1])))


def test_saved_policy_packs_the_logits(backend, rng):
    logits, targets = _problem(rng, 37, 64, np.float32)
    _, exact = lowbit.cross_entropy_forward(backend.to(logits), backend.to(targets))
    _, packed = lowbit.cross_entropy_forward(backend.to(logits), backend.to(targets),
                                             saved="int8")
    assert packed.logits.format == "int8" and packed.nbytes < exact.nbytes
    assert isinstance(packed.lse, Exact) and isinstance(packed.targets, Exact)
    grad = lowbit.cross_entropy_backward(1.0, packed)
    assert grad.dtype == np.float32 and grad.shape == logits.shape
    assert_close("dlogits (int8 logits)", cross_entropy_bwd_ref(1.0, logits, targets), grad,
                 rtol=0.05)


def test_reference_backward_matches_finite_differences(rng):
    logits, targets = _problem(rng, 7, 5, np.float64, lead=(7,))
    targets[2] = -100
    logits[3, (targets[3] + 1) % 5] = -np.inf  # contributes exp(-inf) = 0, gradient 0
    dloss = 1.7
    finite = np.isfinite(logits)
    num = numerical_grad(lambda: dloss * cross_entropy_ref(logits, targets), logits)
    ana = cross_entropy_bwd_ref(dloss, logits, targets)
    assert_close("dlogits", ana[finite], num[finite], rtol=1e-7)
    assert not ana[~finite].any() and not ana[2].any()


def test_matches_torch(rng):
    torch = pytest.importorskip("torch")
    logits, targets = _problem(rng, 37, 11, np.float64, ignored=0.3)
    x = torch.tensor(logits, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(x, torch.tensor(targets), ignore_index=-100)
    loss.backward()
    ours, ctx = lowbit.cross_entropy_forward(logits, targets)
    assert_close("loss", np.asarray(loss.item()), ours, 1e-12)
    assert_close("dlogits", x.grad.numpy(), lowbit.cross_entropy_backward(1.0, ctx), 1e-12)


# -- validation ----------------------------------------------------------------------------


def _valid(rng):
    return _problem(rng, 6, 4, np.float32)


@pytest.mark.parametrize("change, error, match", [
    (lambda x, t: (x, np.array([0, 1, 4, 0, 1, 2])), ValueError, r"targets.*\[0, 4\).*got 4"),
    (lambda x, t: (x, np.array([0, -1, 1, 0, 1, 2])), ValueError, r"targets.*got -1 at flat"),
    (lambda x, t: (x, np.array([0, 1, 2, 3, 2, 2**64 - 100], np.uint64)), ValueError,
     f"targets.*got {2**64 - 100}"),
    (lambda x, t: (x, t.astype(np.float32)), TypeError, "targets must be an integer array"),
    (lambda x, t: (x, t.astype(bool)), TypeError, "targets must be an integer array"),
    (lambda x, t: (x, t[:5]), ValueError, r"targets must have the logits' leading shape \(6,\)"),
    (lambda x, t: (x, t[:, None]), ValueError, "targets must have"),
    (lambda x, t: (x, list(t)), TypeError, "targets must be a numpy or cupy array"),
    (lambda x, t: (np.asarray(x[0, 0]), t), ValueError, "logits must have at least one dimension"),
    (lambda x, t: (x[:, :0], t), ValueError, "logits must have V"),
    (lambda x, t: (x.astype(np.int32), t), TypeError, "logits must be float32 or float64"),
    (lambda x, t: (x.astype(np.float16), t), TypeError, "logits must be float32 or float64"),
    (lambda x, t: (x.tolist(), t), TypeError, "logits must be a numpy or cupy array"),
], ids=["target-V", "target-negative", "target-uint64-wraps", "targets-float", "targets-bool",
        "targets-short", "targets-rank", "targets-list", "logits-0d", "logits-no-classes",
        "logits-int", "logits-half", "logits-list"])
def test_bad_inputs(rng, never_runs, change, error, match):
    logits, targets = change(*_valid(rng))
    with pytest.raises(error, match=match):
        lowbit.cross_entropy_forward(logits, targets)
    with pytest.raises(error, match=match):
        lowbit.cross_entropy(logits, targets)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"ignore_index": 1.5}, TypeError, "ignore_index"),
    ({"ignore_index": True}, TypeError, "ignore_index"),
    ({"ignore_index": 2**63}, ValueError, "ignore_index must fit in int64"),
    ({"saved": "int3"}, ValueError, "saved"),
    ({"saved": 8}, TypeError, "saved"),
], ids=["ignore-float", "ignore-bool", "ignore-wide", "saved-name", "saved-type"])
def test_bad_options(rng, never_runs, kwargs, error, match):
    logits, targets = _valid(rng)
    with pytest.raises(error, match=match):
        lowbit.cross_entropy_forward(logits, targets, **kwargs)


@pytest.mark.parametrize("poison, match", [
    (lambda x, t: x.__setitem__((2, 1), np.nan), "logits must be finite.*row 2"),
    (lambda x, t: x.__setitem__((4, 0), np.inf), "logits must be finite.*row 4"),
    (lambda x, t: x.__setitem__((0, slice(None)), -np.inf), "logits must be finite.*row 0"),
    (lambda x, t: x.__setitem__((3, t[3]), -np.inf), "-inf at the target of row 3"),
], ids=["nan", "inf", "row-of-minus-inf", "minus-inf-target"])
def test_bad_logit_values(backend, rng, poison, match):
    logits, targets = _valid(rng)
    poison(logits, targets)
    with pytest.raises(ValueError, match=match):
        lowbit.cross_entropy_forward(backend.to(logits), backend.to(targets))


def test_nan_in_an_ignored_row_is_rejected(backend, rng):
    logits, targets = _valid(rng)
    targets[1] = -100
    logits[1, 2] = np.nan
    with pytest.raises(ValueError, match="logits must be finite.*row 1"):
        lowbit.cross_entropy(backend.to(logits), backend.to(targets))


@pytest.mark.parametrize("dloss, error, match", [
    (np.ones(1, np.float32), ValueError, r"dloss must be a scalar.*\(1,\)"),
    (np.ones((2, 2)), ValueError, "dloss must be a scalar"),
    (np.array(1, np.int32), TypeError, "dloss must be float32 or float64"),
    ([1.0], TypeError, "dloss must be a real scalar"),
    ("1", TypeError, "dloss must be a real scalar"),
    (True, TypeError, "dloss"),
], ids=["shape-1", "matrix", "int-array", "list", "string", "bool"])
def test_bad_dloss(rng, never_runs, dloss, error, match):
    with never_runs.paused():
        _, ctx = lowbit.cross_entropy_forward(*_valid(rng))
    with pytest.raises(error, match=match):
        lowbit.cross_entropy_backward(dloss, ctx)


def test_foreign_ctx(rng, never_runs):
    with never_runs.paused():
        _, ctx = lowbit.segmented_attention_forward(
            *(rng.standard_normal((4, 1, 2)).astype(np.float32) for _ in range(3)), [4])
    for bad in (ctx, object(), None):
        with pytest.raises(TypeError, match="ctx must be a CrossEntropyCtx"):
            lowbit.cross_entropy_backward(1.0, bad)
