"""``python -m bench [suite ...] [--quick] [--backend NAME]``: the main job.

Runs the named suites (all by default), prints one table per suite with the thread counts, and
writes ``bench/results/<suite>.json``. Suites: one module each in ``bench/``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from . import _harness

#: Every suite, in the order the default run prints them.
SUITES = ("pack_bits",)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("suites", nargs="*", choices=[[], *SUITES], metavar="SUITE",
                        help=f"suites to run (default: all of {', '.join(SUITES)})")
    parser.add_argument("--quick", action="store_true", help="small shapes (CI)")
    parser.add_argument("--backend", help="force a backend (numpy, numba, cudasim, cuda)")
    parser.add_argument("--gpu", action="store_true", help="run on cupy arrays")
    parser.add_argument("--results", default=None, help="directory for the JSON results")
    args = parser.parse_args(argv)
    config = _harness.Config(quick=args.quick, gpu=args.gpu, backend=args.backend)
    print(f"threads: {_harness.threads()}", flush=True)
    for name in args.suites or SUITES:
        start = time.perf_counter()
        print(f"\n== {name} ==", flush=True)
        module = importlib.import_module(f"bench.{name}")
        rows = _harness.run_cases(module.cases(config), config,
                                  progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(_harness.table(rows))
        path = _harness.write_json(name, rows, config, args.results)
        print(f"({time.perf_counter() - start:.1f} s, {path})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
