"""``python -m bench [suite ...] [--quick] [--backend NAME] [--plot FILE.png]``: the main job.

With no suite named it runs the main job: the BDH policy table of ``bench/lowrank_residual.py``
(the layer applied 4 times with shared weights, forward then backward, under every
saved-activation policy: saved bytes, peak memory, gradient cosine against fp32, step time, and
the issue's targets), then the summary rows of the matmul, memory, attention and scan suites run
with their ``--quick`` shapes; it writes ``bench/results/main.json`` and, with ``--plot``, a
chart of the memory comparison. Named suites run in full, one table each, with the thread counts,
writing ``bench/results/<suite>.json``. Suites: one module each in ``bench/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys
import time

from . import _harness

#: Every suite, runnable by name (``python -m bench SUITE``) and under pytest-benchmark.
SUITES = ("pack_bits", "matmul", "scan", "attention", "memory", "lowrank_residual")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("suites", nargs="*", choices=[[], *SUITES], metavar="SUITE",
                        help=f"suites to run (default: all of {', '.join(SUITES)})")
    parser.add_argument("--quick", action="store_true", help="small shapes (CI)")
    parser.add_argument("--backend", help="force a backend (numpy, numba, cudasim, cuda)")
    parser.add_argument("--gpu", action="store_true", help="run on cupy arrays")
    parser.add_argument("--results", default=None, help="directory for the JSON results")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="main job: draw the memory comparison (needs the plot extra)")
    args = parser.parse_args(argv)
    config = _harness.Config(quick=args.quick, gpu=args.gpu, backend=args.backend)
    print(f"threads: {_harness.threads()}", flush=True)
    if not args.suites:
        return _main_job(args, config)
    for name in args.suites:
        start = time.perf_counter()
        print(f"\n== {name} ==", flush=True)
        module = importlib.import_module(f"bench.{name}")
        rows = _harness.run_cases(module.cases(config), config,
                                  progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(_harness.table(rows))
        path = _harness.write_json(name, rows, config, args.results)
        print(f"({time.perf_counter() - start:.1f} s, {path})", flush=True)
    return 0


#: Suites whose summary rows follow the policy table in the main job (those that exist).
SUMMARY_SUITES = ("matmul", "memory", "attention", "scan")


def _progress(message):
    print(message, file=sys.stderr, flush=True)


def _main_job(args, config) -> int:
    """The BDH policy table, its targets, then the summaries of the other suites."""
    from . import lowrank_residual as bdh

    start = time.perf_counter()
    dims = bdh.shape(config)
    print(f"\n== BDH low-rank residual layer: saved-activation policies ==\n"
          f"B={dims['B']} T={dims['T']} D={dims['D']} H={dims['H']} N={dims['N']}, "
          f"{bdh.APPLICATIONS} applications with shared weights, forward then backward; "
          f"ternary weights + int8 activations on every projection", flush=True)
    _progress("  checking the layer against the float64 reference ...")
    bdh._check_small(config)
    rows, facts = bdh.policy_table(config, progress=_progress)
    print(f"relu_threshold {facts['relu_threshold']:.4f}: measured density x_neuron "
          f"{facts['density x_neuron']:.2%}, y_gate {facts['density y_gate']:.2%} "
          f"(target {bdh.TARGET_DENSITY:.0%})")
    print(_harness.table([{"case": r["policy"], **{k: v for k, v in r.items() if k != "policy"}}
                          for r in rows]))
    target_rows = []
    for what, measured, rel, bound, met in bdh.targets(rows):
        print(f"  {'PASS' if met else 'FAIL'}  {what}: {measured:.4g} (target {rel} {bound:.4g})")
        target_rows.append({"case": f"target: {what}", "measured": measured, "bound": bound,
                            "relation": rel, "met": met})
    json_rows = [{"suite": "lowrank_residual", "case": r["policy"], **r} for r in rows]
    path = _harness.write_json("main", json_rows + [{"facts": facts}] + target_rows, config,
                               args.results)
    print(f"({time.perf_counter() - start:.1f} s, {path})", flush=True)
    if args.plot:
        _plot(rows, args.plot)
        print(f"memory comparison drawn in {args.plot}")
    quick = dataclasses.replace(config, quick=True)
    for name in SUMMARY_SUITES:
        if name not in SUITES or importlib.util.find_spec(f"bench.{name}") is None:
            continue
        began = time.perf_counter()
        print(f"\n== {name} (summary, --quick shapes) ==", flush=True)
        module = importlib.import_module(f"bench.{name}")
        suite_rows = _harness.run_cases(module.cases(quick), quick, progress=_progress)
        # The issues' targets are defined at the full shapes (`python -m bench NAME`); at the
        # quick shapes only the ratios are shown.
        summary = [{k: v for k, v in r.items() if k not in ("target", "met")}
                   for r in suite_rows if "ratio" in r] or suite_rows
        print(_harness.table(summary))
        print(f"(targets apply at full shapes: python -m bench {name})")
        print(f"({time.perf_counter() - began:.1f} s)", flush=True)
    return 0


def _plot(rows, path):
    """Bar charts of saved bytes and peak memory per policy (matplotlib, the plot extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install 'lowbit[plot]' ({exc})") from exc
    names = [r["policy"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "saved MiB", "saved activations (MiB)"),
                           (axes[1], "peak MiB", "peak memory during the step (MiB)")):
        ax.bar(names, [r[key] for r in rows], color="tab:blue")
        ax.set_title(title)
        for i, r in enumerate(rows):
            ax.annotate(f"{r[key]:.1f}", (i, r[key]), ha="center", va="bottom", fontsize=8)
    fig.suptitle("BDH layer x4, shared weights: saved-activation policies")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
