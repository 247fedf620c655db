"""The BitNet forward pass over a preallocated KV cache, built from public lowbit ops.

Tokens of several sequences are packed along one axis (the segmented layout): sequence ``b``
contributes ``n_b >= 0`` new tokens at positions ``cache.lengths[b] ..``. The projections run
``lowbit.packed_matmul`` on all of them at once (the GEMM for a prefill, the GEMV for a decode
step of one row per sequence); each layer writes its new keys and values into the cache, then
``lowbit.segmented_attention`` attends each sequence's new queries to its cached keys
(``k_lengths``, causal aligned bottom-right), without recomputing them.

The ops are lowbit's own (``rms_norm``, ``packed_matmul``'s int8 activations on ternary codes,
``rotary``, ``segmented_attention``), but a decode step makes about ten of them a layer on
vectors of a few thousand floats, where the public functions' checks cost more than the kernels:
so each backend's module is resolved once a forward (``_Ops``) and called through the backend
contract of ``lowbit.ops`` on what the model has already validated (``check_params`` and the
ids), the same kernels on the same arrays. The fused projection groups, their per-output
scales and the rotary tables are also worked out once a forward, not once a layer.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import numpy as np

from ... import _backend, _dispatch
from ..._typing import Array
from ...ops.quantize import ACT_FORMATS, checked_packed
from ...ops.rotary import _tables as _rotary_tables
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


@dataclasses.dataclass(frozen=True)
class _Ops:
    """The backend modules of the forward's ops, resolved once for the cache's arrays."""

    norm: Any
    quantize: Any
    matmul: Any
    rotary: Any
    attention: Any

    @classmethod
    def of(cls, like: Array) -> "_Ops":
        def module(op):
            return _dispatch.resolve(op, like)[1]
        return cls(module("rms_norm"), module("quantize"), module("packed_matmul"),
                   module("rotary"), module("segmented_attention"))


@dataclasses.dataclass(frozen=True)
class _Projection:
    """One ``packed_matmul`` of ternary rows ``data`` [N, bytes] (the weights of one projection,
    or of a fused group), ``scale`` its float32 output scale (0-d, or [N] for a group: each
    weight's own scale over its columns, the product the separate calls form), ``widths`` the
    group's outputs."""

    data: Array
    scale: Array
    K: int
    widths: tuple


#: The host ``_Projection`` of each group of weights seen: ids of the weights -> (weak references
#: to them, their scales, the projection). An entry goes when the group's first weight does.
_PROJECTIONS: dict[tuple, tuple] = {}


def _projection(params: dict[str, Any], names: list) -> _Projection:
    """The ``_Projection`` of the ternary weights ``names`` of ``params``, made once for host
    weights while they are the same (frozen) objects with the same scales: the fused rows (views
    of the weights' own buffer) and the scale vector still hold. Weights not laid out by
    ``fuse_projections`` are copied side by side every forward (and not kept: a copy would not
    see an in-place edit, and would double their memory)."""
    pws = [params[n] for n in names]
    if not isinstance(pws[0].data, np.ndarray):
        return _make_projection(pws, names)[0]
    key = tuple(map(id, pws))
    scales = tuple(pw.scale.tobytes() for pw in pws)
    hit = _PROJECTIONS.get(key)
    if hit is not None and hit[1] == scales and all(r() is pw for r, pw in zip(hit[0], pws)):
        return hit[2]
    proj, copied = _make_projection(pws, names)
    if not copied:
        _PROJECTIONS[key] = (tuple(weakref.ref(pw) for pw in pws), scales, proj)
        weakref.finalize(pws[0], _PROJECTIONS.pop, key, None)
    return proj


def _make_projection(pws: list, names: list) -> tuple[_Projection, bool]:
    """``(projection, whether its rows are a copy)``, the weights' fields checked first."""
    checked = [checked_packed(pw, f"params[{n!r}]") for pw, n in zip(pws, names)]
    copied = any(c is not pw for c, pw in zip(checked, pws))  # made contiguous
    pws = checked
    fused = fused_view(pws) if len(pws) > 1 else pws[0]
    copied = copied or fused is None
    if fused is None:  # not laid out by fuse_projections: the weights' rows side by side
        xp = _backend.array_module(pws[0].data)
        fused = dataclasses.replace(pws[0], data=xp.concatenate([pw.data for pw in pws]))
    if len(pws) == 1:
        scale = pws[0].scale
    else:
        xp = _backend.array_module(fused.data)
        scale = xp.concatenate([xp.broadcast_to(xp.asarray(pw.scale, xp.float32).reshape(-1),
                                                (pw.shape[1],)) for pw in pws])
    return (_Projection(fused.data, scale, pws[0].shape[0], tuple(pw.shape[1] for pw in pws)),
            copied)


def _layers(config: BitNetConfig, params: dict[str, Any]) -> list:
    """Per layer: its norms' weights and its four projections (q/k/v and gate/up fused)."""
    out = []
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        a, m = p + "self_attn.", p + "mlp."
        out.append((params[p + "input_layernorm"],
                    _projection(params, [a + "q_proj", a + "k_proj", a + "v_proj"]),
                    params[a + "attn_sub_norm"], _projection(params, [a + "o_proj"]),
                    params[p + "post_attention_layernorm"],
                    _projection(params, [m + "gate_proj", m + "up_proj"]),
                    params[m + "ffn_sub_norm"], _projection(params, [m + "down_proj"])))
    return out


# The four ops of a layer, on validated float32 rows (each a module-level function, so that the
# bench can time them one by one).
def rms_norm(ops: _Ops, x: Array, weight: Array, eps: float) -> Array:
    return ops.norm.forward(x, weight, eps)[0]


def packed_matmul(ops: _Ops, x: Array, proj: _Projection) -> Array:
    """``lowbit.packed_matmul(x, pw)`` with int8 activations: [M, sum(widths)] float32."""
    codes, scale = ops.quantize.row_codes(x, ACT_FORMATS["int8"])
    return ops.matmul.matmul_int(codes, scale, proj.data, proj.scale, "ternary", proj.K)


def rotary(ops: _Ops, x: Array, tables: tuple) -> Array:
    return ops.rotary.forward(x, tables[0], tables[1], False)


def segmented_attention(ops: _Ops, q: Array, k: Array, v: Array, offsets, scale: float) -> Array:
    return ops.attention.forward(q, k, v, offsets[0], offsets[1], scale, True)[0]


def _attend(ops, cache, layer, q, k, v, plan, scale):
    """Write the new keys/values into ``cache`` and attend; q [N, H, d] -> [N, H, d]."""
    writes, keys, offsets = plan
    kc, vc = cache.k[layer], cache.v[layer]
    for off, row, n in writes:
        kc[row:row + n] = k[off:off + n]
        vc[row:row + n] = v[off:off + n]
    return segmented_attention(ops, q, kc[keys], vc[keys], offsets, scale)


def _split(y: Array, widths: tuple) -> list:
    outs, col = [], 0
    for n in widths:
        outs.append(y[:, col:col + n])
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
    ops = _Ops.of(cache.k[0])
    layers = _layers(config, params)  # every weight checked before any kernel runs
    eps, H, Hkv, d = (config.rms_norm_eps, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
    x = embed(tokens, params["model.embed_tokens"])
    N = x.shape[0]
    tables = _rotary_tables(positions if xp is np else xp.asarray(positions), d,
                           config.rope_theta, np.float32)
    writes, keys, lengths, k_lengths = _attention_plan(cache, counts, starts)
    offsets = (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
               np.concatenate([[0], np.cumsum(k_lengths)]).astype(np.int64))
    plan = writes, keys, offsets
    scale = d ** -0.5
    for n, (norm_in, qkv, norm_attn, o, norm_post, gate_up, norm_ffn, down) in enumerate(layers):
        h = rms_norm(ops, x, norm_in, eps)
        y = packed_matmul(ops, h, qkv)
        # q and k share their positions: one rotation of both heads' rows
        qk = rotary(ops, xp.ascontiguousarray(y[:, :(H + Hkv) * d]).reshape(N, H + Hkv, d),
                    tables)
        a = _attend(ops, cache, n, xp.ascontiguousarray(qk[:, :H]), qk[:, H:],
                    y[:, (H + Hkv) * d:].reshape(N, Hkv, d), plan, scale)
        a = rms_norm(ops, a.reshape(N, H * d), norm_attn, eps)
        x = x + packed_matmul(ops, a, o)
        h = rms_norm(ops, x, norm_post, eps)
        g, u = _split(packed_matmul(ops, h, gate_up), gate_up.widths)
        m = rms_norm(ops, xp.ascontiguousarray(_activation(config.hidden_act, g, xp) * u),
                     norm_ffn, eps)
        x = x + packed_matmul(ops, m, down)
    cache.lengths += counts
    if last_only:
        x = x[xp.asarray(np.maximum(np.cumsum(counts) - 1, 0))]
    x = rms_norm(ops, xp.ascontiguousarray(x), params["model.norm"], eps)
    return head_logits(x, params.get("lm_head", params["model.embed_tokens"]))
