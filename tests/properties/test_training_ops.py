"""Properties of the training ops: ``embedding``, ``cross_entropy``, ``layer_norm``, ``AdamW``.

Each on every CPU backend against its float64 reference in ``reference/`` within the tolerances
of ``tests/test_<op>.py`` (embedding forward exactly), shapes crossing the numba kernels' chunks
(``COLUMN_CHUNK``, ``_ROWS_PER_CHUNK``, ``STEP_CHUNK``), every layout; AdamW is the one op that
writes its inputs (the parameters, in place, by contract): its gradients stay unchanged.
"""

import numpy as np
import pytest
from helpers import assert_close, assert_equal
from hypothesis import example, given, strategies as st
from strategies import LAYOUTS, arrays, assert_near, boundaries, dims, on_backends, relayout

import lowbit
from lowbit.ops.cross_entropy import _numba as ce_numba
from lowbit.ops.embedding import _numba as emb_numba
from lowbit.reference.adamw import adamw_ref
from lowbit.reference.cross_entropy import cross_entropy_bwd_ref, cross_entropy_ref
from lowbit.reference.embedding import embedding_bwd_ref, embedding_ref
from lowbit.reference.layer_norm import layer_norm_bwd_ref, layer_norm_ref

FLOATS = st.sampled_from([np.float32, np.float64])
RTOL = {np.float32: 2e-6, np.float64: 1e-12}
INT_DTYPES = st.sampled_from([np.int8, np.uint8, np.int32, np.int64, np.uint64])


@given(V=dims(high=37), D=dims(*boundaries(emb_numba, "COLUMN_CHUNK"), high=65),
       ids_shape=st.lists(dims(low=0, high=7), max_size=2), dtype=FLOATS,
       id_dtype=INT_DTYPES, layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**32 - 1))
def test_embedding_equals_reference(V, D, ids_shape, dtype, id_dtype, layout, seed):
    rng = np.random.default_rng(seed)
    V = min(V, np.iinfo(id_dtype).max + 1)
    table = relayout(rng.standard_normal((V, D)).astype(dtype), layout)
    ids = rng.integers(0, V, ids_shape).astype(id_dtype)
    ids = relayout(ids, layout) if ids.ndim else ids
    dout = rng.standard_normal((*ids_shape, D)).astype(dtype)
    want = embedding_ref(table, ids)
    dwant = embedding_bwd_ref(dout, ids, V)

    def call():
        out, ctx = lowbit.embedding_forward(table, ids)
        return out, lowbit.embedding_backward(dout, ctx)

    for name, (out, dtable) in on_backends(call, table.size + dout.size, table=table, ids=ids,
                                           dout=dout).items():
        assert_equal(f"{name} out", want.astype(dtype), out)
        assert_close(f"{name} dtable", dwant, dtable, {np.float32: 1e-6,
                                                       np.float64: 1e-14}[dtype])


@given(bad=st.sampled_from([-1, "V", "float", "bool"]))
def test_bad_ids_are_rejected(bad):
    table = np.ones((5, 3), np.float32)
    ids = {-1: np.array([0, -1]), "V": np.array([5, 0]), "float": np.array([0.0]),
           "bool": np.array([True])}[bad]
    with pytest.raises(TypeError if bad in ("float", "bool") else ValueError, match="ids"):
        lowbit.embedding(table, ids)


@given(rows=st.lists(dims(*boundaries(ce_numba, "_ROWS_PER_CHUNK"), low=0, high=33),
                     min_size=1, max_size=2),
       V=dims(high=257), dtype=FLOATS, layout=st.sampled_from(LAYOUTS),
       seed=st.integers(0, 2**32 - 1), spread=st.sampled_from([0.0, 1.0, 30.0]),
       masked=st.booleans())
@example(rows=[1], V=1, dtype=np.float32, layout="C", seed=0, spread=0.0, masked=False)
@example(rows=[1], V=2, dtype=np.float32, layout="C", seed=0, spread=30.0,
         masked=False).via("a loss of 1e-4 from logits of 30: lse - x_t cancels in float32")
def test_cross_entropy_equals_reference(rows, V, dtype, layout, seed, spread, masked):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((*rows, V)) * spread).astype(dtype)
    targets = rng.integers(0, V, rows)
    if masked:  # ignored rows, and -inf at non-target entries (allowed by the contract)
        targets.reshape(-1)[::3] = -100
        off = (np.arange(V) != 0) & (np.arange(V) % 2 == 1)
        logits[..., off] = -np.inf
        targets = np.where(targets >= 0, targets - targets % 2, targets)
    logits = relayout(logits, layout)
    if targets.ndim:
        targets = relayout(targets, layout)
    counted = int(np.count_nonzero(targets != -100))
    want = cross_entropy_ref(logits, targets) if counted else None
    dwant = cross_entropy_bwd_ref(0.5, logits, targets) if counted else None

    def call():
        loss, ctx = lowbit.cross_entropy_forward(logits, targets)
        return loss, lowbit.cross_entropy_backward(0.5, ctx), lowbit.cross_entropy(logits,
                                                                                   targets)

    rtol = RTOL[dtype]
    for name, (loss, dlogits, inference) in on_backends(call, logits.size, logits=logits,
                                                        targets=targets).items():
        assert loss.shape == () and loss.dtype == dtype
        assert_equal(f"{name} inference", loss, inference)
        if not counted:
            assert np.isnan(loss), f"{name}: every row ignored gives NaN"
            continue
        # lse - x_t cancels when the target dominates: the loss is held to the logits' scale.
        scale = float(np.max(np.abs(logits[np.isfinite(logits)]), initial=1.0))
        assert_near(f"{name} loss", np.asarray(want), loss, rtol, rtol * scale)
        assert_near(f"{name} dlogits", dwant, dlogits, rtol, rtol * 0.5 / counted)


@given(lead=st.lists(dims(low=0, high=13), max_size=2), D=dims(high=257), dtype=FLOATS,
       layout=st.sampled_from(LAYOUTS), data=st.data(), offset=st.sampled_from([0.0, 1e3]),
       eps=st.sampled_from([1e-5, 0.1]))
@example(lead=[2], D=3, dtype=np.float32, layout="C", data=None, offset=0.0, eps=1e-5)
def test_layer_norm_equals_reference(lead, D, dtype, layout, data, offset, eps):
    if data is None:  # constant rows: zero variance, the rstd is 1/sqrt(eps)
        x = np.full((*lead, D), 2.5, dtype)
    else:
        x = data.draw(arrays((*lead, D), dtype, elements=st.floats(-4, 4, width=32))) + offset
    x = relayout(x.astype(dtype), layout)
    dy = np.cos(np.arange(x.size, dtype=np.float64)).reshape(x.shape).astype(dtype)
    want, dwant = layer_norm_ref(x, eps), layer_norm_bwd_ref(dy, x, eps)
    # A large common offset costs float32 digits of the centred values (tests/test_layer_norm).
    rtol = {np.float32: 4e-3, np.float64: 1e-10}[dtype] if offset else RTOL[dtype] * 5

    def call():
        y, ctx = lowbit.layer_norm_forward(x, eps=eps)
        return y, lowbit.layer_norm_backward(dy, ctx), lowbit.layer_norm(x, eps=eps)

    # dx sums terms of size rstd * |dy|: the floor of its cancellations.
    rstd = 1 / np.sqrt(x.astype(np.float64).var(-1) + eps) if x.size else np.zeros(1)
    floor = rtol * float(np.max(rstd, initial=0)) * float(np.max(np.abs(dy), initial=0))
    for name, (y, dx, inference) in on_backends(call, x.size, x=x, dy=dy).items():
        assert y.dtype == dx.dtype == dtype
        assert_near(f"{name} y", want, y, rtol, rtol)
        assert_near(f"{name} dx", dwant, dx, rtol, floor)
        assert_equal(f"{name} inference", y, inference)


@given(shapes=st.lists(st.lists(dims(high=37), min_size=1, max_size=2), min_size=1, max_size=3),
       dtype=FLOATS, clip=st.sampled_from([None, 0.5, 1e3]), wd=st.sampled_from([0.0, 0.01]),
       layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**32 - 1))
def test_adamw_step_equals_reference(shapes, dtype, clip, wd, layout, seed):
    rng = np.random.default_rng(seed)
    params = {f"p{i}": rng.standard_normal(s).astype(dtype) for i, s in enumerate(shapes)}
    grads = {k: relayout(rng.standard_normal(v.shape).astype(dtype), layout)
             for k, v in params.items()}
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, max_grad_norm=clip)
    ref_params, _, _ = adamw_ref(params, grads, **hyper)
    ref_params2, _, _ = adamw_ref(ref_params, grads, adamw_ref(params, grads,
                                                                 **hyper)[1], **hyper)
    rtol = {np.float32: 2e-6, np.float64: 1e-7}[dtype]

    def call():
        work = {k: v.copy() for k, v in params.items()}
        opt = lowbit.AdamW(**hyper)
        opt.step(work, grads)
        first = {k: v.copy() for k, v in work.items()}
        opt.step(work, grads)
        return first, work

    for name, (first, second) in on_backends(call, sum(v.size for v in params.values()),
                                             grads=grads).items():
        for k in params:
            assert_close(f"{name} {k} step 1", ref_params[k], first[k], rtol)
            assert_close(f"{name} {k} step 2", ref_params2[k], second[k], rtol)
