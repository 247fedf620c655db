"""Training beside the model: byte batches, learning-rate schedules, checkpoints, the loop.

Siblings: ``bdh.py`` (the model); tests ``tests/test_train.py``; the main job ``bench/train.py``
trains fp32 against low-bit configurations with this loop.

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
import json
import math
import time
from typing import Any, Callable

import numpy as np

from .. import _backend, _validate
from .._typing import Array
from ..distributed import Communicator
from ..io import safetensors as checkpoint_file
from ..io._files import StrPath
from ..ops.adamw import AdamW
from ..ops.adamw import _max_grad_norm as _check_max_grad_norm
from ..ops.lowrank_residual import BlockPattern, LowBitPlan
from ..ops.saved_activation import SavedConfig
from . import bdh

#: Fraction of the corpus used for training; the rest is the validation split.
TRAIN_FRACTION = 0.9
#: Format version of the checkpoint files this module writes.
CHECKPOINT_VERSION = 2  # 2: a lowbit.io safetensors file (1 was .npz)
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
        data: the corpus (bytes or a uint8 array).
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


# -- checkpoints --------------------------------------------------------------------------------

def _config_dict(config: bdh.BDHConfig) -> dict[str, Any]:
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out["plan"] = dataclasses.asdict(config.plan)
    saved = config.saved
    out["saved"] = dataclasses.asdict(saved) if isinstance(saved, SavedConfig) else saved
    pattern = config.latent_pattern
    out["latent_pattern"] = None if pattern is None else {
        "block_size": pattern.block_size,
        "active": None if pattern.active is None else pattern.active.tolist()}
    return out


def config_from_dict(d: dict[str, Any]) -> bdh.BDHConfig:
    """The ``BDHConfig`` of a checkpoint's config entry (the inverse of the dict a checkpoint
    stores: plan, saved policy and latent pattern rebuilt from their JSON forms)."""
    d = dict(d)
    d["plan"] = LowBitPlan(**{k: tuple(v) for k, v in d["plan"].items()})
    if isinstance(d["saved"], dict):
        d["saved"] = SavedConfig(**d["saved"])
    pattern = d.get("latent_pattern")
    if pattern is not None:
        active = pattern["active"]
        d["latent_pattern"] = BlockPattern(pattern["block_size"],
                                           None if active is None else np.asarray(active, bool))
    return bdh.BDHConfig(**d)


#: The metadata entry of a checkpoint file that holds everything but the arrays (JSON).
_META_KEY = "checkpoint"


def save_checkpoint(path: StrPath, config: bdh.BDHConfig, params: dict[str, Array],
                    optimizer: AdamW, step: int, batches: Batches | _RankStreams,
                    extra: dict[str, Any] | None = None) -> None:
    """Write parameters, optimizer state, step, batch-generator state and config to ``path``
    through ``lowbit.io.save`` (a safetensors file; the config, step, optimizer scalars and
    generator state as JSON in its metadata), atomically: a crash mid-save leaves the previous
    file intact."""
    state = optimizer.state_dict()
    arrays = {f"param/{k}": v for k, v in params.items()}
    for slot in ("exp_avg", "exp_avg_sq"):
        arrays.update({f"{slot}/{k}": v for k, v in state[slot].items()})
    meta = {"version": CHECKPOINT_VERSION, "config": _config_dict(config), "step": int(step),
            "optimizer": {k: v for k, v in state.items() if k not in ("exp_avg", "exp_avg_sq")},
            "batches": batches.state(), "extra": extra or {}}
    checkpoint_file.save(path, arrays, metadata={_META_KEY: json.dumps(meta)})


def load_checkpoint(path: StrPath, config: bdh.BDHConfig | None = None,
                    xp: Any = np) -> dict[str, Any]:
    """Read a checkpoint of ``save_checkpoint``.

    Returns:
        dict with ``config``, ``params`` (arrays on ``xp``), ``optimizer`` (a state dict for
        ``AdamW.load_state_dict``), ``step``, ``batches`` (generator state), ``extra``.

    Raises:
        ValueError: the file is truncated or not a lowbit checkpoint, or ``config`` is given and
            differs from the checkpoint's.
    """
    try:
        data, meta = checkpoint_file.load(path, xp=xp, with_metadata=True)
        meta = json.loads(meta[_META_KEY])
    except (KeyError, ValueError, OSError) as exc:
        raise ValueError(f"checkpoint {path!r} is truncated or not a lowbit checkpoint: {exc}") \
            from None
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {path!r} has version {meta.get('version')}, expected "
                         f"{CHECKPOINT_VERSION}")
    stored = config_from_dict(meta["config"])
    if config is not None and stored != config:
        raise ValueError(f"checkpoint {path!r} was written for another config: {stored} "
                         f"(asked for {config})")

    def group(prefix: str) -> dict[str, Any]:
        return {k.split("/", 1)[1]: v for k, v in data.items() if k.startswith(prefix + "/")}

    optimizer = dict(meta["optimizer"], exp_avg=group("exp_avg"), exp_avg_sq=group("exp_avg_sq"))
    return {"config": stored, "params": group("param"), "optimizer": optimizer,
            "step": meta["step"], "batches": meta["batches"], "extra": meta["extra"]}


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
          seed: int = 0, eval_every: int = 0, eval_batches: int = 4,
          max_grad_norm: float | None = 1.0, accumulate: int = 1,
          callback: Callable[[int, dict[str, float]], object] | None = None,
          progress: bool = True, checkpoint: StrPath | None = None,
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
        callback: called as ``callback(step, record)`` after every step.
        progress: show a tqdm progress bar with step, loss and tokens/s.
        checkpoint: a path: written (atomically) at the end.
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
        ``optimizer``.

    Raises:
        TypeError, ValueError: a bad ``steps``, ``accumulate`` or ``max_grad_norm``; an
            ``optimizer`` whose ``max_grad_norm`` differs from the ``max_grad_norm`` argument
            (both named); ``batches.rank`` other than the communicator's rank.
    """
    comm = Communicator() if comm is None else comm
    with comm.guard():
        steps = schedule.steps if steps is None else _validate.integer(steps, "steps", minimum=0)
        accumulate = _validate.integer(accumulate, "accumulate", minimum=1)
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
                             max_grad_norm, accumulate, checkpoint is None),
                            "the configs, parameter shapes and training arguments")
        comm.broadcast([params[n] for n in names])
        if optimizer is None:
            lr, wd = schedule(start_step)
            optimizer = AdamW(lr=lr, weight_decay=wd, max_grad_norm=max_grad_norm)
        history: dict[str, Any] = {"train": [], "val": [], "optimizer": optimizer}
        bar = None
        if progress and comm.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=steps - start_step, desc="train", unit="step", leave=False)
        tokens = 0
        busy = communicating = 0.0
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
            if (eval_every and (step + 1) % eval_every == 0) or last:
                record["val"] = evaluate(config, params, batches, eval_batches, comm=comm)
                history["val"].append((step + 1, record["val"]))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if callback is not None:
                callback(step + 1, record)
        if bar is not None:
            bar.close()
        history["tokens"] = tokens
        history["tokens_per_s"] = tokens / busy if busy else 0.0
        history["comm_s"] = communicating
        if checkpoint is not None:
            streams = comm.allgather_object(batches.state())
            if comm.rank == 0:
                save_checkpoint(checkpoint, config, params, optimizer, steps,
                                batches if comm.size == 1 else _RankStreams(streams))
            # No rank returns before the file is there (a rank may load it next).
            comm.allgather_object(None)
        return history
