"""Run directories of ``lowbit.models.train`` (re-exported there): ``new_run``, ``resume`` and
``Run``, what ``python -m lowbit.models.bdh train`` (``bdh/_cli.py``) builds on.

A run directory holds ``run.json`` (the run's arguments: config, schedule, block, batch, seed,
the data file's path and size, evaluation and save cadence, backend), ``checkpoint.safetensors``
(the newest checkpoint, replaced atomically; its ``extra`` entry holds the same arguments and the
elapsed seconds) and ``log.jsonl`` (one JSON line per evaluation). ``resume(directory)`` rebuilds
the run at its checkpoint's step, and ``Run.train`` continues it to the same parameters, bit for
bit, as a run never interrupted (``train.py``'s reproducibility: the batch stream's state, the
optimizer and the step are in the checkpoint; dropout is keyed by step).

Siblings: ``train.py`` (the loop), ``_checkpoint.py`` (checkpoint files); tests
``tests/test_bdh_cli.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from typing import Any, Callable

import numpy as np

from .. import _validate
from ..io._files import StrPath, atomic_path
from ..ops.adamw import AdamW
from . import bdh
from ._checkpoint import _config_dict, config_from_dict, load_checkpoint
from .train import Batches, Schedule, train

#: The files of a run directory.
RUN_FILE, CHECKPOINT_FILE, LOG_FILE = "run.json", "checkpoint.safetensors", "log.jsonl"
#: Format version of ``run.json``.
RUN_VERSION = 1
#: The fields of every ``log.jsonl`` line.
LOG_FIELDS = ("step", "train_loss", "val_loss", "val_bits_per_byte", "tokens_per_s",
              "elapsed_s")


def open_data(path: StrPath) -> np.ndarray:
    """The bytes of the file at ``path`` as a read-only uint8 ``np.memmap`` (nothing is read
    until used).

    Raises:
        ValueError: the file is missing, not a regular file, unreadable or empty (the message
            names it).
    """
    name = os.fspath(path)
    if not os.path.exists(name):
        raise ValueError(f"data file {name!r} does not exist")
    if not os.path.isfile(name):
        raise ValueError(f"data file {name!r} is not a regular file")
    if os.path.getsize(name) == 0:
        raise ValueError(f"data file {name!r} is empty")
    try:
        return np.memmap(name, dtype=np.uint8, mode="r")
    except OSError as exc:
        raise ValueError(f"data file {name!r} cannot be read: {exc.strerror or exc}") from None


def _write_json(path: str, obj: object) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def _read_log(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclasses.dataclass
class Run:
    """A training run in a directory, at step ``step``: what ``new_run`` and ``resume`` return.

    Attributes:
        directory: the run directory.
        config, params: the model (params updated in place by ``train``).
        schedule: the ``Schedule`` (its ``steps`` is the run's length).
        batches: the ``Batches`` stream over the memory-mapped data file, at ``step``.
        optimizer: the ``AdamW`` at ``step`` (None before the first step).
        step: optimizer steps done.
        seed: the seed of the parameters, the batch stream and the dropout masks.
        settings: the rest of ``run.json``: ``data`` (``path``, ``bytes``), ``eval_every``,
            ``eval_batches``, ``save_every``, ``backend``.
        elapsed: wall seconds spent training so far, over every session of the run.
    """

    directory: str
    config: bdh.BDHConfig
    params: dict[str, Any]
    schedule: Schedule
    batches: Batches
    optimizer: AdamW | None
    step: int
    seed: int
    settings: dict[str, Any]
    elapsed: float = 0.0

    def path(self, name: str) -> str:
        """The path of file ``name`` of the run directory."""
        return os.path.join(self.directory, name)

    def arguments(self) -> dict[str, Any]:
        """``run.json``'s content (JSON-able)."""
        return {"version": RUN_VERSION, "config": _config_dict(self.config),
                "schedule": dataclasses.asdict(self.schedule), "block": self.batches.block,
                "batch": self.batches.batch, "seed": self.seed, **self.settings}

    def train(self, *, stop: Callable[[], bool] | None = None, progress: bool = True
              ) -> dict[str, Any]:
        """Train from ``step`` to ``schedule.steps`` (``lowbit.models.train.train``).

        Writes the checkpoint every ``save_every`` steps, at the end and when ``stop`` returns
        True (it is called after every step); appends one line per evaluation to ``log.jsonl``
        (``LOG_FIELDS``: nats and bits per byte, the tokens/s of this session, the elapsed
        seconds of the whole run), first dropping the lines past ``step`` that an interrupted
        session left (they are recomputed, equal). Runs under ``lowbit.use_backend`` of the
        run's ``backend`` when it names one.

        Returns:
            the history of ``train`` (``stopped``: whether ``stop`` ended it).
        """
        log = self.path(LOG_FILE)
        lines = _read_log(log)
        if any(line["step"] > self.step for line in lines):
            with atomic_path(log) as tmp, open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines
                             if line["step"] <= self.step)
        began, before = time.perf_counter(), self.elapsed

        def elapsed() -> float:
            return before + time.perf_counter() - began

        def record(step: int, values: dict[str, float]) -> None:
            if "val" not in values:
                return
            line = dict(zip(LOG_FIELDS, (step, values["loss"], values["val"],
                                         values["val"] / math.log(2), values["tokens_per_s"],
                                         elapsed())))
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")

        def extra(step: int) -> dict[str, Any]:
            return {"run": self.arguments(), "elapsed_s": elapsed()}

        from .. import _dispatch

        backend = self.settings.get("backend")
        forced = _dispatch.use_backend(backend) if backend else contextlib.nullcontext()
        with forced:
            history = train(self.config, self.params, self.batches, self.schedule,
                            start_step=self.step, optimizer=self.optimizer, seed=self.seed,
                            eval_every=self.settings["eval_every"],
                            eval_batches=self.settings["eval_batches"], callback=record,
                            progress=progress, leave=True, checkpoint=self.path(CHECKPOINT_FILE),
                            save_every=self.settings["save_every"], extra=extra, stop=stop)
        self.optimizer, self.step, self.elapsed = history["optimizer"], history["step"], elapsed()
        return history


def _holds_run(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name))
               for name in (RUN_FILE, CHECKPOINT_FILE, LOG_FILE))


def new_run(directory: StrPath, data: StrPath, config: bdh.BDHConfig, schedule: Schedule, *,
            block: int, batch: int, seed: int = 0, eval_every: int = 0,
            eval_batches: int | None = None, save_every: int = 0, backend: str | None = None,
            xp: Any = np) -> Run:
    """Start a run in ``directory`` (created if missing) on the bytes of the file ``data``.

    Checks everything first, then writes ``run.json`` (atomically) and draws the parameters
    (``bdh.init_params(config, seed)``); ``Run.train`` trains.

    Args:
        directory: the run directory; it must not hold a run already.
        data: path of the data file, read through a memory map (``open_data``); the first 90%
            train, the rest validates (``Batches``).
        config: the model; schedule: the ``Schedule``.
        block, batch, seed: as in ``Batches`` (``seed`` also draws the parameters and keys the
            dropout masks).
        eval_every, eval_batches: as in ``train`` (None: the whole validation split).
        save_every: checkpoint every this many steps (0: only at the end and on a stop).
        backend: a ``lowbit.use_backend`` name to train under (None: the automatic choice).
        xp: ``numpy`` or ``cupy``, the array module of the parameters.

    Raises:
        TypeError, ValueError: ``directory`` holds a run; a missing, empty or too short data
            file; bad arguments (each names its argument).
    """
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"run directory {directory!r} exists and is not a directory")
    if os.path.isdir(directory) and _holds_run(directory):
        raise ValueError(f"run directory {directory!r} already holds a run: resume it, or "
                         f"choose another directory")
    if not isinstance(config, bdh.BDHConfig):
        raise TypeError(f"config must be a BDHConfig, got {type(config).__name__}")
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a train.Schedule, got {type(schedule).__name__}")
    _validate.positive_scalar(schedule.lr, "lr")
    if _validate.finite_scalar(schedule.weight_decay, "weight_decay") < 0:
        raise ValueError(f"weight_decay must be >= 0, got {schedule.weight_decay}")
    if backend is not None:
        from .. import _dispatch

        with _dispatch.use_backend(backend):  # an unknown name raises here
            pass
    arr = open_data(data)
    batches = Batches(arr, block=block, batch=batch, seed=seed)
    settings = {"data": {"path": os.path.abspath(os.fspath(data)), "bytes": int(len(arr))},
                "eval_every": _int(eval_every, "eval_every"),
                "eval_batches": None if eval_batches is None else _int(eval_batches,
                                                                       "eval_batches", 1),
                "save_every": _int(save_every, "save_every"), "backend": backend}
    run = Run(directory, config, bdh.init_params(config, seed, xp=xp), schedule, batches, None, 0,
              seed, settings)
    os.makedirs(directory, exist_ok=True)
    _write_json(run.path(RUN_FILE), run.arguments())
    return run


def _int(value: object, name: str, minimum: int = 0) -> int:
    return _validate.integer(value, name, minimum=minimum)


def read_run(directory: StrPath) -> dict[str, Any]:
    """``run.json`` of the run directory ``directory`` (the run's arguments, JSON).

    Raises:
        ValueError: ``directory`` holds no run (no readable ``run.json``).
    """
    path = os.path.join(os.fspath(directory), RUN_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{os.fspath(directory)!r} holds no run to resume (no {RUN_FILE})")
    try:
        with open(path, encoding="utf-8") as f:
            args = json.load(f)
        config_from_dict(args["config"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path!r} is not a lowbit run file: {exc}") from None
    if args.get("version") != RUN_VERSION:
        raise ValueError(f"{path!r} has version {args.get('version')}, expected {RUN_VERSION}")
    return args


def resume(directory: StrPath, *, xp: Any = np) -> Run:
    """The run in ``directory`` at its newest checkpoint, ready for ``Run.train``.

    Reads ``run.json`` and ``checkpoint.safetensors`` (a run stopped before its first checkpoint
    goes on from step 0: the same parameters, drawn again from its seed) and memory-maps the
    data file it names, which must have the size it had.

    Args:
        directory: a run directory of ``new_run``.
        xp: ``numpy`` or ``cupy``, the array module of the parameters.

    Returns:
        the ``Run`` at the checkpoint's step.

    Raises:
        ValueError: nothing to resume (no ``run.json``); a checkpoint of another config than
            ``run.json``'s, or truncated; the data file missing or of another size.
    """
    directory = os.fspath(directory)
    args = read_run(directory)
    config = config_from_dict(args["config"])
    schedule = Schedule(**args["schedule"])
    data = args["data"]
    arr = open_data(data["path"])
    if len(arr) != data["bytes"]:
        raise ValueError(f"data file {data['path']!r} has {len(arr)} bytes, but the run was "
                         f"started on {data['bytes']}: it is not the same data")
    batches = Batches(arr, block=args["block"], batch=args["batch"], seed=args["seed"])
    settings = {k: args[k] for k in ("data", "eval_every", "eval_batches", "save_every",
                                     "backend")}
    path = os.path.join(directory, CHECKPOINT_FILE)
    if not os.path.exists(path):
        return Run(directory, config, bdh.init_params(config, args["seed"], xp=xp), schedule,
                   batches, None, 0, args["seed"], settings)
    ckpt = load_checkpoint(path, config, xp=xp)
    optimizer = AdamW()
    optimizer.load_state_dict(ckpt["optimizer"])
    batches.set_state(ckpt["batches"])
    return Run(directory, config, ckpt["params"], schedule, batches, optimizer, ckpt["step"],
               args["seed"], settings, float(ckpt["extra"].get("elapsed_s", 0.0)))

