"""BitNet b1.58 inference: the published ternary language models (microsoft/bitnet-b1.58-2B-4T,
1bitLLM's bitnet_b1_58 models) run from Python with no torch. (Falcon3's 1.58-bit models are
Llama networks without BitNet's sub-norms: ``load`` refuses them as not BitNet.)

The model is transformers' ``BitNetForCausalLM`` (``reference/bitnet.py`` holds its equations in
float64). ``load(path)`` reads a Hugging Face folder (packed "offline" BitNet weights with either
``linear_class``, or 16/32-bit master weights ternarized at load; one or several safetensors
files) or a GGUF file of llama.cpp's ``bitnet`` architecture (TQ1_0 / TQ2_0); ``forward`` runs
tokens through a KV cache; ``generate`` streams new tokens; ``save_gguf`` writes the model for
llama.cpp. ``python -m lowbit.models.bitnet PATH --prompt "..."`` streams text.

Layout: ``_config.py`` (``BitNetConfig``), ``_params.py`` (the params dict, ``Dense``),
``_load.py`` / ``_hf.py`` / ``_gguf.py`` / ``_tokenizer.py`` (files), ``_forward.py`` (the
cached forward), ``_head.py`` (output head), ``_generate.py`` (sampling), ``__main__.py`` (the
command). Tests: ``tests/test_bitnet*.py``; speed: ``python -m bench bitnet``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ... import _backend
from ..._typing import Array
from ._config import ACTIVATIONS, BitNetConfig
from ._forward import KVCache, new_cache, run
from ._generate import check_sampling, stream
from ._gguf import save_gguf
from ._head import quantize_head as _quantize_head
from ._load import load
from ._params import Dense, Param, check_params, random_params
from ._tokenizer import StreamDecoder, Tokenizer

__all__ = ["BitNetConfig", "Dense", "KVCache", "StreamDecoder", "Tokenizer", "forward",
           "generate", "load", "new_cache", "quantize_head", "random_params", "save_gguf"]


def _ids(ids: Any, vocab: int, name: str = "ids") -> np.ndarray:
    arr = np.asarray(_backend.array_module(ids).asnumpy(ids) if _backend.is_cupy_array(ids)
                     else ids)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        bad = arr[(arr < 0) | (arr >= vocab)].flat[0]
        raise ValueError(f"{name} holds {int(bad)}, outside the vocabulary [0, {vocab})")
    return arr.astype(np.int64)


def forward(config: BitNetConfig, params: dict[str, Param], ids: Array,
            cache: KVCache | None = None, *, logits: str = "all") -> tuple[Array, KVCache]:
    """Logits of ``ids``, continuing the sequences held in ``cache``.

    Args:
        config: the model's ``BitNetConfig``.
        params: its parameters (``load`` or ``random_params``).
        ids: int [T] (one sequence) or [B, T] (B sequences of equal length), T >= 1.
        cache: a ``KVCache`` from an earlier call (or ``new_cache``) for as many sequences; it is
            updated in place and returned. None: a new one.
        logits: "all" (every position) or "last" (the last position of each sequence).

    Returns:
        ``(logits, cache)``: float32 [T, vocab] / [B, T, vocab] ("all") or [vocab] / [B, vocab]
        ("last"), on the array module of the params.

    Raises:
        TypeError: non-integer ids.
        ValueError: bad ids shape or values, a cache for another batch, a sequence past
            ``max_position_embeddings``, params that do not match ``config``.
    """
    check_params(config, params)
    arr = _ids(ids, config.vocab_size)
    if arr.ndim not in (1, 2) or arr.shape[-1] < 1:
        raise ValueError(f"ids must be [T] or [B, T] with T >= 1, got shape {arr.shape}")
    if logits not in ("all", "last"):
        raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
    rows = arr.reshape(-1, arr.shape[-1])
    B, T = rows.shape
    xp = _backend.array_module(params["model.embed_tokens"].data)
    if cache is None:
        cache = new_cache(config, B, capacity=max(T, 256), xp=xp)
    elif not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache or None, got {type(cache).__name__}")
    elif cache.batch != B:
        raise ValueError(f"cache holds {cache.batch} sequences but ids has {B}")
    out = run(config, params, xp.asarray(rows.reshape(-1)), np.full(B, T, np.int64), cache,
              last_only=logits == "last")
    shape = (B,) if logits == "last" else (B, T)
    out = out.reshape(shape + (config.vocab_size,))
    return (out[0] if arr.ndim == 1 else out), cache


def generate(config: BitNetConfig, params: dict[str, Param], ids: Array | Sequence[Sequence[int]],
             max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0,
             stop: Sequence[int] | None = None) -> Iterator:
    """Stream new tokens after one prompt or several decoded together.

    The prompts are prefilled together (the packed GEMM), then each step decodes one token per
    unfinished sequence (the packed GEMV) against the KV cache.

    Args:
        config, params: the model.
        ids: one prompt, int [T]; or several: an int [B, T] array or a list of int sequences of
            any lengths (each >= 1).
        max_new_tokens: the most tokens generated per prompt (>= 0).
        temperature: 0 is greedy (the first maximal logit); else the logits are divided by it.
        top_k: sample among the ``top_k`` most likely tokens only.
        top_p: then among the smallest set of most likely tokens whose probability reaches it.
        seed: the sampler's seed (``numpy.random.default_rng``); one draw per sequence per step,
            in sequence order.
        stop: token ids that end a sequence (not yielded); default the config's
            ``eos_token_id``; ``()`` never stops early.

    Yields:
        one prompt: each new token id (int). Several: per step an int64 [B] array of the new
        ids, -1 for sequences that have stopped; it ends when all have.

    Raises:
        TypeError / ValueError: bad ids, ``max_new_tokens``, sampling options or ``stop``
            (raised when ``generate`` is called, before any token is computed).
    """
    check_params(config, params)
    single = not isinstance(ids, (list, tuple)) and np.ndim(ids) == 1
    if isinstance(ids, (list, tuple)) and ids and np.ndim(ids[0]) == 0:
        single = True
    if single:
        prompts = [_ids(ids, config.vocab_size)]
    elif isinstance(ids, (list, tuple)):
        prompts = [_ids(p, config.vocab_size, f"ids[{i}]") for i, p in enumerate(ids)]
    else:
        arr = _ids(ids, config.vocab_size)
        if arr.ndim != 2:
            raise ValueError(f"ids must be [T], [B, T] or a list of sequences, got shape "
                             f"{arr.shape}")
        prompts = list(arr)
    if not prompts or any(p.ndim != 1 or len(p) < 1 for p in prompts):
        raise ValueError("ids must hold at least one prompt, each a 1-d sequence of >= 1 ids")
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
            or max_new_tokens < 0):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p, config.vocab_size)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    stops = frozenset(config.eos_token_id if stop is None else
                      (int(t) for t in _ids(np.asarray(list(stop), np.int64).reshape(-1),
                                             config.vocab_size, "stop")))
    longest = max(len(p) for p in prompts)
    if longest > config.max_position_embeddings:
        raise ValueError(f"a prompt of {longest} tokens exceeds max_position_embeddings = "
                         f"{config.max_position_embeddings}")
    return stream(config, params, prompts, int(max_new_tokens), temperature, top_k, top_p,
                  int(seed), stops, single)


def quantize_head(config: BitNetConfig, params: dict[str, Param]) -> dict[str, Param]:
    """A copy of ``params`` whose ``lm_head`` is int8 with one scale per vocabulary row (the
    embedding, when tied, stays as it is for the input lookup): half the bytes a 16-bit head
    reads per decode step, at the cost of the logit error ``python -m bench bitnet``
    reports."""
    check_params(config, params)
    head = params.get("lm_head", params["model.embed_tokens"])
    if not isinstance(head, Dense):
        return dict(params)
    return {**params, "lm_head": _quantize_head(head)}
