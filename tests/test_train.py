"""Training the BDH model (``lowbit/models/train.py``): the loss falls, runs repeat bitwise,
checkpoints resume bitwise in a fresh process and are written atomically, gradient
accumulation equals the larger batch, and ``max_grad_norm`` agrees with a passed optimizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import assert_equal

import lowbit
import lowbit.io
from lowbit.models import bdh, train

TINY = dict(n_layer=1, n_embd=16, n_head=2, mlp_internal_dim_multiplier=4, dropout=0.1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus():
    return train.default_corpus()[:20000]


def _run(corpus, steps, *, total=None, backend_to=lambda x: x):
    """Train a fresh tiny model for ``steps`` steps of a schedule of ``total`` (default: steps)."""
    config = bdh.BDHConfig(**TINY)
    params = {k: backend_to(v) for k, v in bdh.init_params(config, seed=1).items()}
    batches = train.Batches(corpus, block=16, batch=4, seed=0)
    schedule = train.Schedule("fp32", lr=3e-3, warmup=2, steps=total or steps)
    history = train.train(config, params, batches, schedule, steps=steps, progress=False)
    return config, params, batches, history


def test_default_corpus_is_prose_and_its_entropy_is_sensible():
    data = train.default_corpus()
    assert len(data) > 400_000 and b"the " in data
    h = train.unigram_entropy(data)
    assert 2.5 < h < 5.0  # English text: about 3.2 nats per byte
    assert train.unigram_entropy(b"aaaa") == 0.0
    assert train.unigram_entropy(b"ab" * 10) == pytest.approx(np.log(2))


def test_training_lowers_the_loss(backend, corpus):
    steps = 30 if backend.name != "cudasim" else 6
    _, _, _, history = _run(corpus, steps, backend_to=backend.to)
    losses = [loss for _, loss in history["train"]]
    assert np.isfinite(losses).all()
    first, last = np.mean(losses[:2]), np.mean(losses[-2:])
    assert last < first - (0.3 if steps >= 30 else 0.02), losses


def test_two_runs_give_bitwise_identical_losses(corpus):
    a = _run(corpus, 6)
    b = _run(corpus, 6)
    assert a[3]["train"] == b[3]["train"]
    for name in bdh.PARAMS:
        assert_equal(name, a[1][name], b[1][name])


_RESUME = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {root!r})
    from lowbit.models import bdh, train
    from lowbit import AdamW
    ckpt = train.load_checkpoint({path!r})
    config, params = ckpt["config"], ckpt["params"]
    batches = train.Batches(train.default_corpus()[:20000], block=16, batch=4, seed=0)
    batches.set_state(ckpt["batches"])
    optimizer = AdamW()
    optimizer.load_state_dict(ckpt["optimizer"])
    schedule = train.Schedule("fp32", lr=3e-3, warmup=2, steps={steps})
    train.train(config, params, batches, schedule, start_step=ckpt["step"], optimizer=optimizer,
                progress=False)
    np.savez({out!r}, **params)
""")


def test_checkpoint_resumes_bitwise_in_a_fresh_process(corpus, tmp_path):
    config, params, batches, history = _run(corpus, 8)
    one_run = {k: v.copy() for k, v in params.items()}
    config, params, batches, history = _run(corpus, 4, total=8)
    path = str(tmp_path / "half.safetensors")
    train.save_checkpoint(path, config, params, history["optimizer"], 4, batches)
    out = str(tmp_path / "resumed.npz")
    code = _RESUME.format(root=ROOT, path=path, steps=8, out=out)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    with np.load(out) as resumed:
        for name in bdh.PARAMS:
            assert_equal(name, one_run[name], resumed[name])


def test_checkpoint_round_trip_and_bad_files(corpus, tmp_path, monkeypatch):
    config, params, batches, history = _run(corpus, 3)
    path = str(tmp_path / "ckpt.safetensors")
    train.save_checkpoint(path, config, params, history["optimizer"], 3, batches)
    loaded = train.load_checkpoint(path, config)
    assert loaded["step"] == 3 and loaded["config"] == config
    for name in bdh.PARAMS:
        assert_equal(name, params[name], loaded["params"][name])
    # Another config: refused, naming the config.
    other = bdh.BDHConfig(**dict(TINY, n_embd=8))
    with pytest.raises(ValueError, match="another config"):
        train.load_checkpoint(path, other)
    # A truncated file: a clear error.
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(open(path, "rb").read()[:1000])
    with pytest.raises(ValueError, match="truncated"):
        train.load_checkpoint(str(broken))
    # An interrupted save leaves the previous checkpoint intact and no temporary file behind.
    before = open(path, "rb").read()

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lowbit.io.safetensors, "_write_array", fail)
    with pytest.raises(KeyboardInterrupt):
        train.save_checkpoint(path, config, params, history["optimizer"], 4, batches)
    assert open(path, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["broken.safetensors", "ckpt.safetensors"]


def test_corpus_shorter_than_a_block_is_refused():
    with pytest.raises(ValueError, match="block"):
        train.Batches(b"short text", block=16, batch=2)


def test_batches_are_shifted_windows_of_the_split(corpus):
    batches = train.Batches(corpus, block=8, batch=3, seed=2)
    ids, targets = batches.sample("val")
    assert ids.shape == targets.shape == (3, 8)
    np.testing.assert_array_equal(ids[:, 1:], targets[:, :-1])
    val = bytes(batches.splits["val"])
    for row in np.concatenate([ids, targets[:, -1:]], axis=1):
        assert bytes(row.astype(np.uint8)) in val


def test_schedules():
    fp = train.Schedule("fp32", lr=1e-3, weight_decay=0.1, warmup=10, steps=110)
    assert fp(0) == (pytest.approx(1e-4), 0.1) and fp(9)[0] == pytest.approx(1e-3)
    assert fp(10)[0] == pytest.approx(1e-3) and fp(110)[0] == pytest.approx(1e-4)
    bn = train.Schedule("bitnet", lr=1e-3, weight_decay=0.1, warmup=10, steps=110)
    assert bn(9)[0] == pytest.approx(1.5e-3)  # a higher peak
    assert bn(59)[1] == 0.1 and bn(60)[1] == 0.0  # weight decay off in the second stage
    assert bn(60)[0] < 0.7 * bn(59)[0]  # the cut between the stages
    assert all(bn(s)[0] >= bn(s + 1)[0] for s in range(10, 110))
    with pytest.raises(ValueError, match="schedule"):
        train.Schedule("cosine")


def _train_from_scratch(corpus, batch, *, seed=3, **options):
    config = bdh.BDHConfig(**TINY)  # dropout 0.1: the masks must be the larger batch's too
    params = bdh.init_params(config, seed=1)
    batches = train.Batches(corpus, block=16, batch=batch, seed=5)
    schedule = train.Schedule("fp32", lr=3e-3, warmup=1, steps=2)
    history = train.train(config, params, batches, schedule, seed=seed, eval_batches=1,
                          progress=False, **options)
    return params, history


def test_accumulation_equals_the_larger_batch(corpus):
    # The rows: two draws of 3 rows are the rows of one draw of 6 (one generator stream).
    small, large = train.Batches(corpus, 16, 3, seed=5), train.Batches(corpus, 16, 6, seed=5)
    for _ in range(2):
        np.testing.assert_array_equal(np.concatenate([small.sample()[0], small.sample()[0]]),
                                      large.sample()[0])
    acc, acc_history = _train_from_scratch(corpus, 3, accumulate=2)
    one, one_history = _train_from_scratch(corpus, 6)
    other_masks, _ = _train_from_scratch(corpus, 6, seed=4)
    # Tolerance: the two runs' gradients differ only by the float32 rounding of their sums
    # (relative ~1e-6). AdamW moves a parameter by about lr = 3e-3 per step, normalized, so that
    # rounding changes a step by ~lr * 1e-6 = 3e-9, next to the parameters' own float32 ulp
    # (~2e-9 at |p| ~ 0.03); 1e-6 over two steps leaves a margin for gradient elements that
    # nearly cancel (larger relative error) and is still 1e4 times below the 1e-2 change that
    # other dropout masks (or rows) make, checked below so the comparison can fail.
    for name in bdh.PARAMS:
        np.testing.assert_allclose(acc[name], one[name], rtol=0, atol=1e-6, err_msg=name)
        assert np.abs(one[name] - other_masks[name]).max() > 1e-3, name
    np.testing.assert_allclose([v for _, v in acc_history["train"]],
                               [v for _, v in one_history["train"]], rtol=1e-6)
    # Every micro-batch is counted: 2 steps of 2 micro-batches of 3 rows of 16 tokens.
    assert acc_history["tokens"] == one_history["tokens"] == 2 * 6 * 16
    assert [s for s, _ in acc_history["train"]] == [1, 2]


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                          (True, TypeError), ("2", TypeError)])
def test_bad_accumulate(corpus, value, error):
    with pytest.raises(error, match="accumulate"):
        _train_from_scratch(corpus, 2, accumulate=value)


def test_max_grad_norm_must_agree_with_a_passed_optimizer(corpus):
    # The optimizer clips: a max_grad_norm it would not use raises, naming both values.
    for opt_norm, arg in ((None, {}), (0.5, {}), (0.5, {"max_grad_norm": None}),
                          (None, {"max_grad_norm": 2.0})):
        opt = lowbit.AdamW(max_grad_norm=opt_norm)
        passed = arg.get("max_grad_norm", 1.0)
        with pytest.raises(ValueError, match=rf"max_grad_norm={passed}.*optimizer's "
                                             rf"max_grad_norm \({opt_norm}\)"):
            _train_from_scratch(corpus, 2, optimizer=opt, **arg)
        assert opt.state_dict()["step"] == 0
    with pytest.raises(ValueError, match="max_grad_norm"):
        _train_from_scratch(corpus, 2, max_grad_norm=0.0)
    # Agreeing values train, clipping with the optimizer's norm.
    opt = lowbit.AdamW(max_grad_norm=1e-3)
    _train_from_scratch(corpus, 2, optimizer=opt, max_grad_norm=1e-3)
    assert opt.state_dict()["step"] == 2 and opt.last_grad_norm > 1e-3
    unclipped = lowbit.AdamW(max_grad_norm=None)
    _train_from_scratch(corpus, 2, optimizer=unclipped, max_grad_norm=None)
    assert unclipped.last_grad_norm is None


def test_parameter_groups_survive_a_checkpoint_and_old_ones_load(corpus, tmp_path):
    config = bdh.BDHConfig(**TINY)
    opt = lowbit.AdamW(lr=1e-3, no_decay=("embed",), max_grad_norm=1.0)
    params, _ = _train_from_scratch(corpus, 2, optimizer=opt)
    batches = train.Batches(corpus, block=16, batch=2, seed=5)
    path = str(tmp_path / "groups.safetensors")
    train.save_checkpoint(path, config, params, opt, 2, batches)
    restored = lowbit.AdamW()
    restored.load_state_dict(train.load_checkpoint(path, config)["optimizer"])
    assert restored.no_decay == ("embed",)
    # A checkpoint written before parameter groups existed (no "no_decay" in its optimizer
    # entry) still loads, with decay on every parameter.
    arrays, meta = lowbit.io.safetensors.load(path, with_metadata=True)
    entry = json.loads(meta["checkpoint"])
    del entry["optimizer"]["no_decay"]
    old = str(tmp_path / "old.safetensors")
    lowbit.io.safetensors.save(old, arrays, metadata={"checkpoint": json.dumps(entry)})
    restored.load_state_dict(train.load_checkpoint(old, config)["optimizer"])
    assert restored.no_decay == () and restored.state_dict()["step"] == 2


def test_config_defaults_are_the_references():
    # pathwaycom/bdh's BDHConfig; every config of the tests, the README and the main job names
    # its multiplier, so this default changes none of them.
    config = bdh.BDHConfig()
    assert (config.n_layer, config.n_embd, config.dropout, config.n_head,
            config.mlp_internal_dim_multiplier, config.vocab_size) == (6, 256, 0.1, 4, 128, 256)
    assert config.n_latent == 8192
    # A checkpoint's config entry names every field: it rebuilds the config it was written for.
    small = bdh.BDHConfig(**TINY)
    assert train.config_from_dict(train._config_dict(small)) == small


# -- whole-split evaluation, memory-mapped data, stopping and periodic checkpoints --------------

@pytest.mark.parametrize("plan", [lowbit.LowBitPlan(), lowbit.LowBitPlan.uniform("ternary",
                                                                                 "int8")])
def test_whole_split_evaluation_equals_a_float64_loop(corpus, plan):
    from lowbit.reference.bdh import bdh_ref

    config = bdh.BDHConfig(**dict(TINY, dropout=0.0), plan=plan)
    # Scaled up from the initial std so the per-block losses differ (not all ~ln 256).
    params = {k: v * 25 for k, v in bdh.init_params(config, seed=1).items()}
    data = np.frombuffer(corpus[:200], dtype=np.uint8)  # 199 // 16 = 12 blocks, 7 bytes left
    block = 16
    got = train.evaluate_split(config, params, data, block, batch=5)  # batches of 5, 5, 2
    losses = []
    for i in range(len(data) // block):
        if (i + 1) * block + 1 > len(data):
            break
        ids = data[i * block:(i + 1) * block].astype(np.int64)[None]
        targets = data[i * block + 1:(i + 1) * block + 1].astype(np.int64)[None]
        losses.append(bdh_ref(params, ids, targets, level_seeds=[0] * config.n_layer, plan=plan))
    want = float(np.mean(losses))
    assert got["blocks"] == len(losses) == 12 and got["bytes"] == 12 * block
    assert got["nats"] == pytest.approx(want, rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(want / np.log(2), rel=1e-5)
    assert np.std(losses) > 1e-2  # the blocks differ: other windows would not match
    shifted = train.evaluate_split(config, params, data[3:], block, batch=5)["nats"]
    assert abs(shifted - want) > 1e-3 * want
    # The batch size does not change the figure (to float32 rounding).
    assert train.evaluate_split(config, params, data, block, batch=12)["nats"] == \
        pytest.approx(want, rel=1e-5)


def test_whole_split_evaluation_bad_inputs(corpus):
    config = bdh.BDHConfig(**TINY)
    params = bdh.init_params(config, seed=1)
    with pytest.raises(ValueError, match="block"):
        train.evaluate_split(config, params, b"x" * 16, 16)
    with pytest.raises(TypeError, match="data"):
        train.evaluate_split(config, params, np.zeros(40, np.int64), 16)
    with pytest.raises(ValueError, match="batch"):
        train.evaluate_split(config, params, corpus, 16, batch=0)


def test_batches_read_a_memmap_without_copying_it(corpus, tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(corpus)
    mm = train.open_data(path)
    assert isinstance(mm, np.memmap) and len(mm) == len(corpus)
    batches = train.Batches(mm, block=16, batch=4, seed=0)
    for part in batches.splits.values():
        assert np.shares_memory(part, mm)
    ids, _ = batches.sample()
    # The same rows as from the bytes in memory.
    np.testing.assert_array_equal(ids, train.Batches(corpus, 16, 4, seed=0).sample()[0])


def test_stop_and_periodic_checkpoints_resume_bitwise(corpus, tmp_path, monkeypatch):
    # Uninterrupted: 9 steps. Interrupted: stop after step 4 (a checkpoint every 3 steps was
    # written at step 3, then the stop's at 4), resume from the file to 9.
    config, whole, _, _ = _run(corpus, 9)
    config = bdh.BDHConfig(**TINY)
    params = bdh.init_params(config, seed=1)
    batches = train.Batches(corpus, block=16, batch=4, seed=0)
    schedule = train.Schedule("fp32", lr=3e-3, warmup=2, steps=9)
    path = str(tmp_path / "ckpt.safetensors")
    saved = []
    real_save = train.save_checkpoint
    monkeypatch.setattr(train, "save_checkpoint",
                        lambda *a, **k: (saved.append(a[4]), real_save(*a, **k)))
    done, asked = [], []
    history = train.train(config, params, batches, schedule, progress=False, checkpoint=path,
                          save_every=3, extra=lambda step: {"at": step},
                          callback=lambda step, record: done.append(step),
                          stop=lambda: (asked.append(1), len(asked) == 4)[1])
    assert history["stopped"] and history["step"] == 4 and saved == [3, 4]
    assert done == [1, 2, 3, 4]
    assert [s for s, _ in history["val"]] == []  # no final evaluation after a stop
    ckpt = train.load_checkpoint(path, config)
    assert ckpt["step"] == 4 and ckpt["extra"] == {"at": 4}
    batches = train.Batches(corpus, block=16, batch=4, seed=0)
    batches.set_state(ckpt["batches"])
    opt = lowbit.AdamW()
    opt.load_state_dict(ckpt["optimizer"])
    rest = train.train(config, ckpt["params"], batches, schedule, start_step=4, optimizer=opt,
                       progress=False)
    assert not rest["stopped"] and rest["step"] == 9
    for name in bdh.PARAMS:
        assert_equal(name, whole[name], ckpt["params"][name])
