"""Reference BitNet b1.58 language model (transformers' ``BitNetForCausalLM``): float64, one
sequence, the whole causal forward with no cache.

Written from transformers' equations (``modeling_bitnet.py`` and ``integrations/bitnet.py``):

- layer: ``h = x + o_proj(attn_sub_norm(attention(input_layernorm(x))))``, then
  ``out = h + down_proj(ffn_sub_norm(act(gate_proj(h)) * up_proj(h)))`` (act: relu2 is
  ``relu(g) ** 2``); after the last layer ``model.norm`` then ``lm_head``;
- RMSNorm ``w * x / sqrt(mean(x^2) + eps)``; rotary half-split (``rotate_half``) with
  ``inv_freq = theta ** (-arange(0, d, 2) / d)``; attention scale ``head_dim ** -0.5``; key/value
  head ``h`` serves query heads ``h*g .. h*g+g-1``;
- every projection quantizes its input per token: ``s = 127 / max(|x|, 1e-5)``,
  ``q = clip(round(x * s), -128, 127)``, ``y = (q @ W) / s`` with ``W`` the ternary weight
  times its scale.

Checked against: ``lowbit/models/bitnet`` (every backend) in ``tests/test_bitnet.py``.
"""

import math

import numpy as np


def _acts():
    erf = np.vectorize(math.erf)

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    return {
        "relu2": lambda x: np.maximum(x, 0) ** 2,
        "relu": lambda x: np.maximum(x, 0),
        "silu": lambda x: x / (1 + np.exp(-x)),
        "swish": lambda x: x / (1 + np.exp(-x)),
        "gelu": lambda x: 0.5 * x * (1 + erf(x / math.sqrt(2))),
        "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh,
        "gelu_fast": lambda x: 0.5 * x * (1 + np.tanh(x * 0.7978845608 * (1 + 0.044715 * x * x))),
        "quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
        "tanh": np.tanh,
        "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
        "relu6": lambda x: np.clip(x, 0, 6),
        "leaky_relu": lambda x: np.where(x >= 0, x, 0.01 * x),
        "mish": lambda x: x * np.tanh(np.log1p(np.exp(x))),
    }


ACT_REF = _acts()


def rms_norm_ref(x, w, eps):
    x = np.asarray(x, np.float64)
    return np.asarray(w, np.float64) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def bitlinear_ref(x, w):
    """``x`` [T, in] through a ternary weight ``w`` [out, in] (codes times scale, float64)."""
    s = 127.0 / np.maximum(np.abs(x).max(-1, keepdims=True), 1e-5)
    q = np.clip(np.round(x * s), -128, 127)
    return (q @ np.asarray(w, np.float64).T) / s


def rotary_half_ref(x, positions, theta):
    """``x`` [T, heads, d] rotated by position (transformers' ``rotate_half`` form)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    freqs = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(emb) + rot * np.sin(emb)


def attention_ref(q, k, v):
    """Causal attention of one sequence: q [T, H, d], k and v [T, Hkv, d] -> [T, H, d]."""
    T, H, d = q.shape
    g = H // k.shape[1]
    out = np.empty_like(q)
    mask = np.tril(np.ones((T, T), dtype=bool))
    for h in range(H):
        s = q[:, h] @ k[:, h // g].T / math.sqrt(d)
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // g]
    return out


def bitnet_ref(cfg, w, ids, positions=None):
    """Logits [T, vocab] float64 of one sequence.

    Args:
        cfg: a mapping or object with transformers' config fields (``hidden_size``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
            ``rope_theta``, ``num_hidden_layers``, ``hidden_act``).
        w: name -> float64 array in transformers' layout (``[out, in]`` for projections, the
            ternary codes times their scale) under transformers' tensor names without
            ``.weight``; ``lm_head`` may be absent (tied to ``model.embed_tokens``).
        ids: int [T] token ids.
        positions: int [T] (default ``arange(T)``).
    """
    get = (lambda n: cfg[n]) if isinstance(cfg, dict) else (lambda n: getattr(cfg, n))
    H, Hkv, d = get("num_attention_heads"), get("num_key_value_heads"), get("head_dim")
    eps, theta, act = get("rms_norm_eps"), get("rope_theta"), ACT_REF[get("hidden_act")]
    ids = np.asarray(ids)
    T = len(ids)
    positions = np.arange(T) if positions is None else np.asarray(positions)
    x = np.asarray(w["model.embed_tokens"], np.float64)[ids]
    for n in range(get("num_hidden_layers")):
        p = f"model.layers.{n}."
        h = rms_norm_ref(x, w[p + "input_layernorm"], eps)
        q = bitlinear_ref(h, w[p + "self_attn.q_proj"]).reshape(T, H, d)
        k = bitlinear_ref(h, w[p + "self_attn.k_proj"]).reshape(T, Hkv, d)
        v = bitlinear_ref(h, w[p + "self_attn.v_proj"]).reshape(T, Hkv, d)
        q, k = rotary_half_ref(q, positions, theta), rotary_half_ref(k, positions, theta)
        a = rms_norm_ref(attention_ref(q, k, v).reshape(T, H * d), w[p + "self_attn.attn_sub_norm"],
                         eps)
        x = x + bitlinear_ref(a, w[p + "self_attn.o_proj"])
        h = rms_norm_ref(x, w[p + "post_attention_layernorm"], eps)
        m = act(bitlinear_ref(h, w[p + "mlp.gate_proj"])) * bitlinear_ref(h, w[p + "mlp.up_proj"])
        x = x + bitlinear_ref(rms_norm_ref(m, w[p + "mlp.ffn_sub_norm"], eps),
                              w[p + "mlp.down_proj"])
    x = rms_norm_ref(x, w["model.norm"], eps)
    head = w.get("lm_head", w["model.embed_tokens"])
    return x @ np.asarray(head, np.float64).T
