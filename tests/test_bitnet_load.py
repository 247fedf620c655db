"""BitNet model files (``lowbit/models/bitnet/_load.py``, ``_hf.py``, ``_gguf.py``,
``_tokenizer.py``) against independent writers (``tests/bitnet_files.py``: a hand-written
safetensors writer and transformers' packing, the gguf package's ``GGUFWriter`` and
``gguf.quants``), the ``tokenizers`` package and the ``regex`` package as oracles.

Every layout loads to what its writer meant (codes and scales exactly, norms, the embedding's
bits), ``save_gguf`` round trips, bad files raise naming the file and the tensor, and the
tokenizer encodes, decodes and streams.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

import bitnet_files as bf
import lowbit
from lowbit.models.bitnet import _gguf, _load
from lowbit.models.bitnet._config import BitNetConfig
from lowbit.models.bitnet._params import Dense, check_params

pytest.importorskip("gguf", reason='the gguf package (pip install "lowbit[io]")')

TEXTS = ["the quick brown fox", "The dog's owner isn't here; THEY'RE out!", "123456789 12 3",
         "ünïcödé 日本語 😀🎉 text", "tabs\tand\n\nnewlines \r\n  x  ", "   leading", "trailing   ",
         "<|begin_of_text|>hi<|eot_id|> there", "a'sb 'll 'LL ''", "", "x" * 40]


@pytest.fixture(scope="module")
def model():
    return bf.tiny_model(1)


def assert_params(written, params, expected_scales=None):
    """The loaded params hold the writer's codes and scales exactly, its norms and dense bits."""
    m = written.model
    check_params(m.config, params)
    scales = written.scales if expected_scales is None else expected_scales
    for name, codes in m.codes.items():
        pw = params[name]
        np.testing.assert_array_equal(pw.codes(), codes, err_msg=name)
        assert pw.scale.dtype == np.float32 and pw.scale == scales[name], \
            (name, pw.scale, scales[name])
    for name, v in m.norms.items():
        np.testing.assert_array_equal(params[name], v, err_msg=name)
        assert params[name].dtype == np.float32
    for name, (kind, stored) in written.dense.items():
        assert isinstance(params[name], Dense) and params[name].dtype == kind, name
        np.testing.assert_array_equal(params[name].data, stored, err_msg=name)
    assert ("lm_head" in params) == (m.head is not None)


# ---- Hugging Face layouts -------------------------------------------------------------------

@pytest.mark.parametrize("linear_class, scale_dtype",
                         [("bitlinear", "F32"), ("bitlinear", "BF16"), ("autobitlinear", "BF16"),
                          ("autobitlinear", "F16")])
def test_hf_offline(tmp_path, model, linear_class, scale_dtype):
    w = bf.write_hf_offline(tmp_path, model, linear_class, scale_dtype)
    config, params, tok = _load.load(tmp_path)
    assert config == model.config
    assert_params(w, params)
    for name, s in model.scales.items():  # the convention recovers the writer's scale
        assert abs(params[name].scale / s - 1) <= {"F32": 1e-7, "F16": 1e-3, "BF16": 8e-3}[
            scale_dtype]
    assert tok is not None and tok.bos_token_id == 292 and tok.eos_token_id == 293


def test_hf_conventions_are_reciprocal(tmp_path, model):
    """The same file read under the other linear_class gives reciprocal scales: a loader that
    mixed them up would scale every projection by 1 / s^2."""
    w = bf.write_hf_offline(tmp_path, model, "bitlinear", "F32", tokenizer=False)
    _, right, _ = _load.load(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["linear_class"] = "autobitlinear"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, wrong, _ = _load.load(tmp_path)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    name = "model.layers.0.self_attn.q_proj"
    want = x @ (model.codes[name].astype(np.float32) * model.scales[name])
    np.testing.assert_allclose(x @ right[name].dequantize(), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(x @ wrong[name].dequantize(), want, rtol=0.1)
    for name in model.codes:
        assert right[name].scale == w.scales[name]
        assert abs(np.float64(right[name].scale) * np.float64(wrong[name].scale) - 1) < 1e-6


def test_hf_quant_config_defaults(tmp_path, model):
    """transformers' BitNetQuantConfig defaults: linear_class "bitlinear", mode "offline"."""
    w = bf.write_hf_offline(tmp_path, model, "bitlinear", "F32", tokenizer=False,
                            quant={"quant_method": "bitnet"})
    assert_params(w, _load.load(tmp_path)[1])


@pytest.mark.parametrize("dtype, quant, shards", [("BF16", True, 1), ("F32", False, 1),
                                                   ("F16", True, 3), ("BF16", False, 2)])
def test_hf_master_weights(tmp_path, model, dtype, quant, shards):
    w = bf.write_hf_online(tmp_path, model, dtype, quant, shards)
    config, params, tok = _load.load(tmp_path)
    assert config == model.config and tok is None
    scales = {}
    for name, master in model.masters.items():
        stored = master.astype(np.float16).astype(np.float32) if dtype == "F16" else master
        ref = lowbit.quantize_weight(stored, "ternary")
        scales[name] = ref.scale
        # BitNet's absmean rule, written out: scale = mean |w|, codes = clip(round(w / scale))
        s = np.mean(np.abs(stored.astype(np.float64)))
        assert abs(ref.scale / s - 1) < 1e-6
        q = np.clip(np.rint(stored / np.float64(ref.scale)), -1, 1)
        assert np.mean(q == ref.codes()) > 0.999
        np.testing.assert_array_equal(params[name].codes(), ref.codes(), err_msg=name)
    for name in model.masters:
        assert params[name].scale == scales[name]
    for name, (kind, stored) in w.dense.items():
        np.testing.assert_array_equal(params[name].data, stored)
        assert params[name].dtype == kind


def test_hf_1bitllm_spelling(tmp_path):
    """1bitLLM's BitnetForCausalLM: model_type "llama", fp16 master weights, no
    quantization_config, sub-norms named inner_attn_ln / ffn_layernorm."""
    m = bf.tiny_model(5, hidden_act="silu")
    bf.write_hf_online(tmp_path, m, "F16", quant=False)
    _edit_config(tmp_path, model_type="llama", architectures=["BitnetForCausalLM"])
    _edit_tensors(tmp_path, lambda t: t.update({
        k.replace("attn_sub_norm", "inner_attn_ln").replace("ffn_sub_norm", "ffn_layernorm"):
        t.pop(k) for k in list(t) if "sub_norm" in k}))
    config, params, _ = _load.load(tmp_path)
    assert config == m.config
    for name, v in m.norms.items():
        np.testing.assert_array_equal(params[name], v)


@pytest.mark.parametrize("eos", [(7,), (7, 9), ()])
def test_config_to_hf_dict(model, eos):
    """``BitNetConfig.to_hf_dict`` writes the fields the independent writer's ``config.json``
    holds (eos one id, a list, or null) and reads back to the same config."""
    cfg = dataclasses.replace(model.config, eos_token_id=eos)
    d = cfg.to_hf_dict()
    json.dumps(d)  # a config.json, as written
    want = bf.hf_config(model)
    want["eos_token_id"] = eos[0] if len(eos) == 1 else (list(eos) or None)
    del want["torch_dtype"]
    assert {k: d[k] for k in want} == want
    assert d["head_dim"] == cfg.head_dim
    assert BitNetConfig.from_hf_dict(d) == cfg


@pytest.mark.parametrize("shards", [2, 5])
def test_hf_sharded_offline(tmp_path, model, shards):
    w = bf.write_hf_offline(tmp_path, model, "autobitlinear", shards=shards, tokenizer=False)
    assert not (tmp_path / "model.safetensors").exists()
    assert_params(w, _load.load(tmp_path)[1])


def test_hf_untied(tmp_path):
    m = bf.tiny_model(2, tie=False, hidden_act="silu")
    w = bf.write_hf_offline(tmp_path, m, "autobitlinear", tokenizer=False)
    config, params, _ = _load.load(tmp_path)
    assert not config.tie_word_embeddings and config.hidden_act == "silu"
    assert_params(w, params)


# ---- GGUF -------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype, embed_type, scale_tensors",
                         [("TQ2_0", "F32", False), ("TQ1_0", "BF16", False),
                          ("TQ2_0", "F16", True), ("TQ1_0", "F32", True)])
def test_gguf(tmp_path, model, qtype, embed_type, scale_tensors):
    path = str(tmp_path / "m.gguf")
    w = bf.write_gguf(path, model, qtype, embed_type=embed_type, scale_tensors=scale_tensors)
    config, params, tok = _load.load(path)
    assert config == model.config
    assert_params(w, params)
    assert tok is not None and tok.encode("the fox")[0] == 292


def test_gguf_untied_and_activation_key(tmp_path):
    m = bf.tiny_model(3, tie=False, hidden_act="silu")
    path = str(tmp_path / "m.gguf")
    w = bf.write_gguf(path, m, tokenizer=False)
    config, params, tok = _load.load(path)
    assert config.hidden_act == "silu" and not config.tie_word_embeddings and tok is None
    assert_params(w, params)
    bf.write_gguf(path, m, act_key=False, tokenizer=False)
    assert _load.load(path)[0].hidden_act == "relu2"  # llama.cpp's files carry no such key


def test_gguf_dense_ternary_projection(tmp_path, model):
    """An F32 projection holding {-s, 0, s} (llama.cpp's converter's f32 output) keeps its
    codes and scale s (absmean would give mean |w| instead)."""
    name = "model.layers.1.mlp.up_proj"
    dense = model.codes[name].T.astype(np.float32) * model.scales[name]
    path = str(tmp_path / "m.gguf")
    w = bf.write_gguf(path, model, skip=("blk.1.ffn_up.weight",),
                      extra={"blk.1.ffn_up.weight": dense})
    assert_params(w, _load.load(path)[1])


@pytest.mark.parametrize("qtype", ["TQ2_0", "TQ1_0"])
def test_save_gguf_round_trip(tmp_path, model, qtype):
    bf.write_hf_offline(tmp_path / "hf", model, "autobitlinear", "BF16")
    config, params, tok = _load.load(tmp_path / "hf")
    path = str(tmp_path / "out.gguf")
    _gguf.save_gguf(path, config, params, qtype, tokenizer=tok)
    config2, params2, tok2 = _load.load(path)
    assert config2 == config
    w = bf.Written(path, model, {n: params[n].scale for n in model.codes},
                   {"model.embed_tokens": ("bfloat16", params["model.embed_tokens"].data)})
    assert_params(w, params2)  # fp16-exact scales survive ggml's fp16 block scale bitwise
    for text in TEXTS:
        assert tok2.encode(text) == tok.encode(text), text
    # read back by the gguf package alone: llama.cpp's metadata keys and tensor types
    import gguf
    r = gguf.GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.t")}
    assert f["general.architecture"] == "bitnet" and f["bitnet.embedding_length"] == 256
    assert f["bitnet.attention.head_count_kv"] == 2 and f["bitnet.block_count"] == 2
    assert f["bitnet.hidden_activation"] == "relu2" and f["tokenizer.ggml.model"] == "gpt2"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == config.vocab_size
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == qtype and types["token_embd.weight"] == "BF16"
    assert types["blk.1.ffn_sub_norm.weight"] == "F32" and "output.weight" not in types


def test_save_gguf_rounds_scales_to_fp16(tmp_path):
    config = BitNetConfig(**bf.TINY, tie_word_embeddings=False, hidden_act="silu")
    from lowbit.models.bitnet._params import random_params
    params = random_params(config, seed=4, dense_dtype="float16")  # scales 1/16, 1/sqrt(512)
    path = str(tmp_path / "m.gguf")
    _gguf.save_gguf(path, config, params, "TQ1_0")
    config2, params2, tok = _load.load(path)
    # no tokenizer given: the placeholder byte-level vocabulary, which llama.cpp needs
    assert config2 == config and tok.encode("hi", add_special_tokens=False) == [104, 105]
    for name, value in params.items():
        got = params2[name]
        if isinstance(value, Dense):
            assert got.dtype == "float16"
            np.testing.assert_array_equal(got.data, value.data)
        elif isinstance(value, lowbit.PackedWeight):
            np.testing.assert_array_equal(got.codes(), value.codes())
            assert got.scale == np.float32(np.float16(value.scale))
        else:
            np.testing.assert_array_equal(got, value)


def test_save_gguf_rejects(tmp_path, model):
    from lowbit.models.bitnet._params import random_params
    small = BitNetConfig(**{**bf.TINY, "hidden_size": 128, "head_dim": 32})
    params = random_params(small)
    path = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match=r"q_proj.*in_features = 128 .*multiple of 256"):
        _gguf.save_gguf(path, small, params)
    big = BitNetConfig(**bf.TINY)
    with pytest.raises(ValueError, match="qtype"):
        _gguf.save_gguf(path, big, random_params(big), "Q4_0")
    with pytest.raises(ValueError, match="missing tensor"):
        _gguf.save_gguf(path, big, {})
    assert not path.exists()


def test_load_to_numpy_by_default(tmp_path, model):
    bf.write_hf_offline(tmp_path, model, tokenizer=False)
    _, params, _ = _load.load(tmp_path, xp=np)
    assert isinstance(params["model.embed_tokens"].data, np.ndarray)


def test_load_to_cupy(tmp_path, model):
    cp = pytest.importorskip("cupy")
    if not lowbit._backend.cuda_device_count():
        pytest.skip("needs a CUDA device")
    bf.write_hf_offline(tmp_path, model, tokenizer=False)
    _, params, _ = _load.load(tmp_path, xp=cp)
    assert isinstance(params["model.layers.0.self_attn.q_proj"].data, cp.ndarray)
    assert isinstance(params["model.norm"], cp.ndarray)


# ---- bad files --------------------------------------------------------------------------------

def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder, edit):
    from lowbit.io.safetensors import read_raw
    path = folder / "model.safetensors"
    tensors, _ = read_raw(path)
    edit(tensors)
    bf.write_safetensors(path, tensors)


def test_missing_paths(tmp_path, model):
    with pytest.raises(FileNotFoundError, match="nothere"):
        _load.load(tmp_path / "nothere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        _load.load(tmp_path / "empty")
    bf.write_hf_offline(tmp_path / "a", model, tokenizer=False)
    os.remove(tmp_path / "a" / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        _load.load(tmp_path / "a")
    bf.write_hf_offline(tmp_path / "b", model, shards=2, tokenizer=False)
    os.remove(tmp_path / "b" / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        _load.load(tmp_path / "b")
    (tmp_path / "c.bin").write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ValueError, match="c.bin.*not a GGUF"):
        _load.load(tmp_path / "c.bin")


@pytest.mark.parametrize("change, match", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "not BitNet"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq'"),
    ({"quantization_config": {"quant_method": "bitnet", "linear_class": "fastlinear"}},
     "linear_class 'fastlinear'"),
    ({"quantization_config": {"quant_method": "bitnet", "quantization_mode": "lazy"}},
     "quantization_mode 'lazy'"),
    ({"quantization_config": {"quant_method": "bitnet", "use_rms_norm": True}}, "use_rms_norm"),
    ({"quantization_config": {"quant_method": "bitnet", "modules_to_not_convert": ["mlp"]}},
     "modules_to_not_convert"),
    ({"intermediate_size": 768}, r"mlp\.gate_proj\.weight.*shape"),
    ({"vocab_size": 301}, r"model\.embed_tokens\.weight.*shape"),
    ({"hidden_size": None}, "hidden_size"),
    ({"quantization_config": None}, r"q_proj.weight_scale.*master weights"),
    ({"tie_word_embeddings": False}, "missing tensor 'lm_head.weight'"),
])
def test_hf_bad_config(tmp_path, model, change, match):
    bf.write_hf_offline(tmp_path, model, tokenizer=False)
    _edit_config(tmp_path, **change)
    with pytest.raises(ValueError, match=match) as info:
        _load.load(tmp_path)
    assert str(tmp_path) in str(info.value)


def _drop(name):
    return lambda t: t.pop(name)


def _retype(name, code, dtype):
    return lambda t: t.update({name: (code, t[name][1].astype(dtype))})


@pytest.mark.parametrize("edit, match", [
    (_drop("model.layers.1.mlp.down_proj.weight"), "missing tensor 'model.layers.1.mlp.down_proj"),
    (_drop("model.layers.0.self_attn.k_proj.weight_scale"), "missing tensor .*k_proj.weight_sc"),
    (_drop("model.norm.weight"), "missing tensor 'model.norm.weight'"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": ("F32", np.zeros(2, np.float32))}),
     "unexpected tensor 'model.layers.2.mlp.up_proj.weight'"),
    (_retype("model.layers.0.mlp.up_proj.weight", "F32", np.float32), r"up_proj.weight.*F32.*U8"),
    (_retype("model.embed_tokens.weight", "I32", np.int32), r"embed_tokens.weight.*dtype I32"),
    (_retype("model.norm.weight", "U8", np.uint8), r"model.norm.weight.*dtype U8"),
    (lambda t: t.update({"lm_head.weight": ("BF16", t["model.embed_tokens.weight"][1] + 1)}),
     "lm_head.weight.*differs"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": (
        "U8", np.full((64, 256), 255, np.uint8))}), r"q_proj.weight.*value 3"),
])
def test_hf_bad_tensors(tmp_path, model, edit, match):
    bf.write_hf_offline(tmp_path, model, tokenizer=False)
    _edit_tensors(tmp_path, edit)
    with pytest.raises(ValueError, match=match) as info:
        _load.load(tmp_path)
    assert "model.safetensors" in str(info.value) or str(tmp_path) in str(info.value)


def test_hf_truncated_and_bad_index(tmp_path, model):
    bf.write_hf_offline(tmp_path / "a", model, tokenizer=False)
    path = tmp_path / "a" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors.*truncated|cover"):
        _load.load(tmp_path / "a")
    bf.write_hf_offline(tmp_path / "b", model, shards=2, tokenizer=False)
    index = tmp_path / "b" / "model.safetensors.index.json"
    spec = json.loads(index.read_text())
    spec["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors" \
        if spec["weight_map"]["model.norm.weight"].startswith("model-00002") else \
        "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="model.norm.weight"):
        _load.load(tmp_path / "b")


@pytest.mark.parametrize("kwargs, match", [
    ({"arch": "llama"}, "general.architecture 'llama'"),
    ({"skip": ("blk.1.ffn_sub_norm.weight",)}, "missing tensor 'blk.1.ffn_sub_norm.weight'"),
    ({"extra": {"rope_freqs.weight": np.ones(32, np.float32)}}, "unexpected tensor 'rope_freqs"),
    ({"extra": {"blk.0.attn_q.scale": np.ones(2, np.float32)}}, "attn_q.scale.*one"),
    ({"meta_override": {"embedding_length": 512, "attention.key_length": 64}},
     r"token_embd.weight.*ne=\[256, 300\]"),
    ({"meta_override": {"feed_forward_length": 256}}, r"blk.0.attn_sub_norm|ffn_gate|ne="),
    ({"meta_override": {"block_count": None}}, "bitnet.'block_count'"),
    ({"meta_override": {"rope.dimension_count": 32}}, "partial rotary"),
    ({"meta_override": {"hidden_activation": "swiglu9"}}, "hidden_act"),
])
def test_gguf_bad_files(tmp_path, model, kwargs, match):
    path = str(tmp_path / "m.gguf")
    bf.write_gguf(path, model, tokenizer=False, **kwargs)
    with pytest.raises(ValueError, match=match) as info:
        _load.load(path)
    assert path in str(info.value)


def test_gguf_bad_types_and_truncation(tmp_path, model):
    """A projection of a type that is no ternary one (Q8_0), a truncated file."""
    import gguf
    q8 = gguf.GGMLQuantizationType.Q8_0
    dq = model.codes["model.layers.0.mlp.down_proj"].T.astype(np.float32)
    path = str(tmp_path / "m.gguf")
    bf.write_gguf(path, model, tokenizer=False, skip=("blk.0.ffn_down.weight",),
                  extra={"blk.0.ffn_down.weight": (gguf.quants.quantize(dq, q8), q8)})
    with pytest.raises(ValueError, match=r"m.gguf: tensor 'blk.0.ffn_down.weight'.*Q8_0"):
        _load.load(path)
    data = open(bf.write_gguf(path, model).path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) - 5000])
    with pytest.raises(ValueError, match="m.gguf"):
        _load.load(path)
