"""``python -m bench [SUITE ...] [--quick | --long] [--gpu] [--backend NAME] [--plot FILE.png]
[--cpu-target haswell | alderlake] [--check] [--results DIR]``.

With no suite named it runs the main job: the BDH language model trained from the same initial
parameters on the same batches under fp32 and low-bit configurations (``bench/train.py``: losses,
tokens/s, peak step memory, saved bytes, a generated sample, and the targets); it writes
``bench/results/main.json`` and, with ``--plot``, the loss curves. ``python -m bench train`` runs
the same with the torch peer when torch is installed. Other named suites run in full, one table
each, with the thread counts, writing ``bench/results/<suite>.json`` (``lowrank_residual``: the
layer-level saved-activation policy table). Suites: one module each in ``bench/``.

``--gpu`` (cupy arrays) and ``--backend`` apply to every suite and to the training; a flag the
run would not use is refused (exit 2), and ``--check`` makes the exit status 1 when a target is
missed (without it, a missed target is reported and the exit status stays 0). ``--cpu-target``
reruns the command in a subprocess whose Numba compiles for another CPU (``bench/cpu.py``'s
``TARGETS``: the AVX2 laptop, Alder Lake's AVX-VNNI) with OpenBLAS on its Haswell kernels, so
the kernels of those CPUs are timed on any host that can execute them (Alder Lake's integer
kernels also on a host with AVX-512 VNNI instead of AVX-VNNI: ``cpu.ALDERLAKE_EVEX``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from lowbit._dispatch import BACKENDS, backend_unavailable_reason

from . import _harness

#: Every suite, runnable by name (``python -m bench SUITE``) and under pytest-benchmark.
SUITES = ("cpu", "pack_bits", "matmul", "scan", "attention", "memory", "lowrank_residual", "embedding",
          "cross_entropy", "layer_norm", "rotary", "rms_norm",
          "adamw", "io", "bitnet", "generate", "train")


DESCRIPTION = (
    "lowbit's benchmarks. With no SUITE named: the main job, the BDH language model trained "
    "fp32 against low-bit from the same parameters on the same batches (bench/train.py), its "
    "targets, bench/results/main.json. With SUITEs: each suite's table and "
    "bench/results/SUITE.json (train: the main job's training, plus the torch peer).")


def _suite(name: str) -> str:
    if name not in SUITES:
        raise argparse.ArgumentTypeError(f"unknown suite {name!r} (choose from "
                                         f"{', '.join(SUITES)})")
    return name


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION)
    p.add_argument("suites", nargs="*", type=_suite, metavar="SUITE",
                   help=f"suites to run, one of: {', '.join(SUITES)} (default: none, the main "
                        "job)")
    p.add_argument("--quick", action="store_true", help="small shapes (CI)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="force a backend (lowbit.use_backend), the training's too")
    p.add_argument("--gpu", action="store_true",
                   help="run on cupy arrays, the training's too (needs cupy and a CUDA device)")
    p.add_argument("--results", metavar="DIR", default=None,
                   help="directory for the JSON results (default: bench/results)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="main job / train: draw the loss curves (needs the plot extra)")
    p.add_argument("--long", action="store_true",
                   help="main job / train: the longer training run of bench/train.py")
    p.add_argument("--distributed", action="store_true",
                   help="train only: data-parallel under mpiexec (bench/train_distributed.py)")
    p.add_argument("--cpu-target", choices=("haswell", "alderlake"), default=None,
                   help="run in a subprocess with Numba compiling for this CPU (haswell: AVX2 "
                        "only, as most laptops; alderlake: AVX2 and AVX-VNNI, on an AVX-512 "
                        "VNNI host its integer kernels only), its own Numba cache, and OpenBLAS "
                        "on its Haswell kernels; the host must be able to execute them")
    p.add_argument("--check", action="store_true",
                   help="exit status 1 when a target is missed (default: reported, exit 0)")
    return p


def _refuse_unused(p: argparse.ArgumentParser, args) -> None:
    """``p.error`` (exit 2) for a flag that what is run would not use, or cannot run here."""
    others = [s for s in args.suites if s != "train"]
    if args.quick and args.long:
        p.error("--quick and --long are two training shapes: choose one")
    for flag, used in (("--long", args.long), ("--plot", args.plot)):
        if used and others:
            p.error(f"{flag} applies to the main job and train only, not to {', '.join(others)}")
        if used and args.distributed:
            p.error(f"{flag} applies to the training comparison, not to train --distributed")
    if args.distributed and args.suites != ["train"]:
        p.error("--distributed applies to train alone: python -m bench train --distributed")
    if args.cpu_target:
        from .cpu import target_refusal

        if args.gpu:
            p.error("--cpu-target forces the CPU kernels; --gpu runs on the GPU: choose one")
        reason = target_refusal(args.cpu_target)
        if reason:
            p.error(f"--cpu-target {args.cpu_target}: {reason}")
    if args.distributed and args.gpu:
        p.error("train --distributed runs on numpy arrays; --gpu is not supported there")
    if args.gpu and args.backend not in (None, "cuda"):
        p.error(f"--gpu runs on cupy arrays, which the {args.backend} backend does not run: "
                "drop --backend or use --backend cuda")
    if args.backend == "cuda" and not args.gpu:
        p.error("--backend cuda runs on cupy arrays: add --gpu")
    for backend in {"cuda" if args.gpu else None, args.backend} - {None}:
        reason = backend_unavailable_reason(backend)
        if reason:
            p.error(f"{'--gpu' if args.gpu else '--backend ' + backend}: {reason}")


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    _refuse_unused(p, args)
    if args.cpu_target:
        return _run_on_target(args.cpu_target, sys.argv[1:] if argv is None else list(argv))
    _import_torch_first()
    config = _harness.Config(quick=args.quick, gpu=args.gpu, backend=args.backend)
    print(f"threads: {_harness.threads()}", flush=True)
    missed = []
    if not args.suites:
        missed += _main_job(args, config)
    for name in args.suites:
        if name == "train" and args.distributed:
            from . import train, train_distributed

            with train.forced_backend(args.backend):
                train_distributed.main(args, config)
            continue
        if name == "train":
            missed += _main_job(args, config, peers=True)
            continue
        start = time.perf_counter()
        print(f"\n== {name} ==", flush=True)
        module = importlib.import_module(f"bench.{name}")
        rows = _harness.run_cases(module.cases(config), config, progress=_progress, family=name)
        print(_harness.table(rows))
        path = _harness.write_json(name, rows, config, args.results)
        print(f"({time.perf_counter() - start:.1f} s, {path})", flush=True)
        missed += _harness.missed_targets(rows)
    if missed:
        _progress(f"{len(missed)} target(s) missed: {'; '.join(missed)}" +
                  ("" if args.check else " (exit status 0: --check makes it 1)"))
    return 1 if args.check and missed else 0


def _run_on_target(target: str, argv: list) -> int:
    """The same command without ``--cpu-target`` in a subprocess that compiles for ``target``
    (``bench/cpu.py``'s ``target_env``); every result file records that target and the
    environment (``metadata.cpu_facts``)."""
    import subprocess

    from .cpu import ALDERLAKE_EVEX, target_env

    rest = [a for i, a in enumerate(argv) if a != "--cpu-target" and not a.startswith(
        "--cpu-target=") and (i == 0 or argv[i - 1] != "--cpu-target")]
    env = target_env(target, os.environ)
    print(f"--cpu-target {target}: NUMBA_CPU_NAME={target}, NUMBA_CACHE_DIR="
          f"{env['NUMBA_CACHE_DIR']}, OPENBLAS_CORETYPE=Haswell", flush=True)
    if env["NUMBA_CPU_FEATURES"] == ALDERLAKE_EVEX:
        print("  this CPU has AVX-512 VNNI, not AVX-VNNI: the integer kernels are Alder Lake's "
              "with vpdpbusd EVEX-encoded; the float kernels take this CPU's 512-bit paths",
              flush=True)
    return subprocess.call([sys.executable, "-m", "bench", *rest], env=env)


def _import_torch_first():
    """Import torch (the peers' library), if installed, before Numba starts its threads: a torch
    imported after them binds the system's OpenMP runtime and runs several times slower, which
    would flatter lowbit against it."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def _progress(message):
    print(message, file=sys.stderr, flush=True)


def _main_job(args, config, *, peers=False) -> list[str]:
    """The training comparison of ``bench/train.py`` (on cupy arrays with ``--gpu``, under
    ``--backend``): one table, its targets, JSON, a plot. Returns the targets missed."""
    from lowbit.models import train as training

    from . import train

    start = time.perf_counter()
    xp = _harness.xp(config)
    run = train.LONG if args.long else train.shape(config)
    corpus = training.default_corpus()
    entropy = training.unigram_entropy(corpus)
    print(f"\n== BDH language model: fp32 against low-bit training ==\n{train.describe(run)}\n"
          f"corpus: CPython's pydoc_data.topics, {len(corpus):,} bytes, unigram entropy "
          f"{entropy:.3f} nats/byte", flush=True)
    _progress("  checking the model against the float64 reference ...")
    with train.forced_backend(args.backend):
        train.check_small(xp)
        rows, curves = train.comparison(run, corpus, progress=_progress, xp=xp)
    if peers and config.gpu:
        print("(the torch peer runs on the CPU: not compared with a --gpu run)")
        peers = False
    if peers:
        from . import train_torch

        rows += train_torch.rows(run, corpus, progress=_progress)
    print(_harness.table([{k: v for k, v in r.items() if k != "sample"} for r in rows]))
    print("peak step MiB: lowbit.profile's peak of one step (forward, backward, AdamW; "
          + ("CuPy's memory pool" if config.gpu else "tracemalloc: every array allocated in the "
             "step") + "); parameters and AdamW moments, held before it, excluded"
          + ("; torch: torch.profiler's CPU memory peak" if peers else ""))
    for r in rows:
        print(f"  sample {r['case']}: {r['sample']!r}")
    target_rows = []
    for what, measured, rel, bound, met in train.targets(rows, entropy):
        print(f"  {'PASS' if met else 'FAIL'}  {what}: {measured:.4g} (target {rel} {bound:.4g})")
        target_rows.append({"case": f"target: {what}", "measured": measured, "bound": bound,
                            "relation": rel, "met": met})
    facts = {"unigram entropy": entropy, "corpus bytes": len(corpus), "run": run}
    path = _harness.write_json("main", [{"suite": "train", **r} for r in rows] +
                               [{"facts": facts, "curves": curves}] + target_rows, config,
                               args.results)
    print(f"({time.perf_counter() - start:.1f} s, {path})", flush=True)
    if args.plot:
        train.plot(curves, entropy, args.plot, train.describe(run))
        print(f"loss curves drawn in {args.plot}")
    return [f"train/{r['case']}" for r in target_rows if not r["met"]]


if __name__ == "__main__":
    sys.exit(main())
