"""Training the BDH model (``lowbit/models/train.py``): the loss falls, runs repeat bitwise,
checkpoints resume bitwise in a fresh process and are written atomically."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import assert_equal

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
