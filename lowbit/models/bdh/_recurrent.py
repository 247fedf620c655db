"""The recurrent form of the BDH model: constant work per byte, and the sampling loop.

BDH's attention is linear and strictly causal, ``a[t] = sum_{s < t} (Q_t . Q_s) v[s]`` with
``Q = rope(x_neuron)`` and ``v`` the level's input, so ``a[t] = Q_t @ S_t`` with the running
state ``S_t = sum_{s < t} Q_s^T v_s`` ([N, D] per level and head, or [width, D] on the active
latent neurons of a block pattern). One new byte at position ``t`` then costs the same whatever
``t``: per level and head the encoder projection, the rotation by the angles of position ``t``
(``lowbit.ops.rotary.rotary_tables``, the very tables of the full forward's positions), one
``[1, N] @ [N, D]`` product with the state and its rank-one update, the norm, the encoder_v
projection, and the decoder product of the level.

The weights are quantized once per ``Model`` (``quantize_layer_weights``, as the full forward
does once per call), and every projection runs the full forward's own pieces
(``lowrank_residual._layer``: the head's gathered weights, ``packed_matmul``'s straight-through
products with per-token activation codes, the decoder's row product), so the dispatch of
``lowbit.use_backend`` applies and the logits are the full forward's to float32 rounding (the
state sums the same products in another order). A prompt is read by one parallel pass
(``prefill``: the full forward's layers, plus one encoder projection per level and head for the
states ``Q^T @ v``), then ``step`` advances all rows by one byte each.

Siblings: ``__init__.py`` (``recurrent_logits``, ``generate_stream``, ``generate``); tests
``tests/test_bdh_generate.py``; benchmark ``bench/generate.py`` (``python -m bench generate``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ContextManager

import numpy as np

from ... import _backend, _dispatch, _kernels
from ..._typing import Array
from ...ops.embedding import embedding
from ...ops.layer_norm import layer_norm, normalize
from ...ops.lowrank_residual import lowrank_residual, quantize_layer_weights
from ...ops.lowrank_residual import _layer
from ...ops.lowrank_residual._pattern import latent_pattern
from ...ops.rotary import rotary_tables
from ..bitnet._generate import sample


def blas_guard(like: Array) -> ContextManager[None]:
    """One BLAS thread while the numba backend runs (as the full forward holds it)."""
    return _backend.single_threaded_blas(_dispatch.select_backend(like) == "numba")


class Model:
    """The model prepared for recurrent inference: the weights quantized once, each head's
    weights on its active latent neurons, the decoder's rows and the rotary pairs per head.

    Args:
        config: a ``BDHConfig``; params: its validated float32 parameters (numpy or cupy).
    """

    def __init__(self, config: Any, params: dict[str, Array]):
        self.config = config
        self.xp = _backend.array_module(params["embed"])
        self.embed, self.lm_head = params["embed"], params["lm_head"]
        self.weights = params["encoder"], params["encoder_v"], params["decoder"]
        encoder, encoder_v, decoder = self.weights
        H, D, N = encoder.shape
        self.D, self.N = D, N
        self.plan = config.plan
        self.packed = quantize_layer_weights(*self.weights, config.plan)
        latent = latent_pattern(config.latent_pattern, H, N, "causal_linear")
        cos1, sin1 = _layer.rope_tables(1, N, self.xp)
        self.heads = [_layer.head_weights(h, encoder, encoder_v, self.packed, cos1, sin1, latent)
                      for h in range(H)]
        # The rotary pairs of each head's active neurons (None: all N // 2), as the layer
        # gathers its tables (_layer.head_weights).
        self.pairs = [None if w.latent is None else
                      _kernels.device_constant(w.latent[0:2 * (w.width // 2):2] // 2, encoder)
                      for w in self.heads]
        self.offsets = np.concatenate([[0], np.cumsum([w.width for w in self.heads])])
        self.flat_residual = config.plan.residual != (None, None)
        self.pw_dec: Any
        self.dec32, self.pw_dec = (_layer.decoder_rows(decoder, self.packed.get("decoder"),
                                                       self.heads)
                                   if self.flat_residual else (decoder, None))

    def head_tables(self, h: int, cos: Array, sin: Array) -> tuple[Array, Array]:
        """cos/sin [..., pairs] of head ``h``'s active rotary pairs from full tables."""
        pairs = self.pairs[h]
        return (cos, sin) if pairs is None else (cos[..., pairs], sin[..., pairs])


class State:
    """The recurrent state of B sequences: ``kv[level][h]`` [B, width_h, D] float32 (None for a
    head without active neurons) and ``positions`` (host int64 [B], the next byte's position)."""

    def __init__(self, kv: list[list[Any]], positions: np.ndarray):
        self.kv = kv
        self.positions = positions

    def rows(self, keep: np.ndarray) -> State:
        """The state of the rows ``keep`` (host int64 indices), in that order."""
        if len(keep) == len(self.positions) and (keep == np.arange(len(keep))).all():
            return self
        return State([[None if s is None else s[keep] for s in level] for level in self.kv],
                     self.positions[keep])

    @staticmethod
    def stack(states: list[State], xp: Any) -> State:
        """One state of the rows of several states, in order."""
        levels = len(states[0].kv)
        kv = [[None if states[0].kv[lv][h] is None else
               xp.concatenate([s.kv[lv][h] for s in states])
               for h in range(len(states[0].kv[lv]))] for lv in range(levels)]
        return State(kv, np.concatenate([s.positions for s in states]))


def _rotate(x: Array, cos: Array, sin: Array, xp: Any) -> Array:
    """Pairs (2j, 2j + 1) of the last axis turned by the tables' angles (the layer's rope)."""
    half = cos.shape[-1]
    out = _backend.empty(x.shape, np.float32, xp)
    even, odd = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    out[..., 0:2 * half:2] = even * cos - odd * sin
    out[..., 1:2 * half:2] = odd * cos + even * sin
    if x.shape[-1] % 2:
        out[..., -1] = x[..., -1]
    return out


def _neurons(model: Model, w: Any, current: Array, qx: Any) -> Array:
    """``relu(Qa(current) @ Qw(encoder[h]))`` on the head's active neurons [..., width]."""
    return _layer._relu(_layer._project(current, qx, w.encoder, w.pwx),
                        np.float32(0.0), model.xp)


def prefill(model: Model, ids: Array) -> tuple[State, Array]:
    """Read prompts of equal length in one parallel pass.

    Args:
        model: the ``Model``; ids: [B, T] integer array of the model's array module.

    Returns:
        ``(state, logits)``: the state after the T bytes (positions T) and the logits of every
        position [B, T, V] float32 (the full forward's).
    """
    xp = model.xp
    B, T = ids.shape
    x = layer_norm(embedding(model.embed, ids))
    cos, sin = _layer.rope_tables(T, model.N, xp)
    kv: list[list[Any]] = []
    for _ in range(model.config.n_layer):
        qx = _layer._codes(x, model.plan.x[1])
        level: list[Any] = []
        for h, w in enumerate(model.heads):
            if not w.width:
                level.append(None)
                continue
            q = _rotate(_neurons(model, w, x, qx), *model.head_tables(h, cos, sin), xp)
            level.append(xp.ascontiguousarray(q.transpose(0, 2, 1) @ x))
        kv.append(level)
        x = lowrank_residual(x, *model.weights, plan=model.plan, packed=model.packed,
                             latent_pattern=model.config.latent_pattern)
    logits = (x.reshape(B * T, -1) @ model.lm_head).reshape(B, T, -1)
    return State(kv, np.full(B, T, np.int64)), logits


def empty_state(model: Model, B: int) -> State:
    """The state before any byte (zero sums, positions 0)."""
    xp = model.xp
    kv = [[None if not w.width else xp.zeros((B, w.width, model.D), np.float32)
           for w in model.heads] for _ in range(model.config.n_layer)]
    return State(kv, np.zeros(B, np.int64))


def _level_step(model: Model, kv: list[Any], current: Array, cos: Array, sin: Array) -> Array:
    """One level at one position per row: current [B, D] -> next [B, D]; updates ``kv``."""
    xp, plan = model.xp, model.plan
    B, D = current.shape
    qx = _layer._codes(current, plan.x[1])
    mlp: Any = None if model.flat_residual else xp.zeros((B, D), np.float32)
    flat: Any = (_backend.empty((B, int(model.offsets[-1])), np.float32, xp)
                 if model.flat_residual else None)
    for h, w in enumerate(model.heads):
        if not w.width:
            continue
        x_neuron = _neurons(model, w, current, qx)
        q = _rotate(x_neuron, *model.head_tables(h, cos, sin), xp)
        state = kv[h]
        a = xp.matmul(q[:, None, :], state)[:, 0]  # Q_t @ S_t: strictly earlier positions
        state += q[:, :, None] * current[:, None, :]
        a_hat, _, _ = normalize(a)
        qa = _layer._codes(a_hat, plan.y[1])
        y_gate = _layer._relu(_layer._project(a_hat, qa, w.encoder_v, w.pwy),
                              np.float32(0.0), xp)
        y_neuron = x_neuron * y_gate
        if model.flat_residual:
            flat[:, model.offsets[h]:model.offsets[h + 1]] = y_neuron
        else:
            mlp += y_neuron @ model.weights[2][w.dec_rows]
    if model.flat_residual:
        mlp, _ = _layer._decoder_flat(flat[:, None, :], model.dec32, model.pw_dec,
                                      plan.residual[1], D, xp)
        mlp = mlp[:, 0]
    m_hat, _, _ = normalize(mlp)
    m_hat += current
    return normalize(m_hat)[0]


def step(model: Model, state: State, tokens: np.ndarray) -> Array:
    """Advance every row by one byte.

    Args:
        model: the ``Model``; state: the rows' ``State`` (updated in place); tokens: host int64
            [B], each row's byte at its position.

    Returns:
        the next-byte logits [B, V] float32 on the model's array module.
    """
    xp = model.xp
    ids = xp.asarray(np.asarray(tokens, np.int64)[:, None])
    x = layer_norm(embedding(model.embed, ids))[:, 0]
    cos, sin = rotary_tables(xp.asarray(state.positions), model.N, _layer.ROPE_THETA,
                             np.float32)
    for level in range(model.config.n_layer):
        x = _level_step(model, state.kv[level], x, cos, sin)
    state.positions += 1
    return x @ model.lm_head


def logits_all(config: Any, params: dict[str, Array], ids: Array, prefill_len: int) -> Array:
    """Logits [B, T, V] of every position: the first ``prefill_len`` by ``prefill``, the rest
    by ``step`` one position at a time (arguments validated by the caller)."""
    model = Model(config, params)
    xp = model.xp
    B, T = ids.shape
    host = np.asarray(ids.get() if hasattr(ids, "get") else ids, np.int64)
    out: list[Any] = []
    with blas_guard(model.embed):
        if prefill_len:
            state, first = prefill(model, ids[:, :prefill_len])
            out.append(first)
        else:
            state = empty_state(model, B)
        for t in range(prefill_len, T):
            out.append(step(model, state, host[:, t])[:, None, :])
    return xp.concatenate(out, axis=1)


def _host(a: Array) -> np.ndarray:
    return np.asarray(a.get() if hasattr(a, "get") else a, np.float64)


class _FullContext:
    """Today's generation, for comparison: every byte reruns ``bdh.logits`` on the row's last
    ``context`` bytes (weights quantized again each call)."""

    def __init__(self, config: Any, params: dict[str, Array], prompts: list[bytes],
                 context: int | None):
        self.config, self.params, self.context = config, params, context
        self.seqs = [list(p) for p in prompts]
        self.xp = _backend.array_module(params["embed"])

    def last(self, rows: list[int]) -> np.ndarray:
        from . import logits

        out = []
        for r in rows:
            window = self.seqs[r][-self.context:] if self.context else self.seqs[r]
            ids = self.xp.asarray(np.asarray(window, np.int64)[None, :])
            out.append(_host(logits(self.config, self.params, ids)[0, -1]))
        return np.stack(out)


def stream(config: Any, params: dict[str, Array], prompts: list[bytes], n: int,
           temperature: float, top_k: int | None, top_p: float | None, seed: int,
           stop: frozenset, single: bool, recurrent: bool, context: int | None) -> Iterator:
    """The generator behind ``generate_stream`` (arguments validated)."""
    if n == 0:
        return
    rng = np.random.default_rng(seed)
    B = len(prompts)
    alive = np.arange(B)  # the sequences still running, in order (rows of the state)
    if recurrent:
        model = Model(config, params)
        xp = model.xp
        with blas_guard(model.embed):
            parts = [prefill(model, xp.asarray(np.frombuffer(p, np.uint8).astype(np.int64)[None]))
                     for p in prompts]
        state = State.stack([s for s, _ in parts], xp)
        last = np.stack([_host(lg[0, -1]) for _, lg in parts])
    else:
        full = _FullContext(config, params, prompts, context)
        last = full.last(list(range(B)))
    for i in range(n):
        new = [b""] * B
        keep, tokens = [], []
        for row, b in enumerate(alive):
            t = sample(last[row], temperature, top_k, top_p, rng)
            if t not in stop:
                new[b] = bytes((t,))
                keep.append(row)
                tokens.append(t)
        if single:
            if not keep:
                return
            yield new[0]
        else:
            yield tuple(new)
            if not keep:
                return
        if i == n - 1:
            return
        rows = np.asarray(keep, np.int64)
        alive = alive[rows]
        if recurrent:
            state = state.rows(rows)
            with blas_guard(model.embed):
                last = _host(step(model, state, np.asarray(tokens, np.int64)))
        else:
            for b, t in zip(alive, tokens):
                full.seqs[b].append(t)
            last = full.last(alive.tolist())
