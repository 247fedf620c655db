"""pathwaycom/bdh's torch ``state_dict`` to lowbit's BDH parameters and back, without torch.

pathwaycom's ``BDH`` module holds ``embed`` (an ``nn.Embedding``: key ``embed.weight`` [V, D])
and the parameters ``encoder`` [H, D, N], ``encoder_v`` [H, D, N], ``decoder`` [H * N, D] and
``lm_head`` [D, V]: lowbit's shapes and orientation (``BDHConfig.shapes()``), so the conversion
renames ``embed.weight`` and casts to float32. Its state dict also carries the rotary
frequencies of its attention modules (buffers ending in ``freqs``: lowbit computes the same
angles itself) and, in some versions, an ``lm_gate`` parameter its forward never reads; both
are dropped. A ``torch.compile``'d module's keys (prefix ``_orig_mod.``) are accepted.

Siblings: ``__init__.py`` (the model); tests ``tests/test_bdh_torch.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..._typing import Array

#: lowbit's parameter name -> pathwaycom's state-dict key.
TORCH_KEYS = {"embed": "embed.weight", "encoder": "encoder", "encoder_v": "encoder_v",
              "decoder": "decoder", "lm_head": "lm_head"}
#: Prefix of the keys of a ``torch.compile``'d module's state dict.
COMPILED_PREFIX = "_orig_mod."
#: Keys of pathwaycom's state dict that hold nothing lowbit's model uses.
UNUSED_KEYS = ("lm_gate",)


def _host(value: Any, key: str) -> np.ndarray:
    """A host numpy array from a numpy array, a cupy array or a torch tensor (``.numpy()``)."""
    if not isinstance(value, np.ndarray):
        if hasattr(value, "get") and not hasattr(value, "numpy"):  # cupy
            value = value.get()
        elif hasattr(value, "numpy"):
            for step in ("detach", "cpu"):
                if hasattr(value, step):
                    value = getattr(value, step)()
            value = value.numpy()
    try:
        out = np.asarray(value)
    except Exception as exc:  # noqa: BLE001 (any conversion failure names the key)
        raise TypeError(f"state_dict[{key!r}] is not an array ({type(value).__name__}): "
                        f"{exc}") from None
    if out.dtype.kind != "f":
        raise TypeError(f"state_dict[{key!r}] must be a floating array, got {out.dtype}")
    return out


def _config_of(shapes: dict[str, tuple[int, ...]], config: Any) -> Any:
    """The ``BDHConfig`` of the shapes (``config``'s other fields kept, or the defaults)."""
    from . import BDHConfig

    emb, enc = shapes["embed"], shapes["encoder"]
    if len(emb) != 2:
        raise ValueError(f"state_dict['embed.weight'] must be [V, D], got shape {emb}")
    if len(enc) != 3:
        raise ValueError(f"state_dict['encoder'] must be [H, D, N], got shape {enc}")
    V, D = emb
    H, _, N = enc
    if enc[1] != D or (N * H) % D:
        raise ValueError(f"state_dict['encoder'] of shape {enc} does not fit D = {D} of "
                         f"embed.weight (it must be [H, D, N] with D dividing N * H)")
    fields: dict[str, Any] = dict(n_embd=D, n_head=H, mlp_internal_dim_multiplier=N * H // D,
                                  vocab_size=V)
    if config is None:
        return BDHConfig(**fields)
    import dataclasses

    return dataclasses.replace(config, **fields)


def from_torch_state_dict(state_dict: Mapping[str, Any], config: Any = None
                          ) -> dict[str, np.ndarray]:
    """lowbit BDH parameters from the ``state_dict`` of pathwaycom/bdh's ``BDH`` module.

    Args:
        state_dict: a mapping of its keys (``embed.weight``, ``encoder``, ``encoder_v``,
            ``decoder``, ``lm_head``; ``*freqs`` buffers and ``lm_gate`` are dropped) to arrays:
            numpy arrays, objects with ``__array__``, or tensors with ``.numpy()`` (detached
            and moved to the host first); torch itself is never imported.
        config: the ``BDHConfig`` the shapes must match (None: only consistent with one
            another; ``infer_torch_config`` gives the config they imply).

    Returns:
        a dict of host float32 arrays under lowbit's names (``bdh.PARAMS``), contiguous copies.

    Raises:
        ValueError: a missing or unknown key, or a shape that disagrees (the message names the
            key).
        TypeError: a value that is not a floating array.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to arrays, got "
                        f"{type(state_dict).__name__}")
    plain = {(k[len(COMPILED_PREFIX):] if isinstance(k, str) and k.startswith(COMPILED_PREFIX)
              else k): v for k, v in state_dict.items()}
    missing = [key for key in TORCH_KEYS.values() if key not in plain]
    if missing:
        raise ValueError(f"state_dict is missing key {missing[0]!r} (pathwaycom/bdh's BDH keys: "
                         f"{list(TORCH_KEYS.values())})")
    unknown = [k for k in plain if k not in TORCH_KEYS.values() and k not in UNUSED_KEYS
               and not (isinstance(k, str) and k.endswith("freqs"))]
    if unknown:
        raise ValueError(f"state_dict has key {unknown[0]!r}, which is not one of pathwaycom/"
                         f"bdh's BDH ({list(TORCH_KEYS.values())}, *freqs, lm_gate)")
    arrays = {name: _host(plain[key], key) for name, key in TORCH_KEYS.items()}
    want = (_config_of({n: tuple(a.shape) for n, a in arrays.items()}, None)
            if config is None else config).shapes()
    for name, shape in want.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"state_dict[{TORCH_KEYS[name]!r}] has shape "
                             f"{tuple(arrays[name].shape)}, expected {shape}"
                             + (" (the config's)" if config is not None else
                                " (from embed.weight and encoder)"))
    return {name: np.ascontiguousarray(a, dtype=np.float32).copy() for name, a in arrays.items()}


def infer_torch_config(state_dict: Mapping[str, Any], config: Any = None) -> Any:
    """The ``BDHConfig`` whose shapes a pathwaycom/bdh ``state_dict`` has.

    Args:
        state_dict: as in ``from_torch_state_dict``.
        config: a ``BDHConfig`` whose other fields (``n_layer``, ``dropout``, the plan ...) to
            keep; None: the defaults (the state dict does not hold ``n_layer``: the levels share
            their weights).

    Returns:
        a ``BDHConfig`` with ``n_embd``, ``n_head``, ``mlp_internal_dim_multiplier`` and
        ``vocab_size`` from the shapes.

    Raises:
        ValueError, TypeError: as ``from_torch_state_dict``.
    """
    params = from_torch_state_dict(state_dict)
    return _config_of({n: tuple(a.shape) for n, a in params.items()}, config)


def to_torch_state_dict(params: Mapping[str, Array]) -> dict[str, np.ndarray]:
    """pathwaycom/bdh's ``state_dict`` keys for lowbit BDH parameters (the inverse of
    ``from_torch_state_dict``): host float32 numpy arrays (copies; cupy arrays are copied to
    the host), for ``torch.from_numpy`` and ``load_state_dict(..., strict=False)`` (the
    ``freqs`` buffers are the module's own).

    Args:
        params: a dict with lowbit's names (``bdh.PARAMS``).

    Raises:
        ValueError: a missing or unknown name, or shapes that disagree with one another.
    """
    from . import PARAMS

    if not isinstance(params, Mapping) or set(params) != set(PARAMS):
        got = sorted(params) if isinstance(params, Mapping) else type(params).__name__
        raise ValueError(f"params must be a dict with keys {list(PARAMS)}, got {got}")
    out = {TORCH_KEYS[name]: np.array(_host(params[name], name), dtype=np.float32)
           for name in PARAMS}
    from_torch_state_dict(out)  # the shapes must fit together
    return out
