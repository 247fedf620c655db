"""``python -m bench [suite ...] [--quick] [--long] [--backend NAME] [--plot FILE.png]``.

With no suite named it runs the main job: the BDH language model trained from the same initial
parameters on the same batches under fp32 and low-bit configurations (``bench/train.py``: losses,
tokens/s, peak step memory, saved bytes, a generated sample, and the targets); it writes
``bench/results/main.json`` and, with ``--plot``, the loss curves. ``python -m bench train`` runs
the same with the torch peer when torch is installed. Other named suites run in full, one table
each, with the thread counts, writing ``bench/results/<suite>.json`` (``lowrank_residual``: the
layer-level saved-activation policy table). Suites: one module each in ``bench/``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from . import _harness

#: Every suite, runnable by name (``python -m bench SUITE``) and under pytest-benchmark.
SUITES = ("pack_bits", "matmul", "scan", "attention", "memory", "lowrank_residual", "embedding",
          "cross_entropy", "layer_norm", "adamw", "io", "train")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("suites", nargs="*", choices=[[], *SUITES], metavar="SUITE",
                        help=f"suites to run (default: all of {', '.join(SUITES)})")
    parser.add_argument("--quick", action="store_true", help="small shapes (CI)")
    parser.add_argument("--backend", help="force a backend (numpy, numba, cudasim, cuda)")
    parser.add_argument("--gpu", action="store_true", help="run on cupy arrays")
    parser.add_argument("--results", default=None, help="directory for the JSON results")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="main job: draw the loss curves (needs the plot extra)")
    parser.add_argument("--long", action="store_true",
                        help="main job / train: the longer training run of bench/train.py")
    parser.add_argument("--distributed", action="store_true",
                        help="train: data-parallel under mpiexec (bench/train_distributed.py)")
    args = parser.parse_args(argv)
    _import_torch_first()
    config = _harness.Config(quick=args.quick, gpu=args.gpu, backend=args.backend)
    print(f"threads: {_harness.threads()}", flush=True)
    if not args.suites:
        return _main_job(args, config)
    for name in args.suites:
        if name == "train" and args.distributed:
            from . import train_distributed

            train_distributed.main(args, config)
            continue
        if name == "train":
            _main_job(args, config, peers=True)
            continue
        start = time.perf_counter()
        print(f"\n== {name} ==", flush=True)
        module = importlib.import_module(f"bench.{name}")
        rows = _harness.run_cases(module.cases(config), config,
                                  progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(_harness.table(rows))
        path = _harness.write_json(name, rows, config, args.results)
        print(f"({time.perf_counter() - start:.1f} s, {path})", flush=True)
    return 0


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


def _main_job(args, config, *, peers=False) -> int:
    """The training comparison of ``bench/train.py``: one table, its targets, JSON, a plot."""
    from lowbit.models import train as training

    from . import train

    start = time.perf_counter()
    run = train.LONG if args.long else train.shape(config)
    corpus = training.default_corpus()
    entropy = training.unigram_entropy(corpus)
    print(f"\n== BDH language model: fp32 against low-bit training ==\n{train.describe(run)}\n"
          f"corpus: CPython's pydoc_data.topics, {len(corpus):,} bytes, unigram entropy "
          f"{entropy:.3f} nats/byte", flush=True)
    _progress("  checking the model against the float64 reference ...")
    train.check_small()
    rows, curves = train.comparison(run, corpus, progress=_progress)
    if peers:
        from . import train_torch

        rows += train_torch.rows(run, corpus, progress=_progress)
    print(_harness.table([{k: v for k, v in r.items() if k != "sample"} for r in rows]))
    print("peak step MiB: lowbit.profile's tracemalloc peak of one step (forward, backward, "
          "AdamW), every array allocated in the step; parameters and AdamW moments, held "
          "before it, excluded" + ("; torch: torch.profiler's CPU memory peak" if peers else ""))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
