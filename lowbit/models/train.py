"""Training beside the model: byte batches, learning-rate schedules, checkpoints, the loop.

Siblings: ``bdh.py`` (the model); tests ``tests/test_train.py``; the main job ``bench/train.py``
trains fp32 against low-bit configurations with this loop.

Reproducibility: batches come from a seeded ``numpy.random.Generator`` whose state is part of the
checkpoint, and the dropout masks of step ``s`` are keyed by ``(seed, s)``; so training N steps,
saving, loading in a fresh process and training N more gives the same parameters, bitwise, as 2N
steps in one run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import zipfile

import numpy as np

from .. import _backend, _validate
from ..ops.adamw import AdamW
from ..ops.lowrank_residual import LowBitPlan
from ..ops.saved_activation import SavedConfig
from . import bdh

#: Fraction of the corpus used for training; the rest is the validation split.
TRAIN_FRACTION = 0.9
#: Format version of the checkpoint files this module writes.
CHECKPOINT_VERSION = 1
SCHEDULES = ("fp32", "bitnet")


def default_corpus() -> bytes:
    """The English prose every CPython ships (``pydoc_data.topics``), about 0.5 MB of UTF-8."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def unigram_entropy(data) -> float:
    """Entropy of the byte distribution of ``data`` in nats per byte."""
    counts = np.bincount(np.frombuffer(bytes(data), dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class Batches:
    """Random ``[batch, block]`` windows of a byte corpus, with a 90/10 train/validation split.

    Args:
        data: the corpus (bytes or a uint8 array).
        block: tokens per sequence; batch: sequences per batch; seed: the generator's seed.
    """

    def __init__(self, data, block: int, batch: int, seed: int = 0):
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
        self.rng = np.random.default_rng(_validate.integer(seed, "seed", minimum=0))

    def sample(self, split: str = "train", rng=None):
        """``(ids, targets)``: two [batch, block] int64 arrays, targets shifted by one byte."""
        part = self.splits[split]
        rng = self.rng if rng is None else rng
        starts = rng.integers(0, len(part) - self.block, size=self.batch)
        windows = np.stack([part[s:s + self.block + 1] for s in starts]).astype(np.int64)
        return windows[:, :-1], windows[:, 1:]

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state


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

    def __post_init__(self):
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

def _config_dict(config: bdh.BDHConfig) -> dict:
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out["plan"] = dataclasses.asdict(config.plan)
    saved = config.saved
    out["saved"] = dataclasses.asdict(saved) if isinstance(saved, SavedConfig) else saved
    return out


def config_from_dict(d: dict) -> bdh.BDHConfig:
    d = dict(d)
    d["plan"] = LowBitPlan(**{k: tuple(v) for k, v in d["plan"].items()})
    if isinstance(d["saved"], dict):
        d["saved"] = SavedConfig(**d["saved"])
    return bdh.BDHConfig(**d)


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def save_checkpoint(path, config, params, optimizer, step, batches, extra=None) -> None:
    """Write parameters, optimizer state, step, batch-generator state and config to ``path``
    (``.npz``), atomically: a temporary file in the same folder, then a rename."""
    state = optimizer.state_dict()
    arrays = {f"param/{k}": _host(v) for k, v in params.items()}
    for slot in ("exp_avg", "exp_avg_sq"):
        arrays.update({f"{slot}/{k}": _host(v) for k, v in state[slot].items()})
    meta = {"version": CHECKPOINT_VERSION, "config": _config_dict(config), "step": int(step),
            "optimizer": {k: v for k, v in state.items() if k not in ("exp_avg", "exp_avg_sq")},
            "batches": batches.state(), "extra": extra or {}}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path, config=None, xp=np):
    """Read a checkpoint of ``save_checkpoint``.

    Returns:
        dict with ``config``, ``params`` (arrays on ``xp``), ``optimizer`` (a state dict for
        ``AdamW.load_state_dict``), ``step``, ``batches`` (generator state), ``extra``.

    Raises:
        ValueError: the file is truncated or not a lowbit checkpoint, or ``config`` is given and
            differs from the checkpoint's.
    """
    try:
        with np.load(path, allow_pickle=False) as f:
            data = {k: f[k] for k in f.files}
        meta = json.loads(bytes(data.pop("meta")).decode())
    except (zipfile.BadZipFile, EOFError, KeyError, ValueError, OSError) as exc:
        raise ValueError(f"checkpoint {path!r} is truncated or not a lowbit checkpoint: {exc}") \
            from None
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {path!r} has version {meta.get('version')}, expected "
                         f"{CHECKPOINT_VERSION}")
    stored = config_from_dict(meta["config"])
    if config is not None and stored != config:
        raise ValueError(f"checkpoint {path!r} was written for another config: {stored} "
                         f"(asked for {config})")

    def group(prefix):
        return {k.split("/", 1)[1]: xp.asarray(v) for k, v in data.items()
                if k.startswith(prefix + "/")}

    optimizer = dict(meta["optimizer"], exp_avg=group("exp_avg"), exp_avg_sq=group("exp_avg_sq"))
    return {"config": stored, "params": group("param"), "optimizer": optimizer,
            "step": meta["step"], "batches": meta["batches"], "extra": meta["extra"]}


# -- the loop -----------------------------------------------------------------------------------

def evaluate(config, params, batches, n_batches: int, seed: int = 0) -> float:
    """Mean validation loss over ``n_batches`` batches drawn with a generator of its own (the
    training generator is not advanced), nats per byte."""
    xp = _backend.array_module(params["embed"])
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(n_batches):
        ids, targets = batches.sample("val", rng)
        losses.append(bdh.loss(config, params, xp.asarray(ids), xp.asarray(targets)))
    return float(np.mean(losses))


def train(config, params, batches, schedule, *, steps=None, start_step=0, optimizer=None,
          seed=0, eval_every=0, eval_batches=4, max_grad_norm=1.0, callback=None,
          progress=True, checkpoint=None):
    """Train ``params`` in place with AdamW from ``start_step`` up to ``steps`` (default
    ``schedule.steps``).

    Args:
        config, params: the model (``bdh.BDHConfig``, dict of float32 arrays, updated in place).
        batches: a ``Batches`` stream; schedule: a ``Schedule``.
        optimizer: an ``AdamW`` to continue (from a checkpoint), else a new one.
        seed: keys the dropout masks, ``(seed, step)`` per step.
        eval_every: validation loss every this many steps and at the end (0: only at the end).
        callback: called as ``callback(step, record)`` after every step.
        progress: show a tqdm progress bar with step, loss and tokens/s.
        checkpoint: a path: written (atomically) at the end.

    Returns:
        dict: ``train`` [(step, loss)], ``val`` [(step, loss)], ``tokens_per_s``, ``optimizer``.
    """
    xp = _backend.array_module(params["embed"])
    steps = schedule.steps if steps is None else _validate.integer(steps, "steps", minimum=0)
    if optimizer is None:
        lr, wd = schedule(start_step)
        optimizer = AdamW(lr=lr, weight_decay=wd, max_grad_norm=max_grad_norm)
    history = {"train": [], "val": [], "optimizer": optimizer}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps - start_step, desc="train", unit="step", leave=False)
    tokens = 0
    busy = 0.0
    for step in range(start_step, steps):
        ids, targets = batches.sample("train")
        begin = time.perf_counter()
        optimizer.lr, optimizer.weight_decay = schedule(step)
        loss, ctx = bdh.forward(config, params, xp.asarray(ids), xp.asarray(targets),
                                seed=(seed * 1_000_003 + step) % 2**32)
        grads = bdh.backward(ctx)
        del ctx
        optimizer.step(params, grads)
        value = float(loss)
        busy += time.perf_counter() - begin
        tokens += ids.size
        record = {"loss": value, "lr": optimizer.lr, "tokens_per_s": tokens / busy}
        history["train"].append((step + 1, value))
        last = step + 1 == steps
        if (eval_every and (step + 1) % eval_every == 0) or last:
            record["val"] = evaluate(config, params, batches, eval_batches)
            history["val"].append((step + 1, record["val"]))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if callback is not None:
            callback(step + 1, record)
    if bar is not None:
        bar.close()
    history["tokens_per_s"] = tokens / busy if busy else 0.0
    if checkpoint is not None:
        save_checkpoint(checkpoint, config, params, optimizer, steps, batches)
    return history
