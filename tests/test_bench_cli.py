"""``python -m bench``'s command line (``bench/__main__.py``) and the harness's bookkeeping: the
help text, refused flags, ``--check``'s exit status, the metadata of every result file and the
first-call announcements. Nothing here trains or times a real suite: the work is monkeypatched.

"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lowbit
from lowbit import _dispatch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from bench import __main__ as cli  # noqa: E402
from bench import _harness, gpu, train  # noqa: E402
from bench._harness import Case, Config  # noqa: E402


def _exit(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a refused command line reaches any work."""
    def boom(*args, **kwargs):
        raise AssertionError("the command line should have been refused before any work")

    monkeypatch.setattr(cli, "_main_job", boom)
    monkeypatch.setattr(_harness, "run_cases", boom)


def test_help_says_what_the_default_runs(capsys):
    code, out, _ = _exit(["--help"], capsys)
    text = " ".join(out.split())
    assert code == 0
    assert "With no SUITE named: the main job" in text
    assert "default: none, the main job" in text
    assert "default: all of" not in text
    for flag in ("--check", "--gpu", "--backend", "--long", "--plot", "--distributed"):
        assert flag in text


def test_an_unknown_suite_is_named_without_an_empty_choice(capsys, no_work):
    code, _, err = _exit(["nope"], capsys)
    assert code == 2
    assert "unknown suite 'nope' (choose from cpu, pack_bits, matmul," in err
    assert "[]" not in err and "''" not in err


def test_an_unknown_backend_is_refused(capsys, no_work):
    code, _, err = _exit(["--backend", "bogus"], capsys)
    assert code == 2 and "invalid choice: 'bogus'" in err and "[]" not in err


@pytest.mark.parametrize("argv, message", [
    (["pack_bits", "--long"], "--long applies to the main job and train only, not to pack_bits"),
    (["train", "matmul", "--plot", "x.png"],
     "--plot applies to the main job and train only, not to matmul"),
    (["--quick", "--long"], "--quick and --long are two training shapes"),
    (["train", "--quick", "--long"], "--quick and --long are two training shapes"),
    (["--distributed"], "--distributed applies to train alone"),
    (["pack_bits", "--distributed"], "--distributed applies to train alone"),
    (["train", "pack_bits", "--distributed"], "--distributed applies to train alone"),
    (["train", "--distributed", "--long"], "--long applies to the training comparison"),
    (["train", "--distributed", "--plot", "x.png"], "--plot applies to the training comparison"),
    (["train", "--distributed", "--gpu"], "--gpu is not supported there"),
    (["--gpu", "--backend", "numba"], "drop --backend or use --backend cuda"),
    (["pack_bits", "--backend", "cuda"], "--backend cuda runs on cupy arrays: add --gpu"),
    (["cpu", "--cpu-target", "haswell", "--gpu"], "--cpu-target forces the CPU kernels"),
])
def test_a_flag_that_is_not_used_is_refused(argv, message, capsys, no_work):
    code, _, err = _exit(argv, capsys)
    assert code == 2, err
    assert message in err


def test_a_cpu_target_the_host_cannot_execute_is_refused(capsys, monkeypatch, no_work):
    from bench import cpu

    monkeypatch.setattr(cpu, "host_flags", lambda: {"avx2": True, "fma": True, "bmi2": True})
    code, _, err = _exit(["cpu", "--cpu-target", "alderlake"], capsys)
    assert code == 2 and "this CPU lacks avx_vnni" in err


def _bench_cpu_on(target, tmp_path):
    """``python -m bench cpu --cpu-target target``: its stdout and the CPU facts its result file
    records (compiled for that target)."""
    proc = subprocess.run([sys.executable, "-m", "bench", "cpu", "--cpu-target", target,
                           "--results", str(tmp_path)], cwd=_harness.REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = json.loads((tmp_path / "cpu.json").read_text())["metadata"]["cpu_facts"]
    assert facts["numba_target"] == target
    return proc.stdout, facts


def test_a_forced_cpu_target_runs_and_is_recorded(tmp_path):
    """``--cpu-target haswell`` reruns the command in a process compiling for Haswell, with
    OpenBLAS on its Haswell kernels: the kernels it reports are the AVX2 ones, and the result
    file records the target and the environment."""
    from bench import cpu

    if cpu.target_refusal("haswell"):
        pytest.skip(cpu.target_refusal("haswell"))
    _, facts = _bench_cpu_on("haswell", tmp_path)
    assert facts["env"]["NUMBA_CPU_FEATURES"] == cpu.TARGETS["haswell"]
    assert facts["env"]["OPENBLAS_CORETYPE"] == "Haswell"
    assert facts["kernels"]["packed_matmul gemv (<= 32 rows)"] == "avx2"
    assert facts["kernels"]["packed_matmul dw"] == "SciPy's BLAS in blocks"
    assert facts["kernels"]["packed_matmul dx (ternary, sign)"] == "table lookups"
    assert facts["kernels"]["packed_matmul float x, few rows"] == (
        "table lookups in 8-lane registers")


def test_alderlake_features_follow_the_host_flags(monkeypatch):
    """Alder Lake's own features where the host has AVX-VNNI; the EVEX variant (AVX-512 F, VL and
    VNNI on, AVX-VNNI and BW off) where it has AVX-512 VNNI and VL instead; else refused."""
    from bench import cpu

    base = {"avx2": True, "fma": True, "bmi2": True}
    for flags, want in [({"avx_vnni": True}, cpu.TARGETS["alderlake"]),
                        ({"avx512vl": True, "avx512_vnni": True}, cpu.ALDERLAKE_EVEX),
                        ({"avx512_vnni": True}, None)]:
        monkeypatch.setattr(cpu, "host_flags", lambda flags=flags: {**base, **flags})
        assert cpu.target_features("alderlake") == want
        assert (cpu.target_refusal("alderlake") is None) == (want is not None)
    evex = set(cpu.ALDERLAKE_EVEX.split(","))
    assert {"+avx512f", "+avx512vl", "+avx512vnni", "-avxvnni", "-avx512bw"} <= evex
    assert "+avxvnni" not in evex


def test_alderlake_target_runs_and_is_recorded(tmp_path):
    """``--cpu-target alderlake`` where the host can run it (AVX-VNNI, or AVX-512 VNNI and VL):
    the integer kernels it reports are the AVX-VNNI ones and the result file records the
    features it compiled with."""
    from bench import cpu

    features = cpu.target_features("alderlake")
    if features is None:
        pytest.skip(cpu.target_refusal("alderlake"))
    out, facts = _bench_cpu_on("alderlake", tmp_path)
    assert facts["env"]["NUMBA_CPU_FEATURES"] == features
    assert facts["kernels"]["packed_matmul gemv (<= 32 rows)"] == "avx-vnni"
    assert facts["kernels"]["packed_matmul gemm"] == "avx-vnni"
    assert ("EVEX" in out) == (features == cpu.ALDERLAKE_EVEX)


def test_gpu_without_cupy_or_a_device_fails_early(capsys, monkeypatch, no_work):
    monkeypatch.setattr(cli, "backend_unavailable_reason",
                        lambda name: "cupy found no CUDA device: ..." if name == "cuda" else None)
    code, _, err = _exit(["--gpu"], capsys)
    assert code == 2 and "--gpu: cupy found no CUDA device" in err


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_gpu_here_names_the_missing_cupy(capsys, no_work):
    code, _, err = _exit(["pack_bits", "--gpu"], capsys)
    assert code == 2 and "--gpu: cupy is not installed" in err


# -- the main job, faked: --check, --backend, --gpu ----------------------------------------------

ROW = {"case": "fp32", "val loss": 1.0, "sample": "The x"}


def test_a_configuration_trains_and_samples_for_real():
    """``train.run_config`` unmocked at the quick shape (the main job's code path, which the CLI
    tests below replace): a row with finite losses and a sample of the prompt and its bytes."""
    from lowbit.models import train as training

    row, history = train.run_config("ternary+int8", train.QUICK, training.default_corpus())
    assert row["steps"] == train.QUICK["steps"] and history["val"]
    assert np.isfinite(row["train loss"]) and np.isfinite(row["val loss"])
    assert row["sample"].startswith(train.PROMPT.decode())
    assert len(row["sample"].encode("utf-8", "replace")) >= len(train.PROMPT) + 1


@pytest.fixture
def fake_training(monkeypatch):
    """The main job with its model check and training replaced by records of how they were
    called (the array module, the forced backend) and its targets by ``fake_training["met"]``."""
    seen = {"met": True}

    def check_small(xp=np):
        seen["check"] = (xp, _dispatch.forced_backend())

    def comparison(run, corpus, progress=print, names=(), xp=np):
        seen["comparison"] = (xp, _dispatch.forced_backend())
        return [dict(ROW)], {"fp32": {"train": [(1, 2.0)], "val": [(1, 2.0)]}}

    monkeypatch.setattr(train, "check_small", check_small)
    monkeypatch.setattr(train, "comparison", comparison)
    monkeypatch.setattr(train, "targets",
                        lambda rows, entropy: [("a target", 1.0, ">=", 2.0, seen["met"])])
    return seen


@pytest.mark.parametrize("check, met, status", [
    (True, False, 1), (False, False, 0), (True, True, 0)])
def test_check_fails_the_main_job_on_a_missed_target(check, met, status, fake_training, tmp_path,
                                                     capsys):
    fake_training["met"] = met
    argv = ["--quick", "--results", str(tmp_path)] + (["--check"] if check else [])
    assert cli.main(argv) == status
    out = capsys.readouterr()
    assert ("FAIL  a target" if not met else "PASS  a target") in out.out
    assert ("1 target(s) missed: train/target: a target" in out.err) == (not met)
    rows = json.loads((tmp_path / "main.json").read_text())["rows"]
    assert rows[-1]["met"] is met


@pytest.mark.parametrize("check, status", [(True, 1), (False, 0)])
def test_check_fails_a_suite_on_a_missed_target(check, status, monkeypatch, tmp_path, capsys):
    rows = [{"suite": "pack_bits", "case": "fast", "ratio": 0.5, "target": 1.0, "met": False}]
    monkeypatch.setattr(_harness, "run_cases", lambda cases, config, progress, family: rows)
    argv = ["pack_bits", "--results", str(tmp_path)] + (["--check"] if check else [])
    assert cli.main(argv) == status
    assert "target(s) missed: pack_bits/fast: met" in capsys.readouterr().err


def test_missed_targets_reads_every_verdict_column():
    rows = [{"suite": "s", "case": "a", "met": True, "bytes met": np.bool_(False)},
            {"suite": "s", "case": "b", "met": None, "peer met": False},
            {"suite": "s", "case": "c", "ratio": 0.1, "metric": False}]
    assert _harness.missed_targets(rows) == ["s/a: bytes met", "s/b: peer met"]


def test_the_training_runs_under_the_backend(fake_training, tmp_path, capsys):
    assert cli.main(["--quick", "--backend", "numpy", "--results", str(tmp_path)]) == 0
    assert fake_training["check"] == (np, "numpy")
    assert fake_training["comparison"] == (np, "numpy")
    assert _dispatch.forced_backend() is None  # restored after the job


def test_the_training_runs_on_the_gpu_arrays(fake_training, monkeypatch, tmp_path, capsys):
    fake_cupy = object()
    monkeypatch.setattr(cli, "backend_unavailable_reason", lambda name: None)
    monkeypatch.setattr(_harness, "xp", lambda config: fake_cupy if config.gpu else np)
    assert cli.main(["train", "--quick", "--gpu", "--results", str(tmp_path)]) == 0
    assert fake_training["check"][0] is fake_cupy
    assert fake_training["comparison"][0] is fake_cupy
    assert "torch peer runs on the CPU" in capsys.readouterr().out


# -- the metadata of every result file --------------------------------------------------------

def _check_metadata(meta):
    assert meta["lowbit"] == lowbit.__version__
    assert meta["numpy"] == np.__version__
    if importlib.util.find_spec("numba") is not None:
        import numba

        assert meta["numba"] == numba.__version__
    else:
        assert meta["numba"] is None
    if importlib.util.find_spec("cupy") is None:
        assert meta["cupy"] is None
    assert isinstance(meta["cpu"], str) and meta["cpu"]
    commit = meta["git_commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit)
    _check_cpu_facts(meta["cpu_facts"])


def _check_cpu_facts(facts):
    """bench/cpu.py's facts against what this process sees for itself."""
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "NUMBA_CPU_NAME"):
        assert facts["env"][var] == os.environ.get(var)
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
        assert facts["flags"] == {k: k in flags for k in facts["flags"]}
        assert "avx2" in facts["flags"] and "amx_int8" in facts["flags"]
    if importlib.util.find_spec("threadpoolctl") is not None:
        import threadpoolctl

        blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
        assert [b["architecture"] for b in facts["blas"]] == [b.get("architecture") for b in blas]
    if "numba" in lowbit.available_backends():
        from bench import matmul

        family = {"vnni": "avx512-vnni", "avxvnni": "avx-vnni", "avx2": "avx2",
                  "portable": "portable gemv"}[matmul._kernel(None)]
        assert facts["kernels"]["packed_matmul gemv (<= 32 rows)"] == family


def test_write_json_records_what_produced_it(tmp_path):
    path = _harness.write_json("suite", [{"case": "a"}], Config(), tmp_path)
    meta = json.loads(path.read_text())["metadata"]
    assert set(meta) == {"lowbit", "git_commit", "cpu", "numpy", "numba", "cupy", "cpu_facts"}
    _check_metadata(meta)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_harness.REPO, capture_output=True,
                          text=True)
    assert meta["git_commit"] == (head.stdout.strip() if head.returncode == 0 else None)


def test_no_git_commit_outside_a_checkout_or_without_git(tmp_path, monkeypatch):
    _harness._git_commit.cache_clear()
    monkeypatch.setattr(_harness, "REPO", tmp_path)
    try:
        assert _harness._git_commit() is None
        _harness._git_commit.cache_clear()

        def no_git(*args, **kwargs):
            raise FileNotFoundError("git")

        monkeypatch.setattr(_harness.subprocess, "run", no_git)
        assert _harness._git_commit() is None
    finally:
        _harness._git_commit.cache_clear()


def test_gpu_json_records_what_produced_it(tmp_path, monkeypatch, capsys):
    def no_device(dry_run):
        raise RuntimeError("no CUDA device is visible")

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu, "environment", no_device)
    assert gpu.main([]) == 2
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["error"] == "no CUDA device is visible"
    _check_metadata(report["metadata"])


# -- first-call announcements -------------------------------------------------------------------

@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(_harness, "_ANNOUNCED", set())
    monkeypatch.setattr(_harness, "SETTLE_S", 0)


def _suite(events):
    """A fake suite: setup before its second case (which calls the 'kernels'), a check there."""
    def cases():
        yield Case("fake", "plain", fn=lambda: None)
        events.append("setup")
        print("SETUP", file=sys.stderr)
        yield Case("fake", "kernel", fn=lambda: None, check=lambda: print("CHECK", file=sys.stderr))
        yield Case("fake", "later", fn=lambda: None, check=lambda: None)
    return cases()


def test_the_first_calls_of_a_family_are_announced_once(fresh, capsys):
    config = Config(repeats=1, min_time_s=0.0)
    _harness.run_cases(_suite([]), config, progress=lambda s: None, family="fake_family")
    err = capsys.readouterr().err.splitlines()
    start = err.index("compiling fake_family kernels (first call) ...")
    assert start < err.index("SETUP") < err.index("CHECK")
    took = [i for i, line in enumerate(err) if re.fullmatch(r"  fake_family: first call took "
                                                              r"\d+\.\d s", line)]
    assert len(took) == 1 and took[0] > err.index("CHECK")
    assert sum("compiling" in line for line in err) == 1  # the check itself is part of it
    _harness.run_cases(_suite([]), config, progress=lambda s: None, family="fake_family")
    assert "compiling" not in capsys.readouterr().err


def test_without_a_family_the_first_check_is_announced(fresh, capsys):
    _harness.run_cases(_suite([]), Config(repeats=1, min_time_s=0.0), progress=lambda s: None)
    err = capsys.readouterr().err.splitlines()
    assert err.index("SETUP") < err.index("compiling fake kernels (first call) ...") < \
        err.index("CHECK")


def test_first_call_nested_in_an_announced_one_is_quiet(fresh, capsys):
    with _harness.first_call("outer"):
        with _harness.first_call("inner"):
            pass
    with _harness.first_call("outer"):
        pass
    err = capsys.readouterr().err
    assert err.count("compiling") == 1 and "compiling outer kernels (first call) ..." in err
    assert "inner" not in err
    with _harness.first_call("inner"):  # not announced by the nested call: announced now
        pass
    assert "compiling inner kernels (first call) ..." in capsys.readouterr().err
