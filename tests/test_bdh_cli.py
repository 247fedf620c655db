"""``python -m lowbit.models.bdh`` (``lowbit/models/bdh/_cli.py``, ``lowbit/models/_rundir.py``):
a run stopped by SIGTERM mid-way and resumed ends with the parameters of a run never stopped,
bit for bit; log.jsonl holds one valid line per evaluation; ``sample`` writes N bytes; ``eval``
prints the whole-split loss of a float64 loop; every bad input is one line on stderr, a non-zero
exit, and the files already written stay as they were."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import assert_equal

import lowbit
from lowbit.models import bdh, train
from lowbit.models.bdh import _cli

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--multiplier", "4", "--block", "16",
        "--batch", "2", "--warmup", "5", "--lr", "3e-3", "--seed", "0", "--backend", "numpy"]
CONFIG = bdh.BDHConfig(n_layer=1, n_embd=16, n_head=2, mlp_internal_dim_multiplier=4)


def _cli_run(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "lowbit.models.bdh", *map(str, args)],
                          capture_output=True, timeout=120, **kwargs)


def _files(directory):
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory))}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.bin"
    path.write_bytes(train.default_corpus()[:20000])
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 30-step run on 3000 bytes (its validation split: 300 bytes, 18 blocks of 16)."""
    root = tmp_path_factory.mktemp("small")
    path = root / "small.bin"
    path.write_bytes(train.default_corpus()[5000:8000])
    out = root / "run"
    assert _cli.main(["train", str(path), "--out", str(out), *TINY, "--steps", "30",
                      "--eval-every", "10", "--save-every", "10"]) == 0
    return path, out


def test_sigterm_mid_run_then_resume_is_bitwise_the_uninterrupted_run(data, tmp_path):
    out, steps = tmp_path / "run", 600
    args = ["train", data, "--out", out, *TINY, "--steps", steps, "--eval-every", "100",
            "--save-every", "50"]
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lowbit.models.bdh", *map(str, args)],
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 120
            log = out / "log.jsonl"
            # The first evaluation (step 100) follows the checkpoints of steps 50 and 100.
            while not (log.exists() and log.read_text().strip()):
                assert proc.poll() is None and time.monotonic() < deadline, "no log line"
                time.sleep(0.01)
            proc.terminate()  # SIGTERM
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    lines = (tmp_path / "stderr").read_text(errors="replace").strip().splitlines()
    assert rc == 128 + 15 and "stopped by SIGTERM" in lines[-1], lines[-3:]
    stopped = train.load_checkpoint(out / "checkpoint.safetensors")["step"]
    assert 100 <= stopped < steps  # killed mid-run, and the stop wrote its checkpoint
    run = _cli_run("train", "--resume", "--out", out)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    resumed = train.load_checkpoint(out / "checkpoint.safetensors", CONFIG)
    assert resumed["step"] == steps
    # The same run never stopped, by the library's loop (not the run directory's code).
    params = bdh.init_params(CONFIG, 0)
    batches = train.Batches(np.fromfile(data, dtype=np.uint8), block=16, batch=2, seed=0)
    with lowbit.use_backend("numpy"):
        train.train(CONFIG, params, batches, train.Schedule("fp32", lr=3e-3, warmup=5,
                                                            steps=steps), seed=0, progress=False)
    for name in bdh.PARAMS:
        assert_equal(name, params[name], resumed["params"][name])
    # One line per evaluation, none repeated by the resumed session.
    with open(out / "log.jsonl") as f:
        log_lines = [json.loads(line) for line in f]
    assert [r["step"] for r in log_lines] == list(range(100, steps + 1, 100))
    for r in log_lines:
        assert set(r) == {"step", "train_loss", "val_loss", "val_bits_per_byte",
                          "tokens_per_s", "elapsed_s"}
        assert all(math.isfinite(r[k]) for k in r)
        assert r["val_bits_per_byte"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-12)
        assert 0 < r["val_loss"] < math.log(256) and r["tokens_per_s"] > 0
    assert all(a["elapsed_s"] < b["elapsed_s"] for a, b in zip(log_lines, log_lines[1:]))
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["data"] == {"path": os.path.abspath(data), "bytes": 20000}
    assert run_json["block"] == 16 and run_json["batch"] == 2 and run_json["seed"] == 0
    assert train.config_from_dict(run_json["config"]) == CONFIG
    assert resumed["extra"]["run"] == run_json
    # Resuming a finished run changes nothing.
    before = _files(out)
    assert _cli.main(["train", "--resume", "--out", str(out)]) == 0
    assert _files(out) == before


def test_sample_writes_n_bytes(small):
    _, out = small
    run = _cli_run("sample", out, "--prompt", "The ", "-n", 40, "--temperature", 0.8,
                   "--top-k", 20, "--seed", 3)
    assert run.returncode == 0, run.stderr.decode()
    assert len(run.stdout) == 40
    ckpt = train.load_checkpoint(out / "checkpoint.safetensors")
    with lowbit.use_backend("numpy"):
        want = bdh.generate(ckpt["config"], ckpt["params"], b"The ", 40, temperature=0.8,
                            top_k=20, seed=3)
    assert run.stdout == want


def test_eval_prints_the_whole_split_figures_of_a_float64_loop(small):
    from lowbit.reference.bdh import bdh_ref

    path, out = small
    run = _cli_run("eval", out, path)
    assert run.returncode == 0, run.stderr.decode()
    text = run.stdout.decode()
    assert "18 of 16 bytes (288 bytes predicted)" in text and "nats/byte" in text, text
    figures = json.loads(_cli_run("eval", out, path, "--json").stdout)
    # Independently: the last 10% of the file, cut into blocks of 16 (+ the next byte).
    val = np.fromfile(path, dtype=np.uint8)[2700:]
    params = train.load_checkpoint(out / "checkpoint.safetensors")["params"]
    losses = [bdh_ref(params, val[i:i + 16][None].astype(np.int64),
                      val[i + 1:i + 17][None].astype(np.int64), level_seeds=[0])
              for i in range(0, 18 * 16, 16)]
    want = float(np.mean(losses))
    assert figures["blocks"] == 18 and figures["bytes"] == 288 and figures["step"] == 30
    assert figures["nats"] == pytest.approx(want, rel=1e-5)
    assert figures["bits_per_byte"] == pytest.approx(want / math.log(2), rel=1e-5)
    assert f"{figures['nats']:.6f} nats/byte" in text
    assert f"{figures['bits_per_byte']:.6f} bits/byte" in text


def _fails(capsys, argv, *words):
    """``main(argv)`` exits non-zero with one line on stderr holding every word."""
    assert _cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for word in words:
        assert word in err, err
    return err


def test_bad_data_files(capsys, tmp_path):
    out = tmp_path / "run"
    _fails(capsys, ["train", tmp_path / "missing.bin", "--out", out, *TINY], "does not exist")
    (tmp_path / "empty.bin").write_bytes(b"")
    _fails(capsys, ["train", tmp_path / "empty.bin", "--out", out, *TINY], "is empty")
    (tmp_path / "short.bin").write_bytes(b"a few bytes, not a block")  # val split: 3 bytes
    _fails(capsys, ["train", tmp_path / "short.bin", "--out", out, *TINY], "val split",
           "block")
    _fails(capsys, ["train", tmp_path, "--out", out, *TINY], "not a regular file")
    _fails(capsys, ["train", "--out", out, *TINY], "DATA")
    assert not out.exists()  # nothing was written


def test_nothing_to_resume(capsys, tmp_path):
    _fails(capsys, ["train", "--resume", "--out", tmp_path / "none"], "no run to resume")
    _fails(capsys, ["train", "--resume", "--out", tmp_path], "no run to resume")
    _fails(capsys, ["sample", tmp_path], "no run")
    assert os.listdir(tmp_path) == []


def test_a_run_is_never_overwritten(capsys, small, tmp_path):
    path, original = small
    out = tmp_path / "run"
    shutil.copytree(original, out)
    before = _files(out)
    # Arguments that contradict the stored run, another data file, a fresh start over it.
    _fails(capsys, ["train", "--resume", "--out", out, "--n-embd", 32], "--n-embd 32",
           "contradicts", "n_embd = 16")
    _fails(capsys, ["train", "--resume", "--out", out, "--plan", "ternary+int8"], "--plan")
    _fails(capsys, ["train", "--resume", "--out", out, "--steps", 31], "--steps")
    _fails(capsys, ["train", original / "run.json", "--resume", "--out", out], "DATA")
    _fails(capsys, ["train", path, "--out", out, *TINY], "already holds a run")
    assert _files(out) == before
    # A checkpoint of another config than the run's.
    other = bdh.BDHConfig(n_layer=1, n_embd=8, n_head=2, mlp_internal_dim_multiplier=4)
    params = bdh.init_params(other, 0)
    opt = lowbit.AdamW()
    opt.step(params, {k: np.zeros_like(v) for k, v in params.items()})
    train.save_checkpoint(out / "checkpoint.safetensors", other, params, opt, 5,
                          train.Batches(b"x" * 300, 16, 2))
    before = _files(out)
    _fails(capsys, ["train", "--resume", "--out", out], "another config")
    _fails(capsys, ["sample", out], "another config")
    _fails(capsys, ["eval", out, path], "another config")
    assert _files(out) == before


def test_bad_options_and_a_real_process(capsys, small, tmp_path):
    path, _ = small
    _fails(capsys, ["train", path, "--out", tmp_path / "a", *TINY, "--plan", "ternary+int9"],
           "--plan")
    _fails(capsys, ["train", path, "--out", tmp_path / "a", *TINY, "--latent-blocks", "4:10x"],
           "--latent-blocks")
    _fails(capsys, ["train", path, "--out", tmp_path / "a", *TINY, "--n-head", "3"], "n_head")
    assert not (tmp_path / "a").exists()
    # In a process of its own: status 2, one line, no traceback.
    run = _cli_run("train", tmp_path / "missing.bin", "--out", tmp_path / "b", *TINY)
    assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr
    assert b"Traceback" not in run.stderr and b"does not exist" in run.stderr


def test_plan_saved_and_latent_blocks_reach_the_config(small, tmp_path):
    path, _ = small
    out = tmp_path / "run"
    assert _cli.main(["train", str(path), "--out", str(out), *TINY, "--steps", "2", "--plan",
                      "ternary+int8", "--saved", "sparse", "--latent-blocks", "8:1101"]) == 0
    stored = json.loads((out / "run.json").read_text())
    config = train.config_from_dict(stored["config"])
    assert config.plan == lowbit.LowBitPlan.uniform("ternary", "int8")
    assert config.saved == "sparse"
    assert config.latent_pattern == lowbit.BlockPattern(8, np.array([1, 1, 0, 1], bool))
    assert stored["schedule"]["kind"] == "bitnet"  # the default schedule of a low-bit plan
    assert train.load_checkpoint(out / "checkpoint.safetensors", config)["step"] == 2


def test_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint(data, tmp_path):
    out = tmp_path / "run"
    args = ["train", data, "--out", out, *TINY, "--steps", 2000, "--eval-every", 1000,
            "--save-every", 20]
    proc = subprocess.Popen([sys.executable, "-m", "lowbit.models.bdh", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.safetensors").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    last = err.decode(errors="replace").strip().splitlines()[-1]
    assert proc.returncode == 128 + 2 and "stopped by SIGINT" in last, last
    step = train.load_checkpoint(out / "checkpoint.safetensors", CONFIG)["step"]
    assert 20 <= step < 2000 and f"at step {step} of 2000" in last
    assert b"Traceback" not in err


def test_lr_is_checked_before_anything_is_written(capsys, small, tmp_path):
    path, _ = small
    _fails(capsys, ["train", path, "--out", tmp_path / "a", *TINY, "--lr", "-1"], "lr")
    assert not (tmp_path / "a").exists()
