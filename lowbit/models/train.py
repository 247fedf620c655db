"""Training beside the model: byte batches, learning-rate schedules, checkpoints, the loop.

Siblings: ``bdh/`` (the model); ``_checkpoint.py`` (checkpoint files) and ``_rundir.py`` (run
directories, ``resume``), whose names are re-exported here; ``bdh/_cli.py`` (``python -m
lowbit.models.bdh train|sample|eval``); tests ``tests/test_train.py``, ``tests/test_bdh_cli.py``;
the main job ``bench/train.py`` trains fp32 against low-bit configurations with this loop.

Evaluation: ``evaluate`` estimates the validation loss from random windows (nanoGPT's
``eval_iters``); ``evaluate_split`` computes it over every block of a split.

Reproducibility: batches come from a seeded ``numpy.random.Generator`` whose state is part of the
checkpoint, and the dropout masks of step ``s`` are keyed by ``(seed, s)``; so training N steps,
saving, loading in a fresh process and training N more gives the same parameters, bitwise, as 2N
steps in one run.

Data parallelism: ``train(..., comm=lowbit.distributed.communicator())`` under ``mpiexec``; each
rank draws its own rows (``Batches(..., rank=comm.rank)``) and the dropout masks are keyed by
global row, so R ranks of batch b train as one process of batch R * b made of the same rows
(``tests/test_distributed.py``, ``bench/train_distributed.py``).

Gradient accumulation: ``train(..., accumulate=k)`` runs k micro-batches of ``batches.batch`` rows
per optimizer step and averages their gradients: the k draws are the rows one batch of
``k * batches.batch`` rows would draw, and the dropout masks of micro-batch j are those of rows
``j * batch`` to ``(j + 1) * batch - 1`` of that batch, so it trains as ``batch=k * batch`` with
``accumulate=1`` does, to float32 rounding, in about a k-th of the activation memory.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np

from .. import _backend, _validate
from .._typing import Array
from ..distributed import Communicator
from ..io._files import StrPath
from ..ops.adamw import AdamW
from ..ops.adamw import _max_grad_norm as _check_max_grad_norm
from . import bdh
# Checkpoint files live in _checkpoint.py; these names stay importable from here.
from ._checkpoint import (CHECKPOINT_VERSION, _META_KEY, _config_dict,  # noqa: F401
                          config_from_dict, load_checkpoint, save_checkpoint)

#: Fraction of the corpus used for training; the rest is the validation split.
TRAIN_FRACTION = 0.9
SCHEDULES = ("fp32", "bitnet")


def default_corpus() -> bytes:
    """The English prose every CPython ships (``pydoc_data.topics``), about 0.5 MB of UTF-8."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def unigram_entropy(data: bytes | np.ndarray) -> float:
    """Entropy of the byte distribution of ``data`` in nats per byte."""
    counts = np.bincount(np.frombuffer(bytes(data), dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def rank_stream(seed: int, rank: int = 0) -> np.random.Generator:
    """The random stream of data-parallel rank ``rank``: rank 0's is ``default_rng(seed)`` (what
    one process draws), rank r's is seeded by ``SeedSequence(seed, spawn_key=(r,))``, independent
    of every other rank's."""
    seed = _validate.integer(seed, "seed", minimum=0)
    rank = _validate.integer(rank, "rank", minimum=0)
    key = (rank,) if rank else ()
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


class Batches:
    """Random ``[batch, block]`` windows of a byte corpus, with a 90/10 train/validation split.

    Args:
        data: the corpus (bytes or a uint8 array). A uint8 ``np.memmap`` is not copied: the
            splits are views of it, and each batch reads only its windows.
        block: tokens per sequence; batch: sequences per batch (per rank); seed: the generator's
            seed.
        rank: the data-parallel rank whose stream this is (``rank_stream``); 0 for one process.
    """

    def __init__(self, data: bytes | np.ndarray, block: int, batch: int, seed: int = 0,
                 rank: int = 0) -> None:
        self.block = _validate.integer(block, "block", minimum=1)
        self.batch = _validate.integer(batch, "batch", minimum=1)
        arr = np.frombuffer(bytes(data), dtype=np.uint8) if not isinstance(data, np.ndarray) \
            else np.ascontiguousarray(data, dtype=np.uint8)
        cut = int(len(arr) * TRAIN_FRACTION)
        self.splits = {"train": arr[:cut], "val": arr[cut:]}
        for name, part in self.splits.items():
            if len(part) < self.block + 1:
                raise ValueError(f"the corpus's {name} split has {len(part)} bytes, fewer than "
                                 f"one block + 1 ({self.block + 1}); use a longer corpus or a "
                                 f"shorter block")
        self.rank = _validate.integer(rank, "rank", minimum=0)
        self.rng = rank_stream(seed, self.rank)

    def sample(self, split: str = "train", rng: np.random.Generator | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, targets)``: two [batch, block] int64 arrays, targets shifted by one byte."""
        part = self.splits[split]
        rng = self.rng if rng is None else rng
        starts = rng.integers(0, len(part) - self.block, size=self.batch)
        windows = np.stack([part[s:s + self.block + 1] for s in starts]).astype(np.int64)
        return windows[:, :-1], windows[:, 1:]

    def state(self) -> dict[str, Any]:
        """The generator's state (JSON-able), for ``set_state`` and checkpoints."""
        return dict(self.rng.bit_generator.state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore a ``state()``, or this rank's from a data-parallel checkpoint's
        ``{"ranks": [state of rank 0, ...]}``."""
        if "ranks" in state:
            if self.rank >= len(state["ranks"]):
                raise ValueError(f"the checkpoint holds the batch streams of "
                                 f"{len(state['ranks'])} ranks, none for rank {self.rank}: "
                                 f"resume with as many ranks as wrote it")
            state = state["ranks"][self.rank]
        self.rng.bit_generator.state = state


class _RankStreams:
    """The batch state a data-parallel run checkpoints: every rank's stream, in rank order."""

    def __init__(self, states: list[dict[str, Any]]) -> None:
        self.states = states

    def state(self) -> dict[str, Any]:
        return {"ranks": self.states}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Learning rate and weight decay by step.

    ``"fp32"``: linear warmup to ``lr``, then cosine decay to ``lr / 10``; weight decay constant.
    ``"bitnet"`` (BitNet b1.58's recipe for ternary training): linear warmup to a higher peak
    (``peak_factor * lr``), then two stages of linear decay: the first half from the peak to 60%
    of it, the second from 40% of the peak (a cut at the midpoint) to 4%, with weight decay off in
    the second stage.
    """

    kind: str = "fp32"
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: int = 10
    steps: int = 100
    peak_factor: float = 1.5

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.kind!r}")
        _validate.integer(self.warmup, "warmup", minimum=0)
        _validate.integer(self.steps, "steps", minimum=1)

    def __call__(self, step: int) -> tuple[float, float]:
        """``(lr, weight_decay)`` of step ``step`` (0-based)."""
        peak = self.lr * (self.peak_factor if self.kind == "bitnet" else 1.0)
        if step < self.warmup:
            return peak * (step + 1) / self.warmup, self.weight_decay
        frac = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        if self.kind == "fp32":
            return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))), self.weight_decay
        if frac < 0.5:
            return peak * (1.0 - 0.4 * frac / 0.5), self.weight_decay
        return peak * (0.4 - 0.36 * (frac - 0.5) / 0.5), 0.0


# -- the loop -----------------------------------------------------------------------------------

def evaluate(config: bdh.BDHConfig, params: dict[str, Array], batches: Batches, n_batches: int,
             seed: int = 0, comm: Communicator | None = None) -> float:
    """Mean validation loss over ``n_batches`` batches drawn with a generator of its own (the
    training generator is not advanced; rank r draws from ``rank_stream(seed, r)``), nats per
    byte; with ``comm``, averaged over the ranks."""
    xp = _backend.array_module(params["embed"])
    rng = rank_stream(seed, batches.rank)
    losses: list[float] = []
    for _ in range(n_batches):
        ids, targets = batches.sample("val", rng)
        losses.append(bdh.loss(config, params, xp.asarray(ids), xp.asarray(targets)))
    mean = np.array([np.mean(losses)])
    if comm is not None:
        comm.allreduce_mean([mean])
    return float(mean[0])


def _byte_array(data: object, name: str) -> np.ndarray:
    """A 1-D uint8 view of ``data`` (bytes-like or a uint8 array, a memmap included; no copy)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    if not isinstance(data, np.ndarray):
        raise TypeError(f"{name} must be bytes or a uint8 numpy array (np.memmap included), got "
                        f"{type(data).__name__}")
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError(f"{name} must be a 1-D uint8 array, got {data.dtype} of shape "
                        f"{data.shape}")
    return data


def evaluate_split(config: bdh.BDHConfig, params: dict[str, Array],
                   data: bytes | np.ndarray, block: int, *, batch: int = 8) -> dict[str, Any]:
    """The loss over every non-overlapping block of ``data`` (a whole split), in batches.

    Window ``i`` is bytes ``[i * block, (i + 1) * block]`` of ``data`` (``block + 1`` bytes): its
    first ``block`` are the ids, its last ``block`` the targets, so every byte from the second to
    the ``blocks * block``-th is predicted once, from the bytes of its own block before it; the
    ``(len(data) - 1) % block`` trailing bytes that fill no block are left out. ``evaluate``
    is the cheaper estimate from random windows (nanoGPT's ``eval_iters``).

    Args:
        config, params: the model (inference: no dropout).
        data: the bytes (bytes or a 1-D uint8 array; a ``np.memmap`` is read one batch at a time).
        block: bytes per window read by the model (>= 1).
        batch: windows per forward (>= 1); the last batch may be smaller.

    Returns:
        dict: ``nats`` (mean loss per predicted byte), ``bits_per_byte`` (``nats / ln 2``),
        ``blocks`` (windows evaluated), ``bytes`` (bytes predicted, ``blocks * block``).

    Raises:
        TypeError, ValueError: a bad ``data``, ``block`` or ``batch``; ``data`` shorter than one
            window (``block + 1`` bytes).
    """
    arr = _byte_array(data, "data")
    block = _validate.integer(block, "block", minimum=1)
    batch = _validate.integer(batch, "batch", minimum=1)
    blocks = (len(arr) - 1) // block
    if blocks < 1:
        raise ValueError(f"data has {len(arr)} bytes, fewer than one block + 1 ({block + 1})")
    xp = _backend.array_module(params["embed"])
    total = 0.0
    for first in range(0, blocks, batch):
        n = min(batch, blocks - first)
        seg = np.asarray(arr[first * block:(first + n) * block + 1], dtype=np.int64)
        ids, targets = seg[:-1].reshape(n, block), seg[1:].reshape(n, block)
        total += bdh.loss(config, params, xp.asarray(ids), xp.asarray(targets)) * n * block
    nats = total / (blocks * block)
    return {"nats": nats, "bits_per_byte": nats / math.log(2), "blocks": blocks,
            "bytes": blocks * block}


def _gradients(config: bdh.BDHConfig, params: dict[str, Array], batches: Batches,
               accumulate: int, seed: int, first_row: int
               ) -> tuple[dict[str, Array], Array, float]:
    """Loss and gradients of one step: ``accumulate`` micro-batches, averaged.

    Micro-batch j draws the next ``batches.batch`` rows and keys its dropout masks as the rows
    from ``first_row + j * batches.batch`` on of one large batch (same ``seed``).

    Returns:
        ``(grads, loss, seconds)``: the mean gradients (float32, on the params' array module), the
        mean loss (a float32 array of shape [1]) and the seconds spent computing (not drawing).
    """
    xp = _backend.array_module(params["embed"])
    total: dict[str, Array] = {}
    losses = []
    seconds = 0.0
    for micro in range(accumulate):
        ids, targets = batches.sample("train")
        begin = time.perf_counter()
        loss, ctx = bdh.forward(config, params, xp.asarray(ids), xp.asarray(targets), seed=seed,
                                row_offset=first_row + micro * batches.batch)
        grads = bdh.backward(ctx)
        del ctx
        if micro == 0:
            total = grads  # fresh arrays of backward's: summed into in place
        else:
            for name in total:
                total[name] += grads[name]
        del grads
        losses.append(loss)
        seconds += time.perf_counter() - begin
    begin = time.perf_counter()
    if accumulate == 1:  # exactly the one-batch step
        mean_loss = xp.array(losses[0], dtype=np.float32, ndmin=1)
    else:
        for name in total:
            total[name] *= np.float32(1.0 / accumulate)
        mean_loss = xp.array(sum(float(v) for v in losses) / accumulate, dtype=np.float32,
                             ndmin=1)
    return total, mean_loss, seconds + time.perf_counter() - begin


def train(config: bdh.BDHConfig, params: dict[str, Array], batches: Batches, schedule: Schedule,
          *, steps: int | None = None, start_step: int = 0, optimizer: AdamW | None = None,
          seed: int = 0, eval_every: int = 0, eval_batches: int | None = 4,
          max_grad_norm: float | None = 1.0, accumulate: int = 1,
          callback: Callable[[int, dict[str, float]], object] | None = None,
          progress: bool = True, leave: bool = False, checkpoint: StrPath | None = None,
          save_every: int = 0, extra: dict[str, Any] | Callable[[int], dict[str, Any]] | None
          = None, stop: Callable[[], bool] | None = None,
          comm: Communicator | None = None) -> dict[str, Any]:
    """Train ``params`` in place with AdamW from ``start_step`` up to ``steps`` (default
    ``schedule.steps``).

    Args:
        config, params: the model (``bdh.BDHConfig``, dict of float32 arrays, updated in place).
        batches: a ``Batches`` stream; schedule: a ``Schedule``.
        optimizer: an ``AdamW`` to continue (from a checkpoint), else a new one (with
            ``max_grad_norm``, and ``lr`` and ``weight_decay`` from the schedule).
        seed: keys the dropout masks, ``(seed, step)`` per step and global row per row.
        max_grad_norm: clip the global gradient norm to this (None: no clipping). The optimizer
            clips, so with an ``optimizer`` passed in this must equal its ``max_grad_norm`` (an
            optimizer restored from a checkpoint of ``train`` has the value it was trained with;
            pass ``max_grad_norm=None`` with an ``AdamW`` made without clipping).
        accumulate: micro-batches per optimizer step (an int >= 1): each step draws
            ``accumulate`` batches of ``batches.batch`` rows and averages their gradients and
            losses, as one batch ``accumulate`` times larger (to float32 rounding: the rows and
            dropout masks are that batch's). Pass the same value when resuming.
        eval_every: validation loss every this many steps and at the end (0: only at the end).
        eval_batches: the validation loss is the mean over this many random batches
            (``evaluate``), or, with None, over every block of the validation split
            (``evaluate_split``, batches of ``batches.batch`` windows; every rank computes it).
        callback: called as ``callback(step, record)`` after every step (``record``: ``loss``,
            ``lr``, ``tokens_per_s``, and ``val`` at an evaluation).
        progress: show a tqdm progress bar with step, loss and tokens/s; leave: keep it on
            screen when done.
        checkpoint: a path: written (atomically) at the end, every ``save_every`` steps (0:
            only at the end) and when ``stop`` ends the run.
        extra: the checkpoint's ``extra`` entry (JSON-able), or a function of the step that
            returns it.
        stop: called after every step; when it returns True, training ends at that step
            boundary (no final evaluation), the checkpoint is written and ``history["stopped"]``
            is True (with a communicator every rank stops when one asks to).
        comm: a ``lowbit.distributed`` communicator (default: this process alone). Every rank
            calls ``train`` with the same arguments but ``batches = Batches(..., rank=comm.rank)``
            (checked at the start: configs, parameter shapes and arguments must agree). Rank 0's
            parameters are broadcast first; every step each rank draws its own rows, the
            gradients and the loss are averaged over the ranks before the optimizer step, the
            validation loss is averaged; only rank 0 shows the progress bar and writes the
            checkpoint (with every rank's batch stream: to resume, every rank loads it). An
            exception on any rank ends the job on every rank (``comm.guard()``).

    Returns:
        dict: ``train`` [(step, loss)] (the loss averaged over the step's micro-batches),
        ``val`` [(step, loss)], ``tokens`` (trained on by this rank, every micro-batch counted),
        ``tokens_per_s`` (this rank's), ``comm_s`` (seconds spent averaging gradients),
        ``optimizer``, ``step`` (the step reached) and ``stopped`` (whether ``stop`` ended it).

    Raises:
        TypeError, ValueError: a bad ``steps``, ``accumulate``, ``save_every`` or
            ``max_grad_norm``; an
            ``optimizer`` whose ``max_grad_norm`` differs from the ``max_grad_norm`` argument
            (both named); ``batches.rank`` other than the communicator's rank.
    """
    comm = Communicator() if comm is None else comm
    with comm.guard():
        steps = schedule.steps if steps is None else _validate.integer(steps, "steps", minimum=0)
        accumulate = _validate.integer(accumulate, "accumulate", minimum=1)
        save_every = _validate.integer(save_every, "save_every", minimum=0)
        if eval_batches is not None:
            eval_batches = _validate.integer(eval_batches, "eval_batches", minimum=1)
        max_grad_norm = _check_max_grad_norm(max_grad_norm)
        if optimizer is not None and optimizer.max_grad_norm != max_grad_norm:
            raise ValueError(
                f"max_grad_norm={max_grad_norm!r} differs from the optimizer's max_grad_norm "
                f"({optimizer.max_grad_norm!r}), which is what clips: pass "
                f"max_grad_norm={optimizer.max_grad_norm!r} with this optimizer, or an AdamW "
                f"made with max_grad_norm={max_grad_norm!r}")
        if batches.rank != comm.rank:
            raise ValueError(f"batches.rank ({batches.rank}) must be the communicator's rank "
                             f"({comm.rank}): each rank draws its own rows")
        names = sorted(params)
        if comm.size > 1:
            opt_state = None if optimizer is None else {
                k: v for k, v in optimizer.state_dict().items()
                if k not in ("exp_avg", "exp_avg_sq")}
            comm.check_same((config, [(n, tuple(params[n].shape), str(params[n].dtype))
                                      for n in names], schedule, batches.block, batches.batch,
                             steps, start_step, opt_state, seed, eval_every, eval_batches,
                             max_grad_norm, accumulate, checkpoint is None, save_every,
                             stop is None),
                            "the configs, parameter shapes and training arguments")
        comm.broadcast([params[n] for n in names])
        if optimizer is None:
            lr, wd = schedule(start_step)
            optimizer = AdamW(lr=lr, weight_decay=wd, max_grad_norm=max_grad_norm)
        history: dict[str, Any] = {"train": [], "val": [], "optimizer": optimizer}
        bar = None
        if progress and comm.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=steps - start_step, desc="train", unit="step", leave=leave)

        def save(reached: int) -> None:
            if checkpoint is None:
                return
            streams = comm.allgather_object(batches.state())
            if comm.rank == 0:
                entry = extra(reached) if callable(extra) else extra
                save_checkpoint(checkpoint, config, params, optimizer, reached,
                                batches if comm.size == 1 else _RankStreams(streams), entry)
            # No rank returns before the file is there (a rank may load it next).
            comm.allgather_object(None)

        tokens = 0
        busy = communicating = 0.0
        reached, stopped = start_step, False
        for step in range(start_step, steps):
            optimizer.lr, optimizer.weight_decay = schedule(step)
            grads, loss, busy_micro = _gradients(
                config, params, batches, accumulate, seed=(seed * 1_000_003 + step) % 2**32,
                first_row=comm.rank * accumulate * batches.batch)
            begin = sent = time.perf_counter()
            comm.allreduce_mean([grads[n] for n in names] + [loss])
            communicating += time.perf_counter() - sent
            optimizer.step(params, grads)
            value = float(loss[0])
            busy += time.perf_counter() - begin + busy_micro
            tokens += accumulate * batches.batch * batches.block
            record = {"loss": value, "lr": optimizer.lr, "tokens_per_s": tokens / busy}
            history["train"].append((step + 1, value))
            last = step + 1 == steps
            reached = step + 1
            if stop is not None and not last:  # a stop asked at the end changes nothing
                stopped = bool(stop())
                if comm.size > 1:
                    stopped = any(comm.allgather_object(stopped))
            if (eval_every and reached % eval_every == 0) or (last and not stopped):
                record["val"] = (evaluate(config, params, batches, eval_batches, comm=comm)
                                 if eval_batches is not None else evaluate_split(
                                     config, params, batches.splits["val"], batches.block,
                                     batch=batches.batch)["nats"])
                history["val"].append((reached, record["val"]))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if callback is not None:
                callback(reached, record)
            if stopped:
                break
            if save_every and reached % save_every == 0 and not last:
                save(reached)
        if bar is not None:
            bar.close()
        history["tokens"] = tokens
        history["tokens_per_s"] = tokens / busy if busy else 0.0
        history["comm_s"] = communicating
        history["step"], history["stopped"] = reached, stopped
        save(reached)
        return history


# Run directories (run.json, the newest checkpoint, log.jsonl) live in _rundir.py.
from ._rundir import (CHECKPOINT_FILE, LOG_FIELDS, LOG_FILE, RUN_FILE, Run,  # noqa: E402,F401
                      new_run, open_data, read_run, resume)
