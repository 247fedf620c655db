"""pathwaycom/bdh's torch state dict to lowbit's BDH parameters and back
(``lowbit/models/bdh/_torch.py``): the round trip, the keys and shapes it rejects, and the
converted model's logits against a float64 transcription of pathwaycom's forward in
pathwaycom's own layout (torch is not needed: the state dict is plain arrays)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close

from lowbit.models import bdh

SMALL = dict(n_layer=2, n_embd=16, n_head=2, mlp_internal_dim_multiplier=4, vocab_size=32,
             dropout=0.0)


def _state_dict(config, seed=0):
    """A state dict as pathwaycom's ``BDH.state_dict()`` holds it (shapes from its __init__),
    with its rotary buffers and the unused ``lm_gate``, drawn independently of lowbit."""
    rng = np.random.default_rng(seed)
    D, H, V = config.n_embd, config.n_head, config.vocab_size
    N = config.mlp_internal_dim_multiplier * D // H
    sd = {"decoder": rng.normal(0, 0.5, (H * N, D)), "encoder": rng.normal(0, 0.5, (H, D, N)),
          "encoder_v": rng.normal(0, 0.5, (H, D, N)), "embed.weight": rng.normal(0, 1, (V, D)),
          "lm_head": rng.normal(0, 0.5, (D, V)), "lm_gate": rng.normal(0, 0.02, (D, 1))}
    sd.update({f"attns.{i}.freqs": np.zeros((1, 1, 1, N)) for i in range(config.n_layer)})
    return {k: v.astype(np.float32) for k, v in sd.items()}


class FakeTensor:
    """Stands for a torch tensor: ``detach().cpu().numpy()`` and no ``__array__``."""

    def __init__(self, a):
        self.a = a

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.a


def _ln(x):
    m = x.mean(-1, keepdims=True)
    return (x - m) / np.sqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def _pathway_logits(sd, ids, n_layer):
    """pathwaycom/bdh's forward transcribed in float64 with its tensor layout: x [B, 1, T, D],
    ``x @ encoder`` [B, nh, T, N], its rope (per-element frequencies theta^(-2 floor(n/2) / N)
    as phases in turns, ``v_rot`` interleaved), ``tril(-1)`` scores, the decoder applied to
    ``xy.transpose(1, 2).reshape(B, 1, T, N * nh)``, ``logits = x @ lm_head``."""
    p = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    nh, D, N = p["encoder"].shape
    B, T = ids.shape
    n = np.arange(N)
    freqs = 1.0 / (2.0**16) ** ((n // 2 * 2) / N) / (2 * np.pi)
    phases = (np.arange(T)[:, None] * freqs[None, :]) % 1 * (2 * np.pi)  # [T, N]
    x = _ln(p["embed.weight"][ids][:, None])  # B, 1, T, D
    for _ in range(n_layer):
        xs = np.maximum(x @ p["encoder"], 0)  # B, nh, T, N
        rot = np.stack((-xs[..., 1::2], xs[..., ::2]), axis=-1).reshape(xs.shape)
        qr = xs * np.cos(phases) + rot * np.sin(phases)
        scores = np.tril(qr @ np.swapaxes(qr, -1, -2), -1)
        ykv = _ln(scores @ x)  # B, nh, T, D
        ys = np.maximum(ykv @ p["encoder_v"], 0)
        xy = (xs * ys).transpose(0, 2, 1, 3).reshape(B, 1, T, N * nh)
        x = _ln(x + _ln(xy @ p["decoder"]))
    return x.reshape(B, T, D) @ p["lm_head"]


def test_converted_params_give_pathways_logits(rng):
    config = bdh.BDHConfig(**SMALL)
    sd = _state_dict(config)
    params = bdh.from_torch_state_dict(sd, config)
    ids = rng.integers(0, config.vocab_size, size=(2, 12))
    assert_close("logits", _pathway_logits(sd, ids, config.n_layer),
                 bdh.logits(config, params, ids), 1e-5)


def test_round_trip_and_config_inference():
    config = bdh.BDHConfig(**SMALL)
    sd = _state_dict(config)
    params = bdh.from_torch_state_dict(sd)
    assert set(params) == set(bdh.PARAMS)
    for name, shape in config.shapes().items():
        assert params[name].dtype == np.float32 and params[name].shape == shape
        assert params[name].flags.c_contiguous
    back = bdh.to_torch_state_dict(params)
    assert set(back) == {"embed.weight", "encoder", "encoder_v", "decoder", "lm_head"}
    for key, value in back.items():
        np.testing.assert_array_equal(value, sd[key])
    again = bdh.from_torch_state_dict(back, config)
    for name in bdh.PARAMS:
        np.testing.assert_array_equal(again[name], params[name])
    got = bdh.infer_torch_config(sd, bdh.BDHConfig(n_layer=3, n_embd=8, dropout=0.2))
    assert (got.n_embd, got.n_head, got.mlp_internal_dim_multiplier, got.vocab_size) == (
        16, 2, 4, 32) and got.n_layer == 3 and got.dropout == 0.2


def test_tensor_like_values_and_compiled_prefix():
    config = bdh.BDHConfig(**SMALL)
    sd = _state_dict(config)
    wrapped = {"_orig_mod." + k: (FakeTensor(v) if i % 2 else v.astype(np.float64))
               for i, (k, v) in enumerate(sd.items())}
    params = bdh.from_torch_state_dict(wrapped, config)
    np.testing.assert_array_equal(params["embed"], sd["embed.weight"])
    np.testing.assert_array_equal(params["decoder"], sd["decoder"])
    # The result is a copy: changing it leaves the caller's arrays alone.
    params["lm_head"][:] = 0
    assert sd["lm_head"].any()


@pytest.mark.parametrize("change,error,word", [
    (lambda sd: sd.pop("encoder_v"), ValueError, "'encoder_v'"),
    (lambda sd: sd.pop("embed.weight"), ValueError, "'embed.weight'"),
    (lambda sd: sd.update(extra=np.zeros(3, np.float32)), ValueError, "'extra'"),
    (lambda sd: sd.update(decoder=sd["decoder"][:-1]), ValueError, "'decoder'"),
    (lambda sd: sd.update(lm_head=sd["lm_head"].T), ValueError, "'lm_head'"),
    (lambda sd: sd.update(encoder=sd["encoder"][:, :-1]), ValueError, "'encoder'"),
    (lambda sd: sd.update(encoder_v=sd["encoder_v"].astype(np.int32)), TypeError, "'encoder_v'"),
])
def test_bad_state_dicts_name_the_key(change, error, word):
    sd = _state_dict(bdh.BDHConfig(**SMALL))
    change(sd)
    with pytest.raises(error, match=word):
        bdh.from_torch_state_dict(sd)


def test_a_state_dict_of_another_config_names_the_key():
    sd = _state_dict(bdh.BDHConfig(**SMALL))
    with pytest.raises(ValueError, match="'embed.weight'.*config"):
        bdh.from_torch_state_dict(sd, bdh.BDHConfig(**dict(SMALL, vocab_size=64)))
    with pytest.raises(ValueError, match="'encoder'"):
        bdh.from_torch_state_dict(sd, bdh.BDHConfig(**dict(SMALL, mlp_internal_dim_multiplier=8)))
    with pytest.raises(TypeError, match="state_dict"):
        bdh.from_torch_state_dict([("encoder", sd["encoder"])])
    with pytest.raises(ValueError, match="params"):
        bdh.to_torch_state_dict({"embed": sd["embed.weight"]})
