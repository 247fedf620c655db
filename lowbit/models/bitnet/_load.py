"""``load``: a BitNet model from a Hugging Face folder (``_hf.py``) or a ``bitnet`` GGUF file
(``_gguf.py``), with its tokenizer (``_tokenizer.py``) where the files carry one.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...io._files import StrPath
from ...ops.quantize import PackedWeight
from ._config import BitNetConfig
from ._gguf import load_gguf_model
from ._hf import load_hf
from ._params import Dense, Param, check_params, fuse_projections
from ._tokenizer import Tokenizer


def to_xp(params: dict[str, Param], xp: Any) -> dict[str, Param]:
    """``params`` with every array put on the array module ``xp`` (``numpy`` or ``cupy``)
    through ``xp.asarray``, as ``lowbit.io.load`` moves arrays."""
    out: dict[str, Param] = {}
    for name, value in params.items():
        if isinstance(value, PackedWeight):
            out[name] = PackedWeight(value.format, value.shape, xp.asarray(value.data),
                                     xp.asarray(value.scale))
        elif isinstance(value, Dense):
            out[name] = Dense(xp.asarray(value.data), value.dtype)
        else:
            out[name] = xp.asarray(value)
    return out


def load(path: StrPath, *, xp: Any = None
         ) -> tuple[BitNetConfig, dict[str, Param], Tokenizer | None]:
    """Read a BitNet b1.58 model.

    Args:
        path: a Hugging Face folder (``config.json`` with ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``; ``tokenizer.json`` optional) or a ``.gguf`` file
            of llama.cpp's ``bitnet`` architecture.
        xp: ``numpy`` (default) or ``cupy``: where the parameters are put (read on the host,
            then moved with ``xp.asarray``).

    Returns:
        ``(config, params, tokenizer)``: ``params`` in ``_params.py``'s layout, checked with
        ``check_params``; the tokenizer None where the files carry none (or one this package
        cannot run: a warning says so).

    Raises:
        FileNotFoundError: a missing path, ``config.json``, model file or shard.
        ImportError: a GGUF file without the ``gguf`` package.
        ValueError: an unknown architecture, quantization method or tensor type, a config that
            contradicts the tensors, a missing, extra, misshapen or mistyped tensor, a truncated
            or malformed file; the message names the file and the tensor. Nothing is returned
            half-built: every tensor is converted before the call returns.
    """
    p = os.fspath(path)
    if os.path.isdir(p):
        config, params = load_hf(p)
        tokenizer = Tokenizer.from_folder(p)
    elif os.path.isfile(p):
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{p}: not a GGUF file (magic {magic!r}) nor a Hugging Face folder")
        config, params, tokenizer = load_gguf_model(p)
    else:
        raise FileNotFoundError(f"{p}: no such file or folder")
    check_params(config, params, p)
    params = fuse_projections(config, params, in_place=True)  # the forward's fused layout
    if xp is not None and xp is not np:
        params = to_xp(params, xp)
    return config, params, tokenizer
