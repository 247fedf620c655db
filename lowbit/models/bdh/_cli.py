"""The command line of the BDH model: ``python -m lowbit.models.bdh``.

``train DATA --out DIR [shape and run options]`` trains on any file of bytes (memory-mapped;
the first 90% trains, the rest validates) and writes ``DIR/run.json``, ``DIR/log.jsonl`` and
``DIR/checkpoint.safetensors`` (every ``--save-every`` steps, at the end, and on Ctrl-C or
SIGTERM, which stop the run cleanly at the next step boundary; a second Ctrl-C ends it at once,
keeping the last checkpoint). ``train --resume --out DIR`` continues the run to the same
parameters, bit for bit, as if it had never stopped (``lowbit.models.train.resume``).
``sample DIR --prompt TEXT -n N`` writes N sampled bytes to stdout; ``eval DIR DATA`` prints the
loss over every block of a split in nats and bits per byte.

A bad input (a missing, empty or too short data file, a checkpoint of another config, nothing to
resume, arguments that contradict the run being resumed) prints one line on stderr and exits
with status 2 before anything in DIR is written. Siblings: ``../_rundir.py`` (the run
directory), ``../train.py`` (the loop); tests ``tests/test_bdh_cli.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
from typing import Any, Iterator

import numpy as np

from ... import _dispatch
from ...ops.lowrank_residual import BlockPattern, LowBitPlan
from .. import train as T
from . import BDHConfig, generate

PROG = "python -m lowbit.models.bdh"
#: The defaults of the shape and run options: the main job's model (``bench/train.py``'s MAIN),
#: which trains on a CPU in minutes.
DEFAULTS: dict[str, Any] = dict(n_layer=3, n_embd=128, n_head=4, multiplier=16, dropout=0.1,
                                plan="fp32", saved="none", latent_blocks=None, block=128,
                                batch=8, steps=200, lr=3e-3, warmup=None, schedule=None, seed=0,
                                backend=None, eval_every=50, eval_batches=None, save_every=50)
BACKENDS = ("numpy", "numba", "cudasim", "cuda")
WEIGHTS = {"fp32": None, "ternary": "ternary", "sign": "sign", "int8": "int8"}
ACTS = ("int8", "int4")


class CliError(Exception):
    """A bad input: its message is printed on one line of stderr."""


def parse_plan(text: str) -> LowBitPlan:
    """``--plan``: ``fp32``, or a weight format with an optional activation format joined by
    ``+`` or ``-`` (``ternary``, ``ternary+int8``, ``sign-int4``, ``int8+int8``), the same on the
    three projections (``bench/train.py``'s ``fp32`` and ``ternary+int8``)."""
    parts = re.split(r"[+-]", text)
    if len(parts) > 2 or parts[0] not in WEIGHTS or (len(parts) == 2 and parts[1] not in ACTS):
        raise CliError(f"--plan must be fp32 or WEIGHT[+ACT] with WEIGHT one of "
                       f"{', '.join(WEIGHTS)} and ACT one of {', '.join(ACTS)}, got {text!r}")
    return LowBitPlan.uniform(WEIGHTS[parts[0]], parts[1] if len(parts) == 2 else None)


def parse_blocks(text: str | None) -> BlockPattern | None:
    """``--latent-blocks``: ``SIZE`` (every block), ``SIZE:1101`` (the active blocks of every
    head) or ``SIZE:1100/0011`` (per head), as ``BlockPattern`` prints itself."""
    if text is None:
        return None
    match = re.fullmatch(r"(\d+)(?::([01]+(?:/[01]+)*))?", text)
    if not match:
        raise CliError(f"--latent-blocks must be SIZE, SIZE:BITS or SIZE:BITS/BITS/... (e.g. "
                       f"16:1101), got {text!r}")
    if match[2] is None:
        return BlockPattern.dense(int(match[1]))
    rows = [[c == "1" for c in row] for row in match[2].split("/")]
    if len({len(r) for r in rows}) != 1:
        raise CliError(f"--latent-blocks: every head needs as many blocks, got {text!r}")
    return BlockPattern(int(match[1]), np.array(rows[0] if len(rows) == 1 else rows, bool))


def _options(p: argparse.ArgumentParser) -> None:
    """The shape and run options of ``train`` (default None: taken from ``DEFAULTS``, or from
    the run with ``--resume``, so a given one can be checked against it)."""
    d = DEFAULTS
    add = p.add_argument
    add("--n-layer", type=int, help=f"levels of the shared layer (default {d['n_layer']})")
    add("--n-embd", type=int, help=f"D, the residual width (default {d['n_embd']})")
    add("--n-head", type=int, help=f"H, heads (default {d['n_head']})")
    add("--multiplier", type=int, help=f"N = multiplier * D / H latent neurons per head "
                                       f"(default {d['multiplier']})")
    add("--dropout", type=float, help=f"dropout probability (default {d['dropout']})")
    add("--plan", help="fp32 (default), ternary, ternary+int8, sign+int4, ...: the formats of "
                       "the weights and activations of the three projections")
    add("--saved", help="saved-activation policy: none (default), int8, int4, int2, sparse")
    add("--latent-blocks", help="active blocks of latent neurons: SIZE, SIZE:1101 or "
                                "SIZE:1100/0011 (default: all)")
    add("--block", type=int, help=f"bytes per sequence (default {d['block']})")
    add("--batch", type=int, help=f"sequences per step (default {d['batch']})")
    add("--steps", type=int, help=f"optimizer steps of the whole run (default {d['steps']})")
    add("--lr", type=float, help=f"peak learning rate (default {d['lr']})")
    add("--warmup", type=int, help="warmup steps (default steps / 10)")
    add("--schedule", choices=T.SCHEDULES, help="fp32 (warmup, cosine) or bitnet (two-stage); "
                                                "default fp32 for an fp32 plan, else bitnet")
    add("--seed", type=int, help="seed of the parameters, batches and dropout (default 0)")
    add("--backend", choices=BACKENDS, help="lowbit backend (default: the automatic choice)")
    add("--eval-every", type=int, help=f"steps between evaluations (default "
                                       f"{d['eval_every']}; one at the end)")
    add("--eval-batches", type=int, help="evaluate on this many random batches (default: every "
                                         "block of the validation split; slow on large files)")
    add("--save-every", type=int, help=f"steps between checkpoints (default {d['save_every']})")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m lowbit.models.bdh``."""
    p = argparse.ArgumentParser(prog=PROG, description="Train the BDH byte-level model on a "
                                "file of bytes, sample from it, evaluate it.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train on a file of bytes (or --resume a run)")
    t.add_argument("data", nargs="?", help="the file of bytes (90%% train, 10%% validation)")
    t.add_argument("--out", required=True, help="the run directory")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    _options(t)
    s = sub.add_parser("sample", help="write sampled bytes to stdout")
    s.add_argument("dir", help="a run directory")
    s.add_argument("--prompt", default="\n", help="the prompt (UTF-8; default a newline)")
    s.add_argument("-n", type=int, default=256, help="bytes to sample (default 256)")
    s.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1)")
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--backend", choices=BACKENDS, help="default: the run's")
    e = sub.add_parser("eval", help="the loss over every block of a split of a file")
    e.add_argument("dir", help="a run directory")
    e.add_argument("data", help="the file of bytes")
    e.add_argument("--split", choices=("val", "train", "all"), default="val",
                   help="val (the last 10%%, default), train (the first 90%%) or all")
    e.add_argument("--block", type=int, help="bytes per block (default: the run's)")
    e.add_argument("--batch", type=int, default=8, help="blocks per forward (default 8)")
    e.add_argument("--backend", choices=BACKENDS, help="default: the run's")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _xp(backend: str | None) -> Any:
    if backend != "cuda":
        return np
    try:
        import cupy
    except ImportError:
        raise CliError("--backend cuda needs cupy: pip install 'lowbit[cuda12]' (or "
                       "cuda13)") from None
    return cupy


def _forced(backend: str | None) -> contextlib.AbstractContextManager[Any]:
    return _dispatch.use_backend(backend) if backend else contextlib.nullcontext()


def _fresh(args: argparse.Namespace) -> T.Run:
    if args.data is None:
        raise CliError("train needs DATA, the file to train on (or --resume to continue the "
                       "run in --out)")
    v = {k: DEFAULTS[k] if getattr(args, k) is None else getattr(args, k) for k in DEFAULTS}
    plan = parse_plan(v["plan"])
    config = BDHConfig(n_layer=v["n_layer"], n_embd=v["n_embd"], n_head=v["n_head"],
                       mlp_internal_dim_multiplier=v["multiplier"], dropout=v["dropout"],
                       plan=plan, saved=None if v["saved"] == "none" else v["saved"],
                       latent_pattern=parse_blocks(v["latent_blocks"]))
    steps = v["steps"]
    schedule = T.Schedule(v["schedule"] or ("bitnet" if plan.quantized else "fp32"), lr=v["lr"],
                          warmup=steps // 10 if v["warmup"] is None else v["warmup"], steps=steps)
    return T.new_run(args.out, args.data, config, schedule, block=v["block"], batch=v["batch"],
                     seed=v["seed"], eval_every=v["eval_every"], eval_batches=v["eval_batches"],
                     save_every=v["save_every"], backend=v["backend"], xp=_xp(v["backend"]))


def _check_against(args: argparse.Namespace, stored: dict[str, Any]) -> None:
    """With ``--resume``: every shape or run option given must be the stored run's."""
    config = T.config_from_dict(stored["config"])
    schedule = stored["schedule"]
    have: dict[str, Any] = {
        "n_layer": config.n_layer, "n_embd": config.n_embd, "n_head": config.n_head,
        "multiplier": config.mlp_internal_dim_multiplier, "dropout": config.dropout,
        "block": stored["block"], "batch": stored["batch"], "steps": schedule["steps"],
        "lr": schedule["lr"], "warmup": schedule["warmup"], "schedule": schedule["kind"],
        "seed": stored["seed"], "backend": stored["backend"],
        "eval_every": stored["eval_every"], "eval_batches": stored["eval_batches"],
        "save_every": stored["save_every"]}
    parsed = {"plan": (parse_plan, config.plan), "latent_blocks": (parse_blocks,
                                                                   config.latent_pattern),
              "saved": (lambda s: None if s == "none" else s, config.saved)}
    for key in DEFAULTS:
        given = getattr(args, key)
        if given is None:
            continue
        same = parsed[key][0](given) == parsed[key][1] if key in parsed else given == have[key]
        if not same:
            shown = parsed[key][1] if key in parsed else have[key]
            raise CliError(f"--{key.replace('_', '-')} {given} contradicts the run in "
                           f"{args.out!r} ({key} = {shown}): leave it out with --resume")
    if args.data is not None and os.path.abspath(args.data) != stored["data"]["path"]:
        raise CliError(f"DATA {args.data!r} is not the run's data file "
                       f"({stored['data']['path']!r}): leave it out with --resume")


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[dict[str, Any]]:
    """SIGTERM and a first Ctrl-C ask for a stop at the next step boundary (``flag["signal"]``);
    a second Ctrl-C raises KeyboardInterrupt at once. The old handlers come back on exit."""
    flag: dict[str, Any] = {"signal": None}

    def handler(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and flag["signal"] == signal.SIGINT:
            raise KeyboardInterrupt
        flag["signal"] = signum

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _train(args: argparse.Namespace) -> int:
    if args.resume:
        _check_against(args, T.read_run(args.out))
        run = T.resume(args.out, xp=_xp(T.read_run(args.out)["backend"]))
    else:
        run = _fresh(args)
    total = run.schedule.steps
    ckpt = run.path(T.CHECKPOINT_FILE)
    if run.step >= total:
        print(f"the run in {args.out} is complete (step {run.step} of {total}); its checkpoint "
              f"is {ckpt}")
        return 0
    with _stop_on_signals() as flag:
        try:
            history = run.train(stop=lambda: flag["signal"] is not None)
        except KeyboardInterrupt:
            print(f"interrupted; {args.out} keeps its last checkpoint: continue with {PROG} "
                  f"train --resume --out {args.out}", file=sys.stderr)
            return 130
    if history["stopped"]:
        name = signal.Signals(flag["signal"]).name
        print(f"stopped by {name} at step {run.step} of {total}; checkpoint written to {ckpt}: "
              f"continue with {PROG} train --resume --out {args.out}", file=sys.stderr)
        return 128 + int(flag["signal"])
    nats = history["val"][-1][1]
    print(f"step {run.step}: validation loss {nats:.4f} nats/byte "
          f"({nats / np.log(2):.4f} bits/byte); checkpoint {ckpt}")
    return 0


def _load(directory: str, backend: str | None) -> tuple[BDHConfig, dict[str, Any], int,
                                                         dict[str, Any]]:
    """``(config, params, step, run.json)`` of the newest checkpoint of ``directory``."""
    stored = T.read_run(directory)
    path = os.path.join(directory, T.CHECKPOINT_FILE)
    if not os.path.exists(path):
        raise CliError(f"{directory!r} holds no checkpoint yet: train it first")
    ckpt = T.load_checkpoint(path, T.config_from_dict(stored["config"]),
                             xp=_xp(backend or stored["backend"]))
    return ckpt["config"], ckpt["params"], ckpt["step"], stored


def _sample(args: argparse.Namespace) -> int:
    config, params, _, stored = _load(args.dir, args.backend)
    with _forced(args.backend or stored["backend"]):
        out = generate(config, params, args.prompt.encode("utf-8"), args.n,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed)
    assert isinstance(out, bytes)
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    return 0


def _eval(args: argparse.Namespace) -> int:
    config, params, step, stored = _load(args.dir, args.backend)
    data = T.open_data(args.data)
    cut = int(len(data) * T.TRAIN_FRACTION)
    part = {"train": data[:cut], "val": data[cut:], "all": data}[args.split]
    block = stored["block"] if args.block is None else args.block
    if len(part) < block + 1:
        raise CliError(f"the {args.split} split of {args.data!r} has {len(part)} bytes, fewer "
                       f"than one block + 1 ({block + 1})")
    with _forced(args.backend or stored["backend"]):
        r = T.evaluate_split(config, params, part, block, batch=args.batch)
    if args.json:
        print(json.dumps(dict(r, step=step, split=args.split, block=block)))
        return 0
    print(f"run        {args.dir} at step {step}")
    print(f"split      {args.split} of {args.data} ({len(part)} of {len(data)} bytes)")
    print(f"blocks     {r['blocks']} of {block} bytes ({r['bytes']} bytes predicted)")
    print(f"loss       {r['nats']:.6f} nats/byte")
    print(f"           {r['bits_per_byte']:.6f} bits/byte")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (0;
    2 for a bad input, reported on one line of stderr; 128 + the signal after a clean stop)."""
    args = parser().parse_args(argv)
    command = {"train": _train, "sample": _sample, "eval": _eval}[args.command]
    try:
        return command(args)
    except (CliError, ValueError, TypeError, OSError) as exc:
        message = " ".join(str(exc).split())
        print(f"error: {message}", file=sys.stderr)
        return 2
