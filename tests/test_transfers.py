"""Host <-> device transfers of the ops' hot paths, counted at the module boundary on cudasim.

On a GPU every read of device data by the host is a synchronization. The launchers move data only
through ``lowbit._kernels.host_copy`` / ``device_copy`` (a status word is read with
``read_status``, one ``host_copy``), which the ``transfers`` fixture counts. cudasim's "device
arrays" are numpy arrays, so an implicit read (``int(a)``, ``bool(a.any())``, ``a.item()``) is
caught another way: the inputs and every array a backend allocates are ``Device`` arrays, a numpy
subclass (kept through views, ufuncs and reductions) whose conversions to Python values count.
A hot path may read one status word (or, for the sparse format, its nonzero count too) and
upload nothing once its tables are cached.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import lowbit
from lowbit import _backend, _cudasim, _kernels
from lowbit.ops.lowrank_residual import _cuda as lowrank_cuda


class Device(np.ndarray):
    """A numpy array standing for device memory: every conversion to a Python value is a read."""

    counts: collections.Counter = collections.Counter()

    def _read(self):
        Device.counts["implicit"] += 1

    def __bool__(self):
        self._read()
        return super().__bool__()

    def __int__(self):
        self._read()
        return super().__int__()

    def __float__(self):
        self._read()
        return super().__float__()

    def __index__(self):
        self._read()
        return super().__index__()

    def item(self, *args):
        self._read()
        return super().item(*args)

    def tolist(self):
        self._read()
        return super().tolist()


@pytest.fixture
def transfers(monkeypatch):
    """Force cudasim, make backend allocations ``Device`` arrays, count every transfer.

    Returns the Counter (keys ``to_host``, ``to_device``, ``implicit``); ``dev(a)`` wraps test
    inputs. Tests warm an op up (kernels loaded, tables cached), clear the counts, run it again.
    """
    if not _cudasim.available():
        pytest.skip(f"cudasim unavailable: {_cudasim.unavailable_reason()}")
    counts = Device.counts
    host_copy, device_copy, empty = _kernels.host_copy, _kernels.device_copy, _backend.empty

    def counted_host_copy(a):
        counts["to_host"] += 1
        return host_copy(a)

    def counted_device_copy(a, like):
        counts["to_device"] += 1
        return device_copy(a, like).view(Device)

    monkeypatch.setattr(_kernels, "host_copy", counted_host_copy)
    monkeypatch.setattr(_kernels, "device_copy", counted_device_copy)
    monkeypatch.setattr(_backend, "empty", lambda *a, **k: empty(*a, **k).view(Device))
    monkeypatch.setattr(_kernels, "_constants", collections.OrderedDict())
    counts.clear()
    with lowbit.use_backend("cudasim"):
        yield counts
    counts.clear()


def dev(a):
    return np.ascontiguousarray(a).view(Device)


def _measure(counts, fn):
    fn()
    counts.clear()
    result = fn()
    return dict(counts), result


def _x(rng, shape=(5, 37)):
    return dev(rng.standard_normal(shape).astype(np.float32))


#: name -> (the call, given an rng; the reads from the device it may make).
HOT_PATHS = {
    "quantize_activation": (lambda r: lowbit.quantize_activation(_x(r)), 1),
    "quantize_weight ternary": (lambda r: lowbit.quantize_weight(_x(r, (37, 6)), "ternary"), 1),
    "quantize_weight int8": (lambda r: lowbit.quantize_weight(_x(r, (37, 6)), "int8"), 1),
    "pack_bits uint8 2 bits": (
        lambda r: lowbit.pack_bits(dev(r.integers(0, 4, (3, 41), dtype=np.uint8)), 2), 1),
    "pack_bits uint8 8 bits": (
        lambda r: lowbit.pack_bits(dev(r.integers(0, 256, (3, 41), dtype=np.uint8)), 8), 0),
    "unpack_bits": (
        lambda r: lowbit.unpack_bits(dev(r.integers(0, 256, (3, 11), dtype=np.uint8)), 4, 21), 0),
    "pack_activation int8": (lambda r: lowbit.pack_activation(_x(r), "int8", group_size=8), 1),
    "pack_activation int4 nonneg": (
        lambda r: lowbit.pack_activation(abs(_x(r)), "int4", kind="nonneg", group_size=8), 1),
    "pack_activation fp32": (lambda r: lowbit.pack_activation(_x(r), "fp32"), 1),
    # The nonzero count sizes the sparse outputs: one read for it, one for the status.
    "pack_activation sparse": (
        lambda r: lowbit.pack_activation(np.maximum(_x(r), 0), "sparse", kind="nonneg",
                                         group_size=8), 2),
    "PackedActivation.unpack int2": (
        lambda r: lowbit.pack_activation(np.asarray(_x(r)), "int2", group_size=8).unpack(), 1),
    "segmented_attention_forward": (
        lambda r: lowbit.segmented_attention_forward(_x(r, (7, 2, 8)), _x(r, (7, 2, 8)),
                                                     _x(r, (7, 2, 8)), [3, 4]), 0),
}


@pytest.mark.parametrize("name", list(HOT_PATHS))
def test_hot_path_reads_at_most_its_status(transfers, name):
    call, reads = HOT_PATHS[name]
    counts, _ = _measure(transfers, lambda: call(np.random.default_rng(7)))
    assert counts.get("implicit", 0) == 0, counts
    assert counts.get("to_device", 0) == 0, counts
    assert counts.get("to_host", 0) == reads, counts


def test_unpack_reads_nothing(transfers, rng):
    packed = {fmt: lowbit.pack_activation(np.maximum(_x(rng), 0), fmt, kind="nonneg",
                                          group_size=8) for fmt in ("int8", "sparse")}
    for fmt, p in packed.items():
        transfers.clear()
        out = p.unpack()
        assert out.shape == (5, 37) and dict(transfers) == {}, (fmt, dict(transfers))


def test_segment_tables_are_uploaded_once_per_layout(transfers, rng):
    q = _x(rng, (7, 2, 8))
    lowbit.segmented_attention_forward(q, q, q, [3, 4])
    assert transfers["to_device"] == 2  # the offsets and the row-block prefix table
    transfers.clear()
    lowbit.segmented_attention_forward(q, q, q, [3, 4])
    lowbit.segmented_attention_forward(q, q, q, [3, 4])
    assert transfers["to_device"] == 0
    lowbit.segmented_attention_forward(q, q, q, [7])
    assert transfers["to_device"] == 2


def test_bdh_segment_bounds_stay_on_the_device(transfers, rng):
    B, T, N, D = 2, 7, 8, 4
    x, v = _x(rng, (B, T, N)), _x(rng, (B, T, D))
    starts = dev(np.array([0, 3, 7], np.int64))
    angles = rng.standard_normal((T, N // 2)).astype(np.float32)
    cos, sin = dev(np.cos(angles)), dev(np.sin(angles))
    counts, out = _measure(transfers,
                           lambda: lowrank_cuda.causal_linear_forward(x, v, starts, cos, sin))
    assert counts == {}, counts
    lo, hi = lowrank_cuda._segment_bounds(starts, T, np)
    np.testing.assert_array_equal(lo, [0, 0, 0, 3, 3, 3, 3])
    np.testing.assert_array_equal(hi, [3, 3, 3, 7, 7, 7, 7])
    assert out.shape == (B, T, D)


def test_the_counters_see_an_implicit_read(transfers):
    # The instrument itself: a hidden sync through int() or bool() is counted.
    a = dev(np.arange(4))
    assert int(a.max()) == 3 and bool(a.any())
    assert transfers["implicit"] == 2


@pytest.mark.parametrize("act_format", ["int8", None])
def test_packed_matmul_reads_one_status(transfers, rng, act_format):
    pw = lowbit.quantize_weight(_x(rng, (37, 6)), "ternary")
    x = _x(rng, (12, 37))
    counts, y = _measure(transfers, lambda: lowbit.packed_matmul(x, pw, act_format=act_format))
    assert counts == {"to_host": 1}, counts
    assert y.shape == (12, 6)


@pytest.mark.gpu
def test_profile_on_gpu_times_with_events_and_no_tracemalloc(rng):
    # The cuda backend only: the GPU path of lowbit.profile() (CUDA events, read at the end).
    import tracemalloc

    cp = _backend.cupy_module()
    if cp is None or _backend.cuda_device_count() == 0:
        pytest.skip("needs cupy and a CUDA device")
    shape = {"current": (1, 16, 8), "encoder": (2, 8, 12), "encoder_v": (2, 8, 12),
             "decoder": (24, 8)}
    args = [cp.asarray(rng.standard_normal(s).astype(np.float32) * 0.3)
            for s in shape.values()]
    with lowbit.profile() as prof:
        out, ctx = lowbit.lowrank_residual_forward(*args)
        lowbit.lowrank_residual_backward(cp.ones_like(out), ctx)
        assert not tracemalloc.is_tracing()
        assert prof._pending  # nothing read back inside the step
    assert prof.device == "gpu" and not prof._pending
    assert all(r.seconds > 0 and r.calls >= 1 for r in prof.records.values())
    assert {phase for phase, _ in prof.records} == {"forward", "backward"}
