"""Tests of BitNet b1.58 inference (``lowbit/models/bitnet``) on tiny random models.

Oracle: the float64 model of ``reference/bitnet.py`` (transformers' equations), fed the same
ternary codes, scales, norms and 16-bit embedding. The kernels compute in float32 and round the
activations to int8 codes, so a code can fall on the other side of a rounding boundary than in
float64: logits are compared with a tolerance of a few such flips, greedy continuations up to
the first step where the reference's top two logits are closer than that tolerance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lowbit import PackedWeight
from lowbit.models import bitnet
from lowbit.models.bitnet import BitNetConfig, Dense
from lowbit.reference.bitnet import bitnet_ref
from lowbit.reference.quantize import unpack_weight_ref

from helpers import assert_close, to_numpy

TINY = BitNetConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=96,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))
#: Logits tolerance (relative RMS error, and max error over the largest logit) when int8
#: activation codes may flip: one flip in a layer's input moves these tiny models' logits by
#: about 3e-3 (measured); without a flip they agree to 3e-7.
RTOL = 1e-2
#: The tolerance without a flip: most draws have none (``test_forward_matches_reference``).
EXACT = 1e-5


def _sim(backend):
    """cudasim runs each kernel launch in ~0.1 s: its cases use one layer and fewer steps."""
    return backend.name == "cudasim"


def _config(backend):
    return dataclasses.replace(TINY, num_hidden_layers=1) if _sim(backend) else TINY


def ref_weights(params):
    """The params as float64 arrays in transformers' layout, decoded independently."""
    out = {}
    for name, v in params.items():
        if isinstance(v, PackedWeight):
            codes = unpack_weight_ref(to_numpy(v.data), v.format, v.shape[0])  # [K, N]
            out[name] = (codes * to_numpy(v.scale).astype(np.float64)).T
        elif isinstance(v, Dense):
            data = to_numpy(v.data)
            if v.dtype == "bfloat16":
                wide = np.zeros(data.shape + (2,), np.uint16)
                wide[..., 1] = data  # little-endian: the bf16 bits are the high half
                out[name] = wide.view(np.float32)[..., 0].astype(np.float64)
            else:
                out[name] = data.astype(np.float64)
        else:
            out[name] = to_numpy(v).astype(np.float64)
    return out


def _model(config=TINY, seed=0, **kw):
    return bitnet.random_params(config, seed=seed, **kw)


def _to(backend, params):
    return {k: (dataclasses.replace(v, data=backend.to(v.data), scale=backend.to(v.scale))
                if isinstance(v, PackedWeight) else
                dataclasses.replace(v, data=backend.to(v.data)) if isinstance(v, Dense) else
                backend.to(v)) for k, v in params.items()}


def _greedy_ref(config, w, prompt, n, tol):
    """Greedy continuation by the reference, cut where its top two logits are within tol."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        logits = bitnet_ref(config, w, ids)[-1]
        top = np.sort(logits)[-2:]
        if top[1] - top[0] <= tol:
            break
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
    return out


def _rel_rms(ref, out):
    return float(np.sqrt(np.mean((to_numpy(out) - ref) ** 2) / np.mean(ref ** 2)))


def test_forward_matches_reference(backend, rng):
    errors = []
    config = _config(backend)
    for seed in range(4):
        params = _model(config, seed=seed)
        ids = rng.integers(0, TINY.vocab_size, 11)
        ref = bitnet_ref(config, ref_weights(params), ids)
        logits, cache = bitnet.forward(config, _to(backend, params), ids)
        assert_close("logits", ref, logits, RTOL)
        assert to_numpy(logits).dtype == np.float32 and cache.lengths.tolist() == [11]
        errors.append(_rel_rms(ref, logits))
    # an int8 code on the other side of a rounding boundary is rare: most draws agree to
    # float32 rounding, which a wrong formula (not a flip) could not
    assert sorted(errors)[2] <= EXACT, errors


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
def test_activations(act, rng):
    config = dataclasses.replace(TINY, hidden_act=act)
    params = _model(config, seed=3)
    ids = rng.integers(0, TINY.vocab_size, 6)
    ref = bitnet_ref(config, ref_weights(params), ids)
    assert_close(f"logits ({act})", ref, bitnet.forward(config, params, ids)[0], RTOL)


def test_untied_head_and_dense_dtypes(rng):
    config = dataclasses.replace(TINY, tie_word_embeddings=False)
    for dtype in ("float32", "float16", "bfloat16"):
        params = _model(config, seed=5, dense_dtype=dtype)
        ids = rng.integers(0, TINY.vocab_size, 5)
        ref = bitnet_ref(config, ref_weights(params), ids)
        assert_close(f"logits ({dtype})", ref, bitnet.forward(config, params, ids)[0], RTOL)


def test_cache_decode_equals_full_forward(backend, rng):
    config = _config(backend)
    params = _to(backend, _model(config, seed=1))
    T = 32 if _sim(backend) else 40
    ids = rng.integers(0, TINY.vocab_size, T)
    full, _ = bitnet.forward(config, params, ids)
    cache = bitnet.new_cache(config, 1, capacity=8, xp=backend.xp)  # grows twice on the way
    parts = [bitnet.forward(config, params, ids[:17], cache)[0]]
    parts.append(bitnet.forward(config, params, ids[17:30], cache)[0])  # chunked prefill
    for t in range(30, T):
        last, cache = bitnet.forward(config, params, ids[t:t + 1], cache, logits="last")
        parts.append(last[None])
    assert cache.lengths.tolist() == [T] and cache.capacity >= T
    assert_close("cached logits", to_numpy(full), np.concatenate([to_numpy(p) for p in parts]),
                 1e-5)


def test_batch_forward_equals_one_at_a_time(backend, rng):
    config = _config(backend)
    params = _to(backend, _model(config, seed=2))
    ids = rng.integers(0, TINY.vocab_size, (2 if _sim(backend) else 3, 9))
    both, cache = bitnet.forward(config, params, ids)
    step, _ = bitnet.forward(config, params, ids[:, :1], cache, logits="last")
    for b in range(len(ids)):
        one, c1 = bitnet.forward(config, params, ids[b])
        assert_close(f"sequence {b}", to_numpy(one), to_numpy(both[b]), 1e-5)
        nxt, _ = bitnet.forward(config, params, ids[b, :1], c1, logits="last")
        assert_close(f"sequence {b} step", to_numpy(nxt), to_numpy(step[b]), 1e-5)


def test_greedy_generation_matches_reference(backend, rng):
    config = _config(backend)
    params = _model(config, seed=4)
    prompt = rng.integers(0, TINY.vocab_size, 7)
    w = ref_weights(params)
    scale = np.abs(bitnet_ref(config, w, prompt)).max()
    n = 5 if _sim(backend) else 12
    want = _greedy_ref(config, w, prompt, n, RTOL * scale)
    assert len(want) >= 4, "the reference's top two logits tie too soon for a useful test"
    got = list(bitnet.generate(config, _to(backend, params), prompt, n, temperature=0,
                               stop=()))
    assert got[:len(want)] == want


def test_several_prompts_decode_together(backend, rng):
    config = _config(backend)
    params = _to(backend, _model(config, seed=6))
    prompts = [rng.integers(0, TINY.vocab_size, n) for n in (5, 12, 1)]
    n = 2 if _sim(backend) else 6
    alone = [list(bitnet.generate(config, params, p, n, temperature=0, stop=()))
             for p in prompts]
    steps = list(bitnet.generate(config, params, prompts, n, temperature=0, stop=()))
    assert np.array(steps).T.tolist() == alone


def test_stop_and_sampling(rng):
    params = _model(seed=7)
    prompt = rng.integers(0, TINY.vocab_size, 4)
    greedy = list(bitnet.generate(TINY, params, prompt, 8, temperature=0, stop=()))
    cut = list(bitnet.generate(TINY, params, prompt, 8, temperature=0, stop=[greedy[3]]))
    assert cut == greedy[:greedy.index(greedy[3])]
    a = list(bitnet.generate(TINY, params, prompt, 8, seed=11, top_k=5, top_p=0.9, stop=()))
    b = list(bitnet.generate(TINY, params, prompt, 8, seed=11, top_k=5, top_p=0.9, stop=()))
    assert a == b and len(a) == 8
    # top_k=1 is greedy whatever the temperature
    assert list(bitnet.generate(TINY, params, prompt, 8, temperature=5.0, top_k=1,
                                stop=())) == greedy


def test_sample_distribution():
    from lowbit.models.bitnet._generate import sample
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    draws = np.bincount([sample(logits, 1.0, None, None, rng) for _ in range(4000)], minlength=4)
    assert np.allclose(draws / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    # top_p = 0.7: the smallest set reaching 0.7 is {0, 1}, renormalized to 0.625 / 0.375
    draws = np.bincount([sample(logits, 1.0, None, 0.7, rng) for _ in range(4000)], minlength=4)
    assert draws[2:].sum() == 0 and abs(draws[0] / 4000 - 0.625) < 0.03


def test_fused_projections_equal_separate(rng):
    """random_params (as load) lays q/k/v and gate/up out in one buffer each, which the forward
    multiplies in one call; separate copies of the same weights give the same logits."""
    from lowbit.models.bitnet._params import FUSED, fused_view
    params = _model(seed=12)
    names = [[f"model.layers.0.{g}" for g in group] for group in FUSED]
    assert all(fused_view([params[n] for n in group]) is not None for group in names)
    apart = {k: (dataclasses.replace(v, data=v.data.copy()) if isinstance(v, PackedWeight)
                 else v) for k, v in params.items()}
    assert fused_view([apart[n] for n in names[0]]) is None
    ids = rng.integers(0, TINY.vocab_size, 7)
    full, cache = bitnet.forward(TINY, params, ids)
    assert_close("fused prefill", bitnet.forward(TINY, apart, ids)[0], full, 1e-6)
    _, c2 = bitnet.forward(TINY, apart, ids)
    assert_close("fused decode", bitnet.forward(TINY, apart, [3], c2)[0],
                 bitnet.forward(TINY, params, [3], cache)[0], 1e-6)


def test_int8_head(rng):
    params = _model(seed=8)
    ids = rng.integers(0, TINY.vocab_size, 6)
    q = bitnet.quantize_head(TINY, params)
    assert q["lm_head"].format == "int8" and "lm_head" not in params
    w = ref_weights(params)
    w["lm_head"] = ref_weights({"h": q["lm_head"]})["h"]
    assert_close("int8-head logits", bitnet_ref(TINY, w, ids), bitnet.forward(TINY, q, ids)[0],
                 RTOL)
    # the int8 head is within its rounding bound of the 16-bit one
    full = bitnet_ref(TINY, ref_weights(params), ids)
    assert np.abs(bitnet_ref(TINY, w, ids) - full).max() < 0.02 * np.abs(full).max()


def test_bfloat16_rounding():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -3.3e38, 1e-40], np.float32)
    bits = Dense.from_float(x[None], "bfloat16").data[0]
    got = Dense(bits[None], "bfloat16").float32()[0]
    # ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and goes to 1
    want = np.array([1.0, 1.0, 1 + 2**-6, 1.0], np.float32)
    assert got[:4].tolist() == want.tolist()
    assert abs(got[4] / x[4] - 1) < 2**-8 and abs(got[5] - x[5]) < 1e-41


def test_bad_inputs(rng):
    params = _model(seed=9)
    with pytest.raises(TypeError, match="ids"):
        bitnet.forward(TINY, params, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bitnet.forward(TINY, params, np.array([0, 97]))
    with pytest.raises(ValueError, match="ids must be"):
        bitnet.forward(TINY, params, np.zeros((1, 0), np.int64))
    _, cache = bitnet.forward(TINY, params, np.array([3, 4]))
    with pytest.raises(ValueError, match="cache holds 1"):
        bitnet.forward(TINY, params, np.zeros((2, 1), np.int64), cache)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        bitnet.forward(TINY, params, np.zeros(97, np.int64))
    with pytest.raises(ValueError, match="missing tensor"):
        bitnet.forward(TINY, {k: v for k, v in params.items() if k != "model.norm"}, [1])
    with pytest.raises(ValueError, match="logits"):
        bitnet.forward(TINY, params, [1], logits="first")
    for kw, match in (({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k"),
                      ({"top_p": 1.5}, "top_p"), ({"seed": 1.5}, "seed")):
        with pytest.raises((TypeError, ValueError), match=match):
            bitnet.generate(TINY, params, [1, 2], 3, **kw)
    with pytest.raises(ValueError, match="max_new_tokens"):
        bitnet.generate(TINY, params, [1, 2], -1)
    with pytest.raises(ValueError, match="stop"):
        bitnet.generate(TINY, params, [1, 2], 3, stop=[500])
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(TINY, head_dim=15)
    with pytest.raises(ValueError, match="hidden_act"):
        dataclasses.replace(TINY, hidden_act="relu3")


def test_prepared_weights_follow_the_params(rng):
    """The forward keeps each fused group's prepared rows and scales between calls: a weight
    replaced in the dict, a scale or codes edited in place, all show in the next call."""
    params = _model(seed=13)
    ids = rng.integers(0, TINY.vocab_size, 6)
    bitnet.forward(TINY, params, ids)  # the groups prepared
    q, up = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"
    params[q].scale[...] = params[q].scale * 3  # a 0-d scale of a fused group, in place
    params[up].data[:5] = params[up].data[5:10]  # codes of a fused group, in place
    k = "model.layers.1.self_attn.k_proj"  # a new object in the dict: its own rows
    params[k] = dataclasses.replace(params[k], data=params[k].data[::-1].copy())
    ref = bitnet_ref(TINY, ref_weights(params), ids)
    assert_close("edited logits", ref, bitnet.forward(TINY, params, ids)[0], RTOL)


def test_malformed_packed_weight_is_refused(never_runs):
    params = _model(seed=14)
    name = "model.layers.1.mlp.down_proj"
    params[name] = dataclasses.replace(params[name], data=params[name].data[:-1])
    with pytest.raises(ValueError, match=r"params\['model.layers.1.mlp.down_proj'\].data"):
        bitnet.forward(TINY, params, [1, 2])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int8"])
def test_head_logits_every_dtype(rng, dtype):
    """The output head on numba (its row GEMV below ``F32_GEMV_ROWS`` rows, the blocked BLAS
    path from there) and numpy against float64 products of the decoded head: hidden sizes
    below, at and past the GEMV's 16-element step, float16 subnormals, 1 to 96 rows."""
    import lowbit
    from lowbit.models.bitnet import _head
    from lowbit.ops.packed_matmul._numba import F32_GEMV_ROWS

    for K in (1, 15, 16, 63, 200):
        w = (rng.standard_normal((37, K)) * 0.05).astype(np.float32)
        w[0, :] = 3e-6  # subnormal in float16, exactly widened
        head = (Dense.from_float(w, dtype) if dtype != "int8"
                else _head.quantize_head(Dense(w, "float32")))
        decoded = (head.float32().astype(np.float64) if dtype != "int8" else
                   head.data.astype(np.float64) * head.scale.astype(np.float64)[:, None])
        for M in (1, 3, F32_GEMV_ROWS - 1, F32_GEMV_ROWS):
            x = rng.standard_normal((M, K)).astype(np.float32)
            for backend in ("numba", "numpy"):
                with lowbit.use_backend(backend):
                    got = _head.head_logits(x, head)
                assert_close(f"{dtype} K={K} M={M} {backend}", x.astype(np.float64) @ decoded.T,
                             got, 1e-5)
