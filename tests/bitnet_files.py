"""Writers of tiny random BitNet model files in every published layout, for the BitNet tests.

Each writer is independent of the code it checks: safetensors files are written by
``write_safetensors`` here (header + bytes, bfloat16 as its bits), transformers' packed uint8
layout by ``hf_pack`` here (``integrations/bitnet.py``'s ``pack_weights``: output ``n`` is the
2-bit field ``n // R`` of row ``n % R``), GGUF files by the ``gguf`` package's ``GGUFWriter``
and ``gguf.quants.quantize`` (TQ1_0 / TQ2_0), the byte-level BPE vocabulary by ``tiny_bpe``
(its own byte alphabet and merge learning), ``tokenizer.json`` as the JSON Llama 3 ships.

``tiny_model`` draws the model (vocab 300, hidden 256, intermediate 512, 2 layers, 4 heads,
2 key/value heads, head_dim 64: GGUF's blocks need in_features a multiple of 256); every writer
returns a ``Written`` with what a loader must give back: ternary codes and scales exactly,
norms, and the embedding's stored bits.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from lowbit.models.bitnet._config import BitNetConfig

TINY = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=128)
PROJ = {"self_attn.q_proj": ("attn_q", "hidden_size", "q"),
        "self_attn.k_proj": ("attn_k", "hidden_size", "kv"),
        "self_attn.v_proj": ("attn_v", "hidden_size", "kv"),
        "self_attn.o_proj": ("attn_output", "q", "hidden_size"),
        "mlp.gate_proj": ("ffn_gate", "hidden_size", "intermediate_size"),
        "mlp.up_proj": ("ffn_up", "hidden_size", "intermediate_size"),
        "mlp.down_proj": ("ffn_down", "intermediate_size", "hidden_size")}
NORMS = {"input_layernorm": ("attn_norm", "hidden_size"),
         "post_attention_layernorm": ("ffn_norm", "hidden_size"),
         "self_attn.attn_sub_norm": ("attn_sub_norm", "hidden_size"),
         "mlp.ffn_sub_norm": ("ffn_sub_norm", "intermediate_size")}
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
LLAMA3_PATTERN = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
                  "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
CORPUS = ("the quick brown fox jumps over the lazy dog. The dog's owner isn't here, they're "
          "out; the fox and the dog are there then. 123 4567 the then there thee")
_ST_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8,
             "I32": np.int32}


def bf16_round(x):
    """float32 values with the low 16 bits cleared: exactly representable in bfloat16."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def bf16_bits(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


@dataclasses.dataclass
class Model:
    """A drawn model: ``codes`` name -> int8 [in, out] ternary codes (lowbit's orientation),
    ``scales`` name -> the float32 scale (value = code * scale), ``norms`` name -> float32,
    ``embed`` / ``head`` float32 [vocab, hidden] (bfloat16-exact), ``masters`` name -> float32
    [in, out] master weights (bfloat16-exact) for the online layouts."""

    config: BitNetConfig
    codes: dict
    scales: dict
    norms: dict
    embed: np.ndarray
    head: np.ndarray | None
    masters: dict


@dataclasses.dataclass
class Written:
    """What a loader must return for a written file: ``scales`` the exact float32 scale the
    layout's convention gives from the stored value (None for master weights: the loader
    ternarizes ``model.masters``), ``dense`` name -> (Dense dtype, stored array)."""

    path: str
    model: Model
    scales: dict | None
    dense: dict


def tiny_model(seed=0, *, tie=True, hidden_act="relu2", **overrides) -> Model:
    """A random model of the ``TINY`` shapes (``overrides`` change them)."""
    sizes = {**TINY, **overrides}
    config = BitNetConfig(**sizes, tie_word_embeddings=tie, bos_token_id=292,
                          eos_token_id=(293,), hidden_act=hidden_act)
    dims = {"hidden_size": config.hidden_size, "q": config.q_size, "kv": config.kv_size,
            "intermediate_size": config.intermediate_size}
    rng = np.random.default_rng(seed)
    codes, scales, norms, masters = {}, {}, {}, {}
    for n in range(config.num_hidden_layers):
        for name, (_, k, m) in PROJ.items():
            key = f"model.layers.{n}.{name}"
            K, N = dims[k], dims[m]
            codes[key] = rng.integers(-1, 2, (K, N)).astype(np.int8)
            # fp16- and bf16-exact scales: m * 2^-e
            mantissa = rng.choice([1.0, 1.25, 1.5, 1.75])
            scales[key] = np.float32(mantissa * 2.0 ** -rng.integers(3, 8))
            masters[key] = bf16_round(rng.standard_normal((K, N)) * 0.05)
        for name, (_, w) in NORMS.items():
            norms[f"model.layers.{n}.{name}"] = bf16_round(1 + 0.1 * rng.standard_normal(dims[w]))
    norms["model.norm"] = bf16_round(1 + 0.1 * rng.standard_normal(config.hidden_size))
    shape = (config.vocab_size, config.hidden_size)
    embed = bf16_round(rng.standard_normal(shape))
    head = None if tie else bf16_round(rng.standard_normal(shape))
    return Model(config, codes, scales, norms, embed, head, masters)


# ---- safetensors and the Hugging Face layouts ------------------------------------------------

def write_safetensors(path, tensors):
    """tensors: name -> (dtype code, array); written in name order, 8-byte aligned header."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        code, arr = tensors[name]
        raw = np.ascontiguousarray(arr, dtype=_ST_TYPES[code]).astype(
            np.dtype(_ST_TYPES[code]).newbyteorder("<")).tobytes()
        header[name] = {"dtype": code, "shape": list(np.shape(arr)),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def hf_pack(codes_out_in):
    """transformers' pack_weights of int8 [out, in] ternary codes -> uint8 [ceil(out/4), in]."""
    out = codes_out_in.shape[0]
    R = -(-out // 4)
    packed = np.zeros((R, codes_out_in.shape[1]), np.uint8)
    for i in range(4):
        rows = (codes_out_in[i * R:(i + 1) * R] + 1).astype(np.uint8)
        packed[:len(rows)] |= rows << (2 * i)
    return packed


def _float_tensor(x, code):
    if code == "BF16":
        return ("BF16", bf16_bits(x))
    return (code, np.asarray(x, dtype=_ST_TYPES[code]))


def hf_config(model, quant=None):
    c = model.config
    cfg = {"architectures": ["BitNetForCausalLM"], "model_type": "bitnet",
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
           "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "hidden_act": c.hidden_act,
           "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.max_position_embeddings,
           "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
           "eos_token_id": c.eos_token_id[0], "torch_dtype": "bfloat16"}
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def _write_folder(folder, cfg, tensors, shards, tokenizer):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    if shards == 1:
        write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    else:
        names = sorted(tensors)
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            write_safetensors(os.path.join(folder, file), part)
            weight_map.update({n: file for n in part})
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    if tokenizer:
        write_tokenizer_json(folder)


def _dense_tensors(model, code):
    out = {"model.embed_tokens.weight": _float_tensor(model.embed, code)}
    if model.head is not None:
        out["lm_head.weight"] = _float_tensor(model.head, code)
    out.update({k + ".weight": ("F32", v) for k, v in model.norms.items()})
    return out


def _dense_expect(model, code):
    kind = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[code]
    out = {"model.embed_tokens": (kind, _float_tensor(model.embed, code)[1])}
    if model.head is not None:
        out["lm_head"] = (kind, _float_tensor(model.head, code)[1])
    return out


def write_hf_offline(folder, model, linear_class="autobitlinear", scale_dtype="BF16", shards=1,
                     tokenizer=True, quant=None) -> Written:
    """transformers' packed "offline" checkpoint: uint8 weights and ``weight_scale`` tensors
    in ``scale_dtype``; "bitlinear" stores 1 / scale (BitLinear divides), "autobitlinear" the
    scale (AutoBitLinear multiplies). The microsoft/bitnet-b1.58-2B-4T config by default."""
    tensors = _dense_tensors(model, "BF16")
    scales = {}
    for name, codes in model.codes.items():
        tensors[name + ".weight"] = ("U8", hf_pack(codes.T))
        s = np.float64(model.scales[name])
        ws = 1.0 / s if linear_class == "bitlinear" else s
        code, stored = _float_tensor(np.array([ws]), scale_dtype)
        tensors[name + ".weight_scale"] = (code, stored)
        value = np.float64((stored.astype(np.uint32) << 16).view(np.float32)[0]
                           if scale_dtype == "BF16" else stored[0])
        scales[name] = np.float32(1.0 / value if linear_class == "bitlinear" else value)
    if quant is None:
        quant = {"quant_method": "bitnet", "linear_class": linear_class,
                 "quantization_mode": "offline"}
    _write_folder(folder, hf_config(model, quant), tensors, shards, tokenizer)
    return Written(folder, model, scales, _dense_expect(model, "BF16"))


def write_hf_online(folder, model, dtype="BF16", quant=True, shards=1,
                    tokenizer=False) -> Written:
    """Master weights in ``dtype`` ([out, in]); ``quant`` adds the "autobitlinear" / "online"
    quantization_config (else the config has none)."""
    tensors = _dense_tensors(model, dtype)
    for name, w in model.masters.items():
        tensors[name + ".weight"] = _float_tensor(w.T, dtype)
    q = ({"quant_method": "bitnet", "linear_class": "autobitlinear",
          "quantization_mode": "online"} if quant else None)
    _write_folder(folder, hf_config(model, q), tensors, shards, tokenizer)
    return Written(folder, model, None, _dense_expect(model, dtype))


# ---- the tokenizer ----------------------------------------------------------------------------

def _byte_alphabet():
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | \
        set(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tiny_bpe(n_merges=36):
    """(tokens, merges, token types) of a byte-level BPE learned on ``CORPUS``: the 256 byte
    tokens, one token per merge, then ``SPECIALS`` (control tokens)."""
    alphabet = _byte_alphabet()
    words = {}
    for i, w in enumerate(CORPUS.split(" ")):
        sym = tuple(alphabet[b] for b in ((" " if i else "") + w).encode())
        words[sym] = words.get(sym, 0) + 1
    tokens, merges = list(alphabet), []
    while len(merges) < n_merges:
        counts = {}
        for sym, c in words.items():
            for pair in zip(sym, sym[1:]):
                if "".join(pair) not in tokens:
                    counts[pair] = counts.get(pair, 0) + c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(f"{best[0]} {best[1]}")
        tokens.append("".join(best))
        new = {}
        for sym, c in words.items():
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == best:
                    out.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        words = new
    assert len(merges) == n_merges, "CORPUS is too small for the merges"
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return tokens + list(SPECIALS), merges, types


def write_tokenizer_json(folder, pattern=LLAMA3_PATTERN):
    """A Llama-3-style ``tokenizer.json`` (+ ``tokenizer_config.json``) of ``tiny_bpe``."""
    tokens, merges, types = tiny_bpe()
    n = len(tokens) - len(SPECIALS)
    added = [{"id": n + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIALS)]
    bos = SPECIALS[0]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
             "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [n], "tokens": [bos]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {t: i for i, t in enumerate(tokens[:n])}, "merges": merges}}
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1]}, f)


# ---- GGUF --------------------------------------------------------------------------------------

def write_gguf(path, model, qtype="TQ2_0", *, embed_type="F32", scale_tensors=False,
               tokenizer=True, act_key=True, arch="bitnet", skip=(), extra=None,
               meta_override=None) -> Written:
    """A ``bitnet`` GGUF file through the gguf package. ``scale_tensors``: blocks quantized
    from the codes alone (block scale 1) and the scale in a ``.scale`` tensor; ``skip``: tensor
    names left out; ``extra``: name -> array (or (array, raw GGML type)) added;
    ``meta_override``: bitnet.* key -> value (an int, float or str, None to drop it)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(path, arch)
    meta = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads,
            "attention.head_count_kv": c.num_key_value_heads, "rope.freq_base": c.rope_theta,
            "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
            "rope.dimension_count": c.head_dim}
    if act_key:
        meta["hidden_activation"] = c.hidden_act
    meta.update(meta_override or {})
    for key, value in meta.items():
        if value is None:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    if tokenizer:
        tokens, merges, types = tiny_bpe()
        pad = c.vocab_size - len(tokens)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), c.vocab_size)])
        w.add_token_types(types + [5] * pad)
        w.add_token_merges(merges)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id[0])
    embed_raw = {"F32": (model.embed, None), "F16": (model.embed.astype(np.float16), None),
                 "BF16": (bf16_bits(model.embed), gguf.GGMLQuantizationType.BF16)}
    tensors = [("token_embd.weight", *embed_raw[embed_type]),
               ("output_norm.weight", model.norms["model.norm"], None)]
    if model.head is not None:
        tensors.append(("output.weight", model.head, None))
    qt = gguf.GGMLQuantizationType[qtype]
    for n in range(c.num_hidden_layers):
        for name, (short, _) in NORMS.items():
            tensors.append((f"blk.{n}.{short}.weight", model.norms[f"model.layers.{n}.{name}"],
                            None))
        for name, (short, _, _) in PROJ.items():
            key = f"model.layers.{n}.{name}"
            s = model.scales[key]
            dq = model.codes[key].T.astype(np.float32) * (np.float32(1) if scale_tensors else s)
            tensors.append((f"blk.{n}.{short}.weight", gguf.quants.quantize(dq, qt), qt))
            if scale_tensors:
                tensors.append((f"blk.{n}.{short}.scale", np.array([s], np.float32), None))
    tensors = [t for t in tensors if t[0] not in skip]
    tensors += [(k, *(v if isinstance(v, tuple) else (v, None))) for k, v in (extra or {}).items()]
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dense = {"model.embed_tokens": ({"F32": "float32", "F16": "float16",
                                     "BF16": "bfloat16"}[embed_type], embed_raw[embed_type][0])}
    if model.head is not None:
        dense["lm_head"] = ("float32", model.head)
    return Written(path, model, dict(model.scales), dense)
