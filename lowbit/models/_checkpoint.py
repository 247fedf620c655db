"""Checkpoint files of ``lowbit.models.train`` (re-exported there): parameters, optimizer state,
step, batch-generator state and the model's config in one lowbit safetensors file, written
atomically (``lowbit.io.safetensors.save``).

Siblings: ``train.py`` (the loop that writes them), ``_rundir.py`` (run directories: run.json,
log.jsonl, ``resume``); tests ``tests/test_train.py`` and ``tests/test_bdh_cli.py``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

import numpy as np

from .._typing import Array
from ..io import safetensors as checkpoint_file
from ..io._files import StrPath
from ..ops.adamw import AdamW
from ..ops.lowrank_residual import BlockPattern, LowBitPlan
from ..ops.saved_activation import SavedConfig
from . import bdh

#: Format version of the checkpoint files this module writes.
CHECKPOINT_VERSION = 2  # 2: a lowbit.io safetensors file (1 was .npz)


class _Stream(Protocol):
    """What a checkpoint needs of the batch stream: its generator state (``Batches.state``)."""

    def state(self) -> dict[str, Any]: ...


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
                    optimizer: AdamW, step: int, batches: _Stream,
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
