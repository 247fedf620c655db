"""The BDH model (``lowbit/models/bdh/``) against its float64 reference (``reference/bdh.py``),
and the reference's backward against central finite differences of its own loss."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_equal, to_numpy

import lowbit
from lowbit.models import bdh
from lowbit.reference.bdh import bdh_bwd_ref, bdh_ref
from lowbit.reference.lowrank_residual import block_mask_ref

TINY = dict(n_layer=2, n_embd=8, n_head=2, mlp_internal_dim_multiplier=4, vocab_size=16)
LOWBIT = lowbit.LowBitPlan.uniform("ternary", "int8")


def _data(rng, B=2, T=5, V=16):
    ids = rng.integers(0, V, size=(B, T))
    return ids, np.roll(ids, -1, axis=1)


def _seeds(config, seed):
    return [bdh._level_seed(seed, level) for level in range(config.n_layer)]


def _params(config, seed=3):
    # Larger than the reference's init (std 0.02) so that the ReLUs and the attention are far
    # from degenerate on a tiny model, and the gradients are well above float32 noise.
    return {k: (v / bdh.INIT_STD * 0.5).astype(np.float32)
            for k, v in bdh.init_params(config, seed).items()}


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_reference_backward_matches_finite_differences(rng, dropout):
    config = bdh.BDHConfig(**TINY, dropout=dropout)
    params = {k: v.astype(np.float64) for k, v in _params(config).items()}
    ids, targets = _data(rng, B=1, T=4)
    kwargs = dict(level_seeds=_seeds(config, 5), dropout=dropout)
    grads = bdh_bwd_ref(params, ids, targets, **kwargs)
    eps = 1e-6
    for name, p in params.items():
        flat = p.reshape(-1)
        for i in rng.choice(flat.size, size=min(flat.size, 12), replace=False):
            keep = flat[i]
            flat[i] = keep + eps
            plus = bdh_ref(params, ids, targets, **kwargs)
            flat[i] = keep - eps
            minus = bdh_ref(params, ids, targets, **kwargs)
            flat[i] = keep
            numeric = (plus - minus) / (2 * eps)
            assert abs(grads[name].reshape(-1)[i] - numeric) <= 1e-6 + 1e-5 * abs(numeric), (
                name, int(i), grads[name].reshape(-1)[i], numeric)


@pytest.mark.parametrize("plan,dropout", [(lowbit.LowBitPlan(), 0.0), (lowbit.LowBitPlan(), 0.3),
                                          (LOWBIT, 0.0), (LOWBIT, 0.3)],
                         ids=["fp32", "fp32-dropout", "ternary-int8", "ternary-int8-dropout"])
def test_model_matches_reference(backend, rng, plan, dropout):
    config = bdh.BDHConfig(**TINY, dropout=dropout, plan=plan)
    params = _params(config)
    ids, targets = _data(rng)
    keep = {k: v.copy() for k, v in params.items()}
    dev = {k: backend.to(v) for k, v in params.items()}
    loss, ctx = bdh.forward(config, dev, backend.to(ids), backend.to(targets), seed=5)
    grads = bdh.backward(ctx)
    kwargs = dict(level_seeds=_seeds(config, 5), plan=plan, dropout=dropout)
    assert_close("loss", np.asarray(bdh_ref(params, ids, targets, **kwargs)), loss, 1e-5)
    ref = bdh_bwd_ref(params, ids, targets, **kwargs)
    assert set(grads) == set(bdh.PARAMS)
    for name in bdh.PARAMS:
        assert grads[name].dtype == np.float32
        assert_close(f"d{name}", ref[name], grads[name], 2e-3)
    for name in bdh.PARAMS:
        np.testing.assert_array_equal(to_numpy(dev[name]), keep[name])


@pytest.mark.parametrize("plan", [lowbit.LowBitPlan(), LOWBIT], ids=["fp32", "ternary-int8"])
def test_model_with_a_latent_pattern_matches_reference(backend, rng, plan):
    pattern = lowbit.BlockPattern(4, np.array([[True, False, False, True],
                                               [False, True, False, False]]))
    config = bdh.BDHConfig(**TINY, dropout=0.3, plan=plan, latent_pattern=pattern)
    params = _params(config)
    ids, targets = _data(rng)
    dev = {k: backend.to(v) for k, v in params.items()}
    loss, ctx = bdh.forward(config, dev, backend.to(ids), backend.to(targets), seed=2)
    grads = bdh.backward(ctx)
    mask = block_mask_ref(4, pattern.active, config.n_head, config.n_latent)
    kwargs = dict(level_seeds=_seeds(config, 2), plan=plan, dropout=0.3, latent_mask=mask)
    assert_close("loss", np.asarray(bdh_ref(params, ids, targets, **kwargs)), loss, 1e-5)
    ref = bdh_bwd_ref(params, ids, targets, **kwargs)
    for name in bdh.PARAMS:
        assert_close(f"d{name}", ref[name], grads[name], 2e-3)
    assert not to_numpy(grads["decoder"])[~mask.reshape(-1)].any()


def test_config_rejects_a_pattern_of_another_shape():
    with pytest.raises(ValueError, match="latent_pattern"):
        bdh.BDHConfig(**TINY, latent_pattern=lowbit.BlockPattern(2, [True, False]))


def test_forward_is_deterministic_and_dropout_is_keyed_by_seed(rng):
    config = bdh.BDHConfig(**TINY, dropout=0.3)
    params = _params(config)
    ids, targets = _data(rng)
    runs = [bdh.forward(config, params, ids, targets, seed=s) for s in (1, 1, 2)]
    grads = [bdh.backward(ctx) for _, ctx in runs]
    assert_equal("loss", runs[0][0], runs[1][0])
    for name in bdh.PARAMS:
        assert_equal(name, grads[0][name], grads[1][name])
    assert float(runs[0][0]) != float(runs[2][0])
    plain = bdh.BDHConfig(**TINY, dropout=0.0)
    assert_equal("no dropout", bdh.forward(plain, params, ids, targets, seed=1)[0],
                 bdh.forward(plain, params, ids, targets, seed=2)[0])


def test_inference_loss_is_the_forward_without_dropout(rng):
    config = bdh.BDHConfig(**TINY, dropout=0.0)
    params = _params(config)
    ids, targets = _data(rng)
    assert bdh.loss(config, params, ids, targets) == pytest.approx(
        float(bdh.forward(config, params, ids, targets)[0]), rel=1e-6)


def test_init_params_follow_the_reference():
    config = bdh.BDHConfig(n_layer=1, n_embd=64, n_head=4, mlp_internal_dim_multiplier=8)
    params = bdh.init_params(config, seed=0)
    assert {k: v.shape for k, v in params.items()} == config.shapes()
    assert config.shapes()["encoder"] == (4, 64, 8 * 64 // 4)
    for name, p in params.items():
        assert p.dtype == np.float32
        assert abs(float(p.std()) - bdh.INIT_STD) < 0.1 * bdh.INIT_STD, name
    assert_equal("same seed", params["decoder"], bdh.init_params(config, seed=0)["decoder"])


def test_generate_is_seeded_and_returns_bytes(rng):
    config = bdh.BDHConfig(**dict(TINY, vocab_size=256), dropout=0.0)
    params = bdh.init_params(config, seed=1)
    a = bdh.generate(config, params, b"The ", 12, temperature=0.8, top_k=5, seed=4)
    b = bdh.generate(config, params, b"The ", 12, temperature=0.8, top_k=5, seed=4)
    assert isinstance(a, bytes) and len(a) == 12 and a == b
    assert bdh.generate(config, params, b"x", 0) == b""


def test_memory_report_lists_every_saved_tensor(rng):
    config = bdh.BDHConfig(**TINY, dropout=0.0, saved="sparse")
    params = _params(config)
    ids, targets = _data(rng)
    _, ctx = bdh.forward(config, params, ids, targets)
    report = lowbit.memory_report(ctx)
    assert report.nbytes == ctx.nbytes > 0 and report.dense_nbytes == ctx.dense_nbytes
    names = {row.name.split(".")[1].split("[")[0] for row in report.rows}
    assert {"embed", "norm", "levels", "head", "loss"} <= names


@pytest.mark.parametrize("change,error,word", [
    (lambda p, i, t: (p, i + 16, t), ValueError, "ids"),
    (lambda p, i, t: (p, i.astype(np.float32), t), TypeError, "ids"),
    (lambda p, i, t: (p, i, t[:, :2]), ValueError, "targets"),
    (lambda p, i, t: ({k: v for k, v in p.items() if k != "lm_head"}, i, t), ValueError,
     "params"),
    (lambda p, i, t: (dict(p, encoder=p["encoder"][:1]), i, t), ValueError, "encoder"),
    (lambda p, i, t: (dict(p, embed=p["embed"].astype(np.float64)), i, t), TypeError, "embed"),
], ids=["ids-out-of-vocab", "float-ids", "targets-shape", "missing-param", "param-shape",
        "param-dtype"])
def test_bad_input_names_the_argument(never_runs, rng, change, error, word):
    config = bdh.BDHConfig(**TINY)
    params, ids, targets = change(_params(config), *_data(rng))
    with pytest.raises(error, match=word):
        bdh.forward(config, params, ids, targets)


@pytest.mark.parametrize("kwargs,word", [
    (dict(n_head=3), "n_head"), (dict(dropout=1.0), "dropout"), (dict(n_layer=0), "n_layer"),
    (dict(saved="int3"), "saved"), (dict(plan=("ternary", "int8")), "plan")])
def test_bad_config(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        bdh.BDHConfig(**dict(TINY, **kwargs))


def test_training_with_a_fixed_latent_pattern_learns_and_checkpoints(tmp_path):
    from lowbit.models import train

    pattern = lowbit.BlockPattern(4, np.array([True, False, True, False]))
    config = bdh.BDHConfig(**dict(TINY, vocab_size=256), plan=LOWBIT, saved="sparse",
                           latent_pattern=pattern)
    params = bdh.init_params(config, seed=1)
    batches = train.Batches(train.default_corpus(), block=16, batch=4, seed=0)
    schedule = train.Schedule("bitnet", lr=3e-3, warmup=2, steps=30)
    history = train.train(config, params, batches, schedule, progress=False)
    losses = [loss for _, loss in history["train"]]
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.3, losses
    # No gradient reaches the inactive neurons: AdamW's weight decay alone scales them, by one
    # factor for every element (the active ones moved by their gradients).
    mask = block_mask_ref(4, pattern.active, config.n_head, config.n_latent)
    init = bdh.init_params(config, seed=1)
    for name, off in (("decoder", ~mask.reshape(-1)),
                      ("encoder", np.broadcast_to(~mask[:, None, :], init["encoder"].shape))):
        ratio = (params[name][off] / init[name][off]).ravel()
        assert np.allclose(ratio, ratio[0], rtol=1e-4) and 0.9 < ratio[0] < 1, (name, ratio[:4])
        moved = (params[name][~off] / init[name][~off]).ravel()
        assert not np.allclose(moved, moved[0], rtol=1e-2), name
    path = str(tmp_path / "ckpt.safetensors")
    train.save_checkpoint(path, config, params, history["optimizer"], 30, batches)
    assert train.load_checkpoint(path, config)["config"] == config
