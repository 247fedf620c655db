"""Reading a Hugging Face BitNet folder (transformers' ``BitNetForCausalLM``): ``load_hf``.

The folder holds ``config.json`` and ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (its ``weight_map`` names each tensor's file). Tensors are read
with ``lowbit.io.safetensors.read_raw`` (no torch; bfloat16 kept as its bits for the ``Dense``
embedding). The projections come in one of two forms, chosen as transformers chooses the layer
class (``integrations/bitnet.py``, ``replace_with_bitnet_linear``):

- packed (``quantization_config.quant_method == "bitnet"``, ``linear_class`` "bitlinear", the
  default, or "autobitlinear" with ``quantization_mode`` "offline", the default): uint8
  ``[ceil(out / 4), in]`` beside ``<name>.weight_scale``; ``BitLinear`` divides the output by
  the scale, ``AutoBitLinear`` multiplies by it (``lowbit.io.hf_bitnet``'s two conventions);
- master weights (no ``quantization_config``, or "autobitlinear" with "online"): float
  ``[out, in]``, ternarized here with ``lowbit.quantize_weight`` (BitNet's absmean rule, which
  ``AutoBitLinear`` applies online at every call, as 1bitLLM's ``BitnetForCausalLM`` does; its
  sub-norms ``inner_attn_ln`` / ``ffn_layernorm`` are read as ``attn_sub_norm`` /
  ``ffn_sub_norm``).

Not BitNet here: a ``LlamaForCausalLM`` with a bitnet ``quantization_config`` (Falcon3's
1.58-bit models) has no sub-norms, which this model always applies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...io.hf_bitnet import from_hf_bitnet
from ...io.safetensors import read_raw
from ...ops.quantize import quantize_weight
from ._config import BitNetConfig
from ._params import Dense, Param, expected_shapes

_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: 1bitLLM's spellings of the sub-norms (``BitnetForCausalLM``; gguf's ``tensor_mapping.py``
#: maps both spellings to ``attn_sub_norm`` / ``ffn_sub_norm``).
_ALIASES = {"self_attn.attn_sub_norm": "self_attn.inner_attn_ln",
            "mlp.ffn_sub_norm": "mlp.ffn_layernorm"}
#: Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

Tensors = dict[str, tuple[str, np.ndarray, str]]


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None


def read_tensors(folder: str) -> Tensors:
    """name -> (safetensors dtype code, host array, file) of every tensor of the folder.

    Raises:
        FileNotFoundError: no ``model.safetensors`` nor index, or a shard the index names.
        ValueError: a malformed file or index, a tensor in two shards, a tensor the index puts
            in a shard that lacks it, a shard tensor the index does not list.
    """
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        raw, _ = read_raw(single)
        return {n: (c, a, single) for n, (c, a) in raw.items()}
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{folder}: neither model.safetensors nor "
                                "model.safetensors.index.json")
    spec = _read_json(index)
    weight_map = spec.get("weight_map") if isinstance(spec, dict) else None
    if not (isinstance(weight_map, dict)
            and all(isinstance(v, str) and v for v in weight_map.values())):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard files")
    out: Tensors = {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(folder, shard)
        if os.path.basename(shard) != shard:
            raise ValueError(f"{index}: shard {shard!r} is not a file name in the folder")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{index}: shard {shard!r} does not exist ({path})")
        raw, _ = read_raw(path)
        for name, (code, arr) in raw.items():
            if name in out:
                raise ValueError(f"{path}: tensor {name!r} is also in {out[name][2]}")
            if weight_map.get(name) != shard:
                raise ValueError(f"{path}: tensor {name!r} is not listed for this shard in "
                                 f"{index}")
            out[name] = (code, arr, path)
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise ValueError(f"{index}: tensor {missing[0]!r} is listed in shard "
                         f"{weight_map[missing[0]]!r}, which lacks it")
    return out


def projection_mode(cfg: Mapping[str, Any], source: str,
                    modules: tuple[str, ...] = ()) -> str | None:
    """None (master weights) or the packed scale convention ("bitlinear" / "autobitlinear") of
    a parsed ``config.json``'s ``quantization_config`` (transformers' ``BitNetQuantConfig``
    defaults: ``linear_class`` "bitlinear", ``quantization_mode`` "offline").

    Raises:
        ValueError: another quantization method, an unknown class or mode, options this
            package does not compute (``use_rms_norm``, a ``modules_to_not_convert`` entry
            that names one of ``modules``, the projections' module names, as transformers
            matches them: a substring of the name).
    """
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"{source}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "bitnet":
        raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not "
                         "supported (only 'bitnet')")
    linear_class = qc.get("linear_class") or "bitlinear"
    mode = qc.get("quantization_mode") or "offline"
    if linear_class not in ("bitlinear", "autobitlinear"):
        raise ValueError(f"{source}: quantization_config.linear_class {linear_class!r} is not "
                         "'bitlinear' or 'autobitlinear'")
    if mode not in ("offline", "online"):
        raise ValueError(f"{source}: quantization_config.quantization_mode {mode!r} is not "
                         "'offline' or 'online'")
    if qc.get("use_rms_norm"):
        raise ValueError(f"{source}: quantization_config.use_rms_norm (an RMSNorm inside each "
                         "BitLinear) is not supported")
    for key in qc.get("modules_to_not_convert") or []:
        if any(str(key) in m for m in modules):
            raise ValueError(f"{source}: quantization_config.modules_to_not_convert "
                             f"{key!r} leaves projections in full precision, which is not "
                             "supported")
    return None if (linear_class, mode) == ("autobitlinear", "online") else str(linear_class)


def _float(name: str, entry: tuple[str, np.ndarray, str]) -> np.ndarray:
    code, arr, path = entry
    if code not in _FLOATS:
        raise ValueError(f"{path}: tensor {name!r} has dtype {code}, expected one of "
                         f"{sorted(_FLOATS)}")
    if code == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def _shaped(name: str, entry: tuple[str, np.ndarray, str], shape: tuple[int, ...]) -> None:
    if entry[1].shape != shape:
        raise ValueError(f"{entry[2]}: tensor {name!r} has shape {entry[1].shape}, but the "
                         f"config implies {shape}")


def _projection(name: str, shape: tuple[int, int], tensors: Tensors, used: set[str],
                convention: str | None) -> Param:
    K, N = shape
    key, skey = name + ".weight", name + ".weight_scale"
    entry = tensors[key]
    path = entry[2]
    if convention is None:
        if skey in tensors:
            raise ValueError(f"{tensors[skey][2]}: tensor {skey!r}: master weights (no "
                             "offline bitnet quantization_config) take no weight_scale")
        _shaped(key, entry, (N, K))
        return quantize_weight(np.ascontiguousarray(_float(key, entry).T), "ternary")
    if skey not in tensors:
        raise ValueError(f"{path}: missing tensor {skey!r} (packed {convention} weights carry "
                         "a weight_scale)")
    used.add(skey)
    if entry[0] != "U8":
        raise ValueError(f"{path}: tensor {key!r} has dtype {entry[0]}, but the "
                         f"quantization_config ({convention}, offline) means packed U8 weights")
    _shaped(key, entry, (-(-N // 4), K))
    scale = _float(skey, tensors[skey])
    try:
        return from_hf_bitnet(entry[1], scale, (K, N), convention)
    except ValueError as exc:
        raise ValueError(f"{path}: tensor {key!r}: {exc}") from None


def load_hf(folder: str | os.PathLike[str]) -> tuple[BitNetConfig, dict[str, Param]]:
    """``(config, params)`` of a Hugging Face BitNet folder, on the host.

    Raises:
        FileNotFoundError: a missing folder, ``config.json`` or model file.
        ValueError: an unknown architecture or quantization, a config that contradicts the
            tensors, a missing, extra, misshapen or mistyped tensor, a malformed file (each
            message names the file and the tensor).
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such folder")
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{folder}: no config.json")
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: not a JSON object")
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "bitnet" and not {"BitNetForCausalLM", "BitnetForCausalLM"} \
            & set(archs):
        raise ValueError(f"{cfg_path}: model_type {cfg.get('model_type')!r} / architectures "
                         f"{archs!r} is not BitNet (BitNetForCausalLM)")
    config = BitNetConfig.from_hf_dict(cfg, cfg_path)
    want = expected_shapes(config)
    convention = projection_mode(cfg, cfg_path, tuple(n for n, (k, _) in want.items()
                                                      if k == "ternary"))
    tensors = read_tensors(folder)
    used: set[str] = set()
    params: dict[str, Param] = {}
    for name, (kind, shape) in want.items():
        key = name + ".weight"
        for new, old in _ALIASES.items():
            alias = name.replace(new, old) + ".weight"
            if name.endswith(new) and key not in tensors and alias in tensors:
                key = alias
        if key not in tensors:
            raise ValueError(f"{folder}: missing tensor {key!r}")
        used.add(key)
        entry = tensors[key]
        if kind == "ternary":
            params[name] = _projection(name, shape, tensors, used, convention)  # type: ignore
            continue
        _shaped(key, entry, shape)
        if kind == "norm":
            params[name] = np.ascontiguousarray(_float(key, entry))
        elif entry[0] in _FLOATS:
            params[name] = Dense(np.ascontiguousarray(entry[1]), _FLOATS[entry[0]])
        else:
            _float(key, entry)  # raises, naming the dtype
    head = tensors.get("lm_head.weight")
    if config.tie_word_embeddings and head is not None:
        emb = tensors["model.embed_tokens.weight"]
        if head[0] != emb[0] or not np.array_equal(head[1], emb[1]):
            raise ValueError(f"{head[2]}: tensor 'lm_head.weight' differs from the embedding, "
                             "but config.json ties them (tie_word_embeddings)")
        used.add("lm_head.weight")
    extra = sorted(n for n in set(tensors) - used if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"{tensors[extra[0]][2]}: unexpected tensor {extra[0]!r} for this "
                         f"config ({len(extra)} in all)")
    return config, params
