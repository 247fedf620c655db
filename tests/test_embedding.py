"""Tests of ``lowbit/ops/embedding`` (gather and deterministic scatter-add) on every backend.

Reference: ``reference/embedding.py``; kernels: ``cuda/embedding.cu``. The gather is exact; the
table gradient must match the float64 reference and, bit for bit, ``np.add.at`` in the input
dtype (positions added in ascending order) on every backend.
"""

import dataclasses

import numpy as np
import pytest
from helpers import assert_close, assert_equal, numerical_grad, to_numpy

import lowbit
from lowbit import _backend, _dispatch
from lowbit.reference.embedding import embedding_bwd_ref, embedding_ref

ID_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
#: (V, D, ids shape): V=3 with 1000 ids repeats every id hundreds of times; D=131 passes the
#: 128 threads of a CUDA backward block; 0-d, single and empty ids; V=1 and D=1.
CASES = [
    (3, 5, (1000,)),
    (3, 131, (4, 25)),
    (37, 3, (2, 37)),
    (1, 1, (7,)),
    (1, 4, ()),
    (5, 1, (1,)),
    (113, 2, (3, 1, 5)),
    (6, 3, (0,)),
    (6, 3, (2, 0)),
]
RTOL = {np.float32: 1e-6, np.float64: 1e-14}


def _ids(rng, vocab, shape, dtype=np.int64):
    return rng.integers(0, vocab, shape).astype(dtype)


def _ordered_sum(dout, ids, vocab):
    """The scatter-add in dout's dtype, positions in ascending order (what every backend does)."""
    dim = dout.shape[-1]
    dtable = np.zeros((vocab, dim), dtype=dout.dtype)
    np.add.at(dtable, ids.reshape(-1), dout.reshape(-1, dim))
    return dtable


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vocab, dim, shape", CASES, ids=[f"V{v}-D{d}-S{s}" for v, d, s in CASES])
def test_matches_reference(backend, rng, vocab, dim, shape, dtype):
    table = rng.standard_normal((vocab, dim)).astype(dtype)
    ids = _ids(rng, vocab, shape)
    dout = rng.standard_normal(shape + (dim,)).astype(dtype)
    keep = table.copy(), ids.copy(), dout.copy()
    t, i, g = backend.to(table), backend.to(ids), backend.to(dout)
    out, ctx = lowbit.embedding_forward(t, i)
    assert isinstance(out, backend.xp.ndarray) and out.dtype == dtype
    assert_equal("out", embedding_ref(table, ids).astype(dtype), out)
    assert_equal("inference out", to_numpy(out), lowbit.embedding(t, i))
    dtable = lowbit.embedding_backward(g, ctx)
    assert isinstance(dtable, backend.xp.ndarray) and dtable.dtype == dtype
    assert_close("dtable", embedding_bwd_ref(dout, ids, vocab), dtable, RTOL[dtype])
    assert_equal("dtable order", _ordered_sum(dout, ids, vocab), dtable)
    assert_equal("dtable rerun", to_numpy(dtable), lowbit.embedding_backward(g, ctx))
    for name, before, after in zip(("table", "ids", "dout"), keep, (t, i, g)):
        np.testing.assert_array_equal(to_numpy(after), before, err_msg=name)


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_every_integer_id_dtype(backend, rng, id_dtype):
    vocab = 7
    table = rng.standard_normal((vocab, 3)).astype(np.float32)
    ids = _ids(rng, vocab, (3, 11), id_dtype)
    ids[0, :3] = (0, vocab - 1, vocab - 1)  # both ends of the range, repeated
    dout = rng.standard_normal((3, 11, 3)).astype(np.float32)
    out, ctx = lowbit.embedding_forward(backend.to(table), backend.to(ids))
    assert_equal("out", embedding_ref(table, ids).astype(np.float32), out)
    dtable = lowbit.embedding_backward(backend.to(dout), ctx)
    assert_equal("dtable", _ordered_sum(dout, ids, vocab), dtable)
    assert to_numpy(ctx.ids.unpack()).dtype == id_dtype


def test_multi_block_shapes(backend, rng):
    # Under cudasim (an OS thread per CUDA thread) a few blocks; elsewhere a vocabulary past the
    # 4096 CUDA backward blocks (grid-stride over rows) and D past one block's columns.
    small = backend.name == "cudasim"
    vocab, dim, shape = (40, 130, (3, 50)) if small else (5000, 300, (16, 700))
    table = rng.standard_normal((vocab, dim)).astype(np.float32)
    ids = _ids(rng, vocab // 2, shape)  # the upper half of the rows gets no gradient
    ids[0, :20] = vocab - 1
    dout = rng.standard_normal(shape + (dim,)).astype(np.float32)
    out, ctx = lowbit.embedding_forward(backend.to(table), backend.to(ids))
    assert_equal("out", table[ids], out)
    dtable = lowbit.embedding_backward(backend.to(dout), ctx)
    assert_equal("dtable", _ordered_sum(dout, ids, vocab), dtable)
    assert not to_numpy(dtable)[vocab // 2:vocab - 1].any()


def test_layouts(backend, rng):
    """Fortran-order table, strided ids, non-contiguous dout: the same as contiguous copies."""
    vocab, dim = 9, 6
    table = np.asfortranarray(rng.standard_normal((vocab, dim)))
    ids = _ids(rng, vocab, (5, 14))[::2, ::-3]
    dout = rng.standard_normal((dim,) + ids.shape).transpose(1, 2, 0)
    assert not (table.flags.c_contiguous or ids.flags.c_contiguous or dout.flags.c_contiguous)
    out, ctx = lowbit.embedding_forward(backend.to(table), backend.to(ids))
    assert_equal("out", embedding_ref(table, ids), out)
    dtable = lowbit.embedding_backward(backend.to(dout), ctx)
    assert_equal("dtable", _ordered_sum(np.ascontiguousarray(dout), ids, vocab), dtable)


def test_repeated_ids_bitwise_across_backends(rng):
    """Hundreds of repeats of each id: numpy, numba and cudasim give the same bits."""
    table = rng.standard_normal((3, 8)).astype(np.float32)
    ids = _ids(rng, 3, (1000,))
    dout = (rng.standard_normal((1000, 8)) * 10.0 ** rng.integers(-3, 4, (1000, 1))).astype(
        np.float32)
    results = {}
    for name in ("numpy", "numba", "cudasim"):
        if _dispatch.backend_unavailable_reason(name) is None:
            with lowbit.use_backend(name):
                _, ctx = lowbit.embedding_forward(table, ids)
                results[name] = lowbit.embedding_backward(dout, ctx)
    assert "numpy" in results and len(results) > 1
    for name, dtable in results.items():
        assert_equal(f"dtable {name}", results["numpy"], dtable)


def test_reference_backward_is_the_gradient(rng):
    vocab, dim, shape = 3, 4, (2, 5)
    table = rng.standard_normal((vocab, dim))
    ids = _ids(rng, vocab, shape)
    ids[0, :2] = 1  # a repeated id for sure
    dout = rng.standard_normal(shape + (dim,))

    def loss():
        return float(np.sum(dout * embedding_ref(table, ids)))

    num = numerical_grad(loss, table)
    assert_close("dtable", num, embedding_bwd_ref(dout, ids, vocab), rtol=1e-8)


def test_ctx_keeps_the_ids_not_the_table(rng):
    table = rng.standard_normal((11, 4)).astype(np.float32)
    ids = _ids(rng, 11, (3, 5), np.int32)
    with lowbit.use_backend("numpy"):
        _, ctx = lowbit.embedding_forward(table, ids)
    assert isinstance(ctx, lowbit.EmbeddingCtx)
    assert ctx.ids.unpack() is ids and ctx.ids.format == "exact"
    assert ctx.table_shape == (11, 4) and ctx.dtype == np.float32
    assert ctx.nbytes == ids.nbytes and ctx.dense_nbytes == 4 * ids.size
    assert [row.name for row in lowbit.memory_report(ctx).rows] == ["EmbeddingCtx.ids"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.dtype = np.float64


# -- bad input: validation runs before any backend code ---------------------------------------


class _FakeDevice(np.ndarray):
    """Stands in for a cupy array (is_cupy_array is patched to recognize it)."""


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.setattr(_backend, "is_cupy_array", lambda x: isinstance(x, _FakeDevice))
    return lambda a: a.view(_FakeDevice)


def _table():
    return np.arange(20, dtype=np.float32).reshape(5, 4)


BAD_IDS = [
    (np.array([[0, 1, -1], [2, -2, 3]]), ValueError, r"ids must lie in \[0, 5\).*ids\[0, 2\] = -1"),
    (np.array([[0, 5, 7], [9, 1, 2]]), ValueError, r"ids\[0, 1\] = 5"),
    (np.array([[1, 7], [-3, 0]]), ValueError, r"ids\[0, 1\] = 7"),
    (np.array([3, -1, 4], dtype=np.int8), ValueError, r"ids\[1\] = -1"),
    (np.array([0, 255], dtype=np.uint8), ValueError, r"ids\[1\] = 255"),
    (np.array([2**63 + 5], dtype=np.uint64), ValueError, rf"ids\[0\] = {2**63 + 5}"),
    (np.array(5), ValueError, r"ids \(0-d\) = 5"),
    (np.array([0.0, 1.0]), TypeError, "ids must have an integer dtype, got float64"),
    (np.array([True, False]), TypeError, "ids must have an integer dtype, got bool"),
    ([0, 1], TypeError, "ids must be a numpy or cupy array"),
]


@pytest.mark.parametrize("ids, error, match", BAD_IDS,
                         ids=["negative", "too-large", "first-in-row-major", "int8-negative",
                              "uint8-too-large", "uint64-huge", "0-d", "float", "bool", "list"])
@pytest.mark.parametrize("fn", [lowbit.embedding, lowbit.embedding_forward],
                         ids=["embedding", "forward"])
def test_bad_ids(never_runs, fn, ids, error, match):
    with pytest.raises(error, match=match):
        fn(_table(), ids)


def test_int8_ids_with_a_large_vocabulary(never_runs):
    # V = 300 does not fit int8: the bound check must not overflow or misfire.
    table = np.zeros((300, 2), np.float32)
    with never_runs.paused():
        out = lowbit.embedding(table, np.array([127, 0], dtype=np.int8))
    assert out.shape == (2, 2)
    with pytest.raises(ValueError, match=r"ids\[0\] = -128"):
        lowbit.embedding(table, np.array([-128, 0], dtype=np.int8))


@pytest.mark.parametrize("table, error, match", [
    (np.zeros(5, np.float32), ValueError, "table must have rank 2"),
    (np.zeros((5, 4, 1), np.float32), ValueError, "table must have rank 2"),
    (np.zeros((0, 4), np.float32), ValueError, "table must have positive dimensions"),
    (np.zeros((5, 0), np.float32), ValueError, "table must have positive dimensions"),
    (np.zeros((5, 4), np.float16), TypeError, "table must be float32 or float64"),
    (np.zeros((5, 4), np.int32), TypeError, "table must be float32 or float64"),
    ([[0.0, 1.0]], TypeError, "table must be a numpy or cupy array"),
], ids=["rank1", "rank3", "no-rows", "no-columns", "float16", "int32", "list"])
def test_bad_table(never_runs, table, error, match):
    with pytest.raises(error, match=match):
        lowbit.embedding_forward(table, np.array([0, 1]))


def test_ids_of_another_array_kind(never_runs, fake_cupy):
    with pytest.raises(TypeError, match="ids must be a cupy array like table, got a numpy"):
        lowbit.embedding(fake_cupy(_table()), np.array([0, 1]))
    with pytest.raises(TypeError, match="ids must be a numpy array like table, got a cupy"):
        lowbit.embedding_forward(_table(), fake_cupy(np.array([0, 1])))


@pytest.mark.gpu
def test_ids_on_the_host_for_a_device_table():
    cp = _backend.cupy_module()
    if cp is None or _backend.cuda_device_count() == 0:
        pytest.skip("needs cupy and a CUDA device")
    with pytest.raises(TypeError, match="ids must be a cupy array"):
        lowbit.embedding(cp.asarray(_table()), np.array([0, 1]))


def _forward(never_runs, shape=(2, 3)):
    ids = np.arange(6).reshape(shape) % 5
    with never_runs.paused():
        out, ctx = lowbit.embedding_forward(_table(), ids)
    return out, ctx


@pytest.mark.parametrize("change, error, match", [
    (lambda out: out[..., :3], ValueError,
     r"dout must have the forward output's shape \(2, 3, 4\)"),
    (lambda out: out[:1], ValueError, "dout must have the forward output's shape"),
    (lambda out: out.reshape(6, 4), ValueError, "dout must have the forward output's shape"),
    (lambda out: out.astype(np.float64), TypeError, "dout must have the forward's dtype float32"),
    (lambda out: out.astype(np.int32), TypeError, "dout must have the forward's dtype"),
    (lambda out: out.tolist(), TypeError, "dout must be a numpy or cupy array"),
], ids=["columns", "positions", "flattened", "float64", "int32", "list"])
def test_bad_dout(never_runs, change, error, match):
    out, ctx = _forward(never_runs)
    with pytest.raises(error, match=match):
        lowbit.embedding_backward(change(out), ctx)


def test_dout_of_another_array_kind(never_runs, fake_cupy):
    out, ctx = _forward(never_runs)
    with pytest.raises(TypeError, match="dout must be a numpy array like"):
        lowbit.embedding_backward(fake_cupy(out), ctx)


@pytest.mark.parametrize("ctx", [
    object(),
    None,
    dataclasses.make_dataclass("Lookalike", ["ids", "table_shape", "dtype"])(
        None, (5, 4), np.dtype(np.float32)),
], ids=["object", "none", "lookalike"])
def test_foreign_ctx(never_runs, ctx):
    out, _ = _forward(never_runs)
    with pytest.raises(TypeError, match="ctx must be an EmbeddingCtx"):
        lowbit.embedding_backward(out, ctx)
