"""Token sampling and the streaming ``generate`` loop over the KV cache."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ... import _backend
from ._config import BitNetConfig
from ._forward import new_cache, run
from ._params import Param


def check_sampling(temperature, top_k, top_p, vocab: int):
    """Validated ``(temperature, top_k, top_p)``."""
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating))
            or not np.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                              or top_k < 1):
        raise ValueError(f"top_k must be None or a positive int, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool)
                              or not isinstance(top_p, (int, float, np.floating))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    return float(temperature), None if top_k is None else min(int(top_k), vocab), top_p


def sample(logits: np.ndarray, temperature: float, top_k, top_p, rng) -> int:
    """One token from float logits [vocab]: greedy at temperature 0 (the first maximum), else
    softmax(logits / temperature) restricted to the ``top_k`` largest, then to the smallest set
    of most probable tokens whose probability reaches ``top_p`` (always at least one)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    if top_k is not None:
        order = order[:top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p is not None and top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    u = rng.random()
    return int(order[min(int(np.searchsorted(np.cumsum(p), u, side="right")), len(p) - 1)])


def stream(config: BitNetConfig, params: dict[str, Param], prompts: list[np.ndarray],
           max_new_tokens: int, temperature: float, top_k, top_p, seed, stop: frozenset,
           single: bool) -> Iterator:
    """The generator behind ``generate`` (arguments validated)."""
    xp = _backend.array_module(params["model.embed_tokens"].data)
    B = len(prompts)
    longest = max(len(p) for p in prompts)
    cache = new_cache(config, B, capacity=min(config.max_position_embeddings,
                                              longest + max_new_tokens), xp=xp)
    rng = np.random.default_rng(seed)
    counts = np.array([len(p) for p in prompts], np.int64)
    tokens = np.concatenate(prompts).astype(np.int64)
    alive = np.ones(B, bool)
    for _ in range(max_new_tokens):
        logits = run(config, params, xp.asarray(tokens), counts, cache, last_only=True)
        logits = logits if xp is np else xp.asnumpy(logits)
        new = np.full(B, -1, np.int64)
        for b in np.flatnonzero(alive):
            t = sample(logits[b], temperature, top_k, top_p, rng)
            if t in stop:
                alive[b] = False
            else:
                new[b] = t
        if not alive.any() and single:
            return
        if single:
            yield int(new[0])
        else:
            yield new
            if not alive.any():
                return
        counts = alive.astype(np.int64)
        tokens = new[alive]
        if int(cache.lengths.max()) + 1 > config.max_position_embeddings:
            return
