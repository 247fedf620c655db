"""The BitNet forward pass over a preallocated KV cache, built from public lowbit ops.

Tokens of several sequences are packed along one axis (the segmented layout): sequence ``b``
contributes ``n_b >= 0`` new tokens at positions ``cache.lengths[b] ..``. The projections run
``lowbit.packed_matmul`` on all of them at once (the GEMM for a prefill, the GEMV for a decode
step of one row per sequence); each layer writes its new keys and values into the cache, then
``lowbit.segmented_attention`` attends each sequence's new queries to its cached keys
(``k_lengths``, causal aligned bottom-right), without recomputing them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ... import _backend
from ..._typing import Array
from ...ops.packed_matmul import packed_matmul
from ...ops.rms_norm import rms_norm
from ...ops.rotary import rotary
from ...ops.segmented_attention import segmented_attention
from ._config import BitNetConfig
from ._head import embed, head_logits
from ._params import fused_view


@dataclasses.dataclass
class KVCache:
    """Keys and values of ``batch`` sequences, per layer, with room for ``capacity`` positions.

    Attributes:
        k, v: per layer, [batch * capacity, num_key_value_heads, head_dim] float32; sequence
            ``b``'s position ``t`` is row ``b * capacity + t`` (its rows are contiguous).
        lengths: int64 [batch] host array, the positions held per sequence.
        capacity: positions per sequence; grows (doubling, up to the config's
            ``max_position_embeddings``) when a forward needs more.
    """

    k: list
    v: list
    lengths: np.ndarray
    capacity: int

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v))


def new_cache(config: BitNetConfig, batch: int = 1, capacity: int = 256, *,
              xp=np) -> KVCache:
    """An empty ``KVCache`` for ``batch`` sequences (numpy, or ``xp=cupy``)."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    capacity = min(int(capacity), config.max_position_embeddings)
    shape = (int(batch) * capacity, config.num_key_value_heads, config.head_dim)
    L = config.num_hidden_layers
    return KVCache([xp.zeros(shape, xp.float32) for _ in range(L)],
                   [xp.zeros(shape, xp.float32) for _ in range(L)],
                   np.zeros(int(batch), np.int64), capacity)


def _reserve(config: BitNetConfig, cache: KVCache, needed: int) -> None:
    """Grow ``cache`` in place so that every sequence has room for ``needed`` positions."""
    if needed > config.max_position_embeddings:
        raise ValueError(f"the sequence would reach {needed} positions, past the model's "
                         f"max_position_embeddings = {config.max_position_embeddings}")
    if needed <= cache.capacity:
        return
    new = min(config.max_position_embeddings, max(needed, 2 * cache.capacity))
    B, old = cache.batch, cache.capacity
    for arrays in (cache.k, cache.v):
        for i, a in enumerate(arrays):
            xp = _backend.array_module(a)
            grown = xp.zeros((B * new,) + a.shape[1:], a.dtype)
            grown.reshape(B, new, *a.shape[1:])[:, :old] = a.reshape(B, old, *a.shape[1:])
            arrays[i] = grown
    cache.capacity = new


def _activation(name: str, g: Array, xp) -> Array:
    if name == "relu2":
        r = xp.maximum(g, 0)
        return r * r
    if name == "relu":
        return xp.maximum(g, 0)
    if name in ("silu", "swish"):
        return g / (1 + xp.exp(-g))
    if name == "gelu":
        erf = _erf(xp)
        return 0.5 * g * (1 + erf(g * np.float32(1 / math.sqrt(2))))
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        c = np.float32(math.sqrt(2 / math.pi))
        return 0.5 * g * (1 + xp.tanh(c * (g + np.float32(0.044715) * g * g * g)))
    if name == "gelu_fast":
        return 0.5 * g * (1 + xp.tanh(g * np.float32(0.7978845608) *
                                      (1 + np.float32(0.044715) * g * g)))
    if name == "quick_gelu":
        return g / (1 + xp.exp(np.float32(-1.702) * g))
    if name == "tanh":
        return xp.tanh(g)
    if name == "sigmoid":
        return 1 / (1 + xp.exp(-g))
    if name == "relu6":
        return xp.clip(g, 0, 6)
    if name == "leaky_relu":
        return xp.where(g >= 0, g, np.float32(0.01) * g)
    if name == "mish":
        return g * xp.tanh(xp.logaddexp(g, np.float32(0)))
    raise ValueError(f"unknown hidden_act {name!r}")  # BitNetConfig rules this out


def _erf(xp):
    if xp is np:
        from math import erf
        return np.vectorize(erf, otypes=[np.float32])
    import cupyx.scipy.special as special
    return special.erf


def _attention_plan(cache: KVCache, counts: np.ndarray, starts: np.ndarray):
    """What every layer's ``_attend`` does, worked out once a forward: the cache rows the new
    keys and values go to, ``(sequence offset, cache row, count)``, and the key rows and segments
    the queries attend to."""
    C = cache.capacity
    writes, off = [], 0
    for b, n in enumerate(counts.tolist()):
        if n:
            writes.append((off, b * C + int(starts[b]), n))
            off += n
    ends = (starts + counts).tolist()
    active = np.flatnonzero(counts)
    if len(active) == 1:  # one sequence: its rows are a contiguous view of the cache
        b = int(active[0])
        return writes, slice(b * C, b * C + ends[b]), [int(counts[b])], [ends[b]]
    # Several: each sequence's rows, then the unused rest of its capacity as a segment of no
    # queries, so the whole cache is the key array and nothing is copied.
    lengths, k_lengths = [], []
    for b in range(cache.batch):
        lengths += [int(counts[b]), 0]
        k_lengths += [ends[b], C - ends[b]]
    return writes, slice(None), lengths, k_lengths


def _attend(cache, layer, q, k, v, plan):
    """Write the new keys/values into ``cache`` and attend; q [N, H, d] -> [N, H, d]."""
    writes, keys, lengths, k_lengths = plan
    kc, vc = cache.k[layer], cache.v[layer]
    for off, row, n in writes:
        kc[row:row + n] = k[off:off + n]
        vc[row:row + n] = v[off:off + n]
    return segmented_attention(q, kc[keys], vc[keys], lengths, k_lengths=k_lengths, causal=True)


def _project(h: Array, pws: list) -> list:
    """``h`` through several projections of the same input: one ``packed_matmul`` when their
    weights share a buffer (``fuse_projections``), each output then scaled by its own weight's
    scale (the product the separate calls would form: ``(acc * scale_x) * scale_w``)."""
    fused = fused_view(pws)
    if fused is None:
        return [packed_matmul(h, pw) for pw in pws]
    y = packed_matmul(h, fused)
    outs, col = [], 0
    for pw in pws:
        n = pw.shape[1]
        outs.append(y[:, col:col + n] * pw.scale)
        col += n
    return outs


def run(config: BitNetConfig, params: dict[str, Any], tokens: Array, counts: np.ndarray,
        cache: KVCache, last_only: bool) -> Array:
    """Logits of validated packed ``tokens`` (int64 [N]), ``counts[b]`` new ones per sequence.

    Updates ``cache`` in place (its lengths grow by ``counts``). Returns [N, vocab] float32, or
    [batch, vocab] (each sequence's last new token; rows of sequences with none are garbage)
    when ``last_only``.
    """
    starts = cache.lengths.copy()
    _reserve(config, cache, int((starts + counts).max()))
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
    xp = _backend.array_module(cache.k[0])
    eps, H, Hkv, d = (config.rms_norm_eps, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
    x = embed(tokens, params["model.embed_tokens"])
    N = x.shape[0]
    pos = xp.asarray(positions)
    plan = _attention_plan(cache, counts, starts)
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        h = rms_norm(x, params[p + "input_layernorm"], eps=eps)
        q, k, v = _project(h, [params[p + "self_attn.q_proj"], params[p + "self_attn.k_proj"],
                               params[p + "self_attn.v_proj"]])
        # q and k share their positions: one rotation of both heads' rows
        qk = rotary(xp.concatenate([q, k], axis=1).reshape(N, H + Hkv, d), pos,
                    theta=config.rope_theta, style="half")
        a = _attend(cache, n, qk[:, :H], qk[:, H:], v.reshape(N, Hkv, d), plan).reshape(N, H * d)
        a = rms_norm(a, params[p + "self_attn.attn_sub_norm"], eps=eps)
        x = x + packed_matmul(a, params[p + "self_attn.o_proj"])
        h = rms_norm(x, params[p + "post_attention_layernorm"], eps=eps)
        g, u = _project(h, [params[p + "mlp.gate_proj"], params[p + "mlp.up_proj"]])
        m = rms_norm(_activation(config.hidden_act, g, xp) * u, params[p + "mlp.ffn_sub_norm"],
                     eps=eps)
        x = x + packed_matmul(m, params[p + "mlp.down_proj"])
    cache.lengths += counts
    if last_only:
        x = x[xp.asarray(np.maximum(np.cumsum(counts) - 1, 0))]
    x = rms_norm(x, params["model.norm"], eps=eps)
    return head_logits(x, params.get("lm_head", params["model.embed_tokens"]))
