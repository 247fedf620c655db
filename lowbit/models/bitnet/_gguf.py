"""llama.cpp's ``bitnet`` architecture in GGUF: ``load_gguf_model`` and ``save_gguf``.

The layout (llama.cpp ``src/models/bitnet.cpp``, ``llama_model_bitnet::load_arch_tensors``, and
the gguf package's ``MODEL_TENSORS[MODEL_ARCH.BITNET]``): ``token_embd``, ``output_norm``, per
block ``blk.N.{attn_norm, attn_sub_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
ffn_sub_norm, ffn_gate, ffn_up, ffn_down}`` (each ``.weight``), and optional ``blk.N.<proj>.scale``
tensors of one value that llama.cpp multiplies the projection's output by (``build_lora_mm``
with the scale): they are folded into the ``PackedWeight`` scale here. A projection is
``ne = [in, out]`` (lowbit's ``(K, N)``) in TQ1_0 or TQ2_0 (``lowbit.io.gguf.from_gguf``), or
F32/F16/BF16 (codes and scale taken as they are where the values are already ternary, as
llama.cpp's converter writes them, else ternarized with ``quantize_weight``).

Rotary: llama.cpp runs ``bitnet`` with ``LLAMA_ROPE_TYPE_NEOX`` (``llama_model_rope_type`` in
``src/llama-model.cpp`` lists ``LLM_ARCH_BITNET`` among the archs whose "pairs of head values
are offset by n_rot/2"), which is transformers' half-split ``rotate_half``, and its converter
(``convert_hf_to_gguf.py``, ``BitnetModel``, a ``TextModel``, not a ``LlamaModel``) does not
permute the q/k rows as ``LlamaModel.modify_tensors`` does for ``llama``. So ``attn_q`` and
``attn_k`` are stored in transformers' row order, and nothing is permuted either way.

Hyperparameters are the ``bitnet.*`` keys (``context_length``, ``embedding_length``,
``block_count``, ``feed_forward_length``, ``attention.head_count``, ``attention.head_count_kv``,
``attention.key_length``, ``rope.freq_base`` (llama.cpp's default 10000),
``rope.dimension_count``, ``attention.layer_norm_rms_epsilon``), the vocabulary is
``token_embd``'s rows, the BOS / EOS (and EOT, as a second EOS) ids the ``tokenizer.ggml.*``
ones, and ``bitnet.hidden_activation`` (lowbit's own key) the FFN activation: a file without it
is read as "relu2", BitNet b1.58's.
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Any

import numpy as np

from ... import _backend
from ...io._files import StrPath, atomic_path
from ...io.gguf import _gguf, from_gguf, to_gguf
from ...ops.pack_bits import pack_bits
from ...ops.quantize import PackedWeight, quantize_weight
from ._config import BitNetConfig
from ._params import Dense, Param, check_params, expected_shapes
from ._tokenizer import ByteBPE, Tokenizer, byte_chars

ARCH = "bitnet"
#: lowbit's metadata key for ``hidden_act``.
ACT_KEY = "bitnet.hidden_activation"
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.attn_sub_norm": "attn_sub_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "post_attention_layernorm": "ffn_norm", "mlp.ffn_sub_norm": "ffn_sub_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_DENSE_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def gguf_name(name: str) -> str:
    """The GGUF tensor name (without ``.weight``) of a ``params`` name."""
    if name in _TOP:
        return _TOP[name]
    n, _, rest = name[len("model.layers."):].partition(".")
    if not name.startswith("model.layers.") or not n.isdigit() or rest not in _LAYER:
        raise ValueError(f"no GGUF name for parameter {name!r}")
    return f"blk.{n}.{_LAYER[rest]}"


def _float(path: str, name: str, t: Any) -> np.ndarray:
    """A dense F32/F16/BF16 tensor as float32 in numpy order."""
    kind = t.tensor_type.name
    shape = tuple(int(d) for d in t.shape)[::-1]
    if kind == "BF16":
        bits = np.ascontiguousarray(t.data).view("<u2").reshape(shape)
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if kind in ("F32", "F16"):
        return np.array(t.data, dtype=np.float32).reshape(shape)
    raise ValueError(f"{path}: tensor {name!r} has type {kind}, expected F32, F16 or BF16")


def _dense(path: str, name: str, t: Any) -> Dense:
    kind = t.tensor_type.name
    shape = tuple(int(d) for d in t.shape)[::-1]
    if kind == "BF16":
        return Dense(np.ascontiguousarray(t.data).view("<u2").reshape(shape)
                     .astype(np.uint16), "bfloat16")
    if kind in ("F32", "F16"):
        return Dense(np.array(t.data).reshape(shape), _DENSE_TYPES[kind])
    gguf = _gguf()
    try:  # a quantized embedding (Q6_K, ...) is read as the float32 values it stands for
        w = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
    except (NotImplementedError, ValueError, KeyError) as exc:
        raise ValueError(f"{path}: tensor {name!r} has type {kind}, which cannot be read "
                         f"({exc})") from None
    return Dense(np.ascontiguousarray(w, dtype=np.float32).reshape(shape), "float32")


def ternary_from_dense(w: np.ndarray) -> PackedWeight:
    """A ternary weight from dense (K, N) values: exact where they are already ``{-s, 0, s}``
    (codes and scale ``s`` kept), else ternarized with ``quantize_weight``."""
    a = np.abs(w)
    nz = a[a > 0]
    if nz.size and (nz == nz[0]).all():
        codes = (np.sign(w).astype(np.int8) + 1).astype(np.uint8)
        data = pack_bits(np.ascontiguousarray(codes.T), 2)
        return PackedWeight("ternary", w.shape, data, np.asarray(nz[0], dtype=np.float32))
    return quantize_weight(np.ascontiguousarray(w, dtype=np.float32), "ternary")


def _projection(path: str, name: str, t: Any, shape: tuple[int, int],
                scale_t: Any) -> PackedWeight:
    kind = t.tensor_type.name
    try:
        if kind in ("TQ1_0", "TQ2_0"):
            pw = from_gguf(np.array(t.data, dtype=np.uint8), shape, kind)
        elif kind in _DENSE_TYPES:
            pw = ternary_from_dense(np.ascontiguousarray(_float(path, name, t).T))
        else:
            raise ValueError(f"type {kind} is no ternary type (TQ1_0, TQ2_0) nor F32/F16/BF16")
    except ValueError as exc:
        raise ValueError(f"{path}: tensor {name!r}: {exc}") from None
    if scale_t is not None:
        s = _float(path, name[:-len("weight")] + "scale", scale_t)
        if s.size != 1 or not np.isfinite(s).all():
            raise ValueError(f"{path}: tensor {name[:-len('weight')] + 'scale'!r} must hold one "
                             f"finite value, got shape {s.shape}")
        folded = np.float32(np.float64(pw.scale) * np.float64(s.reshape(())))
        pw = PackedWeight("ternary", pw.shape, pw.data, np.asarray(folded, dtype=np.float32))
    return pw


def _decimal(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5, not
    9.99999975e-06): the value the writer meant, where it was a short decimal."""
    return float(str(np.float32(value)))


def _config(path: str, fields: dict[str, Any], vocab: int, tied: bool) -> BitNetConfig:
    def get(key: str, default: Any = KeyError) -> Any:
        v = fields.get(f"{ARCH}.{key}", default)
        if v is KeyError:
            raise ValueError(f"{path}: missing the metadata key {ARCH}.{key!r}")
        if isinstance(v, list):  # per-layer arrays: one value only
            if not v or any(x != v[0] for x in v):
                raise ValueError(f"{path}: {ARCH}.{key} varies by layer ({v[:4]}...), which is "
                                 "not supported")
            v = v[0]
        return v

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // max(heads, 1)))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: {ARCH}.attention.value_length differs from key_length")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: {ARCH}.rope.dimension_count = "
                         f"{get('rope.dimension_count')} (partial rotary) is not supported; "
                         f"expected the head size {head_dim}")
    if get("vocab_size", vocab) != vocab:
        raise ValueError(f"{path}: {ARCH}.vocab_size = {get('vocab_size')} contradicts "
                         f"token_embd's {vocab} rows")
    rs = get("rope.scaling.type", "none")
    if rs not in ("none", "linear") or float(get("rope.scaling.factor", 1.0)) not in (0.0, 1.0):
        raise ValueError(f"{path}: rope scaling {rs!r} x {get('rope.scaling.factor', 1.0)} is "
                         "not supported")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    eot = fields.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(int(i) for i in dict.fromkeys(x for x in (eos, eot) if x is not None))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    try:
        return BitNetConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")), num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
            rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon")),
            rope_theta=_decimal(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length")), tie_word_embeddings=tied,
            bos_token_id=None if bos is None else int(bos), eos_token_id=eos_ids,
            hidden_act=str(fields.get(ACT_KEY, "relu2")))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def load_gguf_model(path: StrPath) -> tuple[BitNetConfig, dict[str, Param], Tokenizer | None]:
    """``(config, params, tokenizer or None)`` of a ``bitnet`` GGUF file, on the host.

    Raises:
        FileNotFoundError: no such file.
        ImportError: the ``gguf`` package is missing.
        ValueError: a file the gguf reader rejects (truncated, malformed), another
            architecture, missing metadata, a missing, extra, misshapen or mistyped tensor,
            metadata that contradicts the tensors (each message names the file and tensor).
    """
    gguf = _gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path)
        fields = {k: f.contents() for k, f in reader.fields.items()}
    except Exception as exc:  # the reader raises assorted errors on malformed files
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") \
            from None
    arch = fields.get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path}: general.architecture {arch!r} is not {ARCH!r}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: missing tensor 'token_embd.weight'")
    emb_ne = [int(d) for d in tensors["token_embd.weight"].shape]
    if len(emb_ne) != 2:
        raise ValueError(f"{path}: tensor 'token_embd.weight' must be 2-d, got ne={emb_ne}")
    config = _config(path, fields, emb_ne[1], "output.weight" not in tensors)
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > config.vocab_size:
        raise ValueError(f"{path}: tokenizer.ggml.tokens holds {len(tokens)} tokens, more than "
                         f"token_embd's {config.vocab_size} rows")
    used: set[str] = set()
    params: dict[str, Param] = {}
    for name, (kind, shape) in expected_shapes(config).items():
        key = gguf_name(name) + ".weight"
        t = tensors.get(key)
        if t is None:
            raise ValueError(f"{path}: missing tensor {key!r}")
        used.add(key)
        ne = tuple(int(d) for d in t.shape)
        want = shape if kind == "ternary" else shape[::-1]
        if ne != want:
            raise ValueError(f"{path}: tensor {key!r} has ne={list(ne)}, but the metadata "
                             f"implies {list(want)}")
        if kind == "ternary":
            skey = gguf_name(name) + ".scale"
            used.add(skey)
            params[name] = _projection(path, key, t, shape, tensors.get(skey))  # type: ignore
        elif kind == "norm":
            params[name] = np.ascontiguousarray(_float(path, key, t))
        else:
            params[name] = _dense(path, key, t)
        _drop_pages(reader, t)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} in all)")
    check_params(config, params, path)
    return config, params, Tokenizer.from_gguf(fields, path)


def _drop_pages(reader: Any, t: Any) -> None:
    """Unmap the file pages a converted tensor was read from (``madvise(MADV_DONTNEED)``: they
    stay in the page cache, out of this process's resident memory), so a load holds the file's
    pages and their converted copies together for one tensor at a time. Best effort: skipped
    where the reader's map or ``madvise`` is not there."""
    mm = getattr(reader.data, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mm is None or advice is None:
        return
    start = int(reader.data.offset) + int(t.data_offset)
    aligned = start - start % mmap.PAGESIZE
    try:
        mm.madvise(advice, aligned, int(t.n_bytes) + start - aligned)
    except (OSError, ValueError):
        pass


def _host(a: Any) -> np.ndarray:
    return a.get() if _backend.is_cupy_array(a) else np.asarray(a)


def ids_only_tokenizer() -> Tokenizer:
    """The byte-level BPE written where a model has no tokenizer of its own: the 256 byte
    tokens and one merge (llama.cpp refuses a file without ``tokenizer.ggml.*``; its text means
    nothing to the model, which is then driven by token ids)."""
    chars = byte_chars()
    return Tokenizer(ByteBPE(chars + [chars[32] * 2], [f"{chars[32]} {chars[32]}"]))


def _tokenizer_fields(config: BitNetConfig, tokenizer: Tokenizer | None) -> dict[str, Any]:
    fields = tokenizer.gguf_metadata() if tokenizer is not None else None
    if tokenizer is not None and fields is None:
        warnings.warn("save_gguf: this tokenizer has no GGUF form (only byte-level BPE has); "
                      "the file gets the byte-level placeholder vocabulary, and llama.cpp must "
                      "be given token ids", stacklevel=3)
    if fields is None and config.vocab_size > 256:
        fields = ids_only_tokenizer().gguf_metadata()
    fields = dict(fields or {})
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id"):
        fields.pop(key, None)
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        n = config.vocab_size
        if len(tokens) > n:
            raise ValueError(f"tokenizer: {len(tokens)} tokens, more than vocab_size = {n}")
        # llama.cpp takes n_vocab from the token list: pad it to the embedding's rows, as its
        # converter does
        pad = n - len(tokens)
        fields["tokenizer.ggml.tokens"] = list(tokens) + [f"[PAD{i}]" for i in
                                                          range(len(tokens), n)]
        types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        fields["tokenizer.ggml.token_type"] = types + [5] * pad
    if config.bos_token_id is not None:
        fields["tokenizer.ggml.bos_token_id"] = config.bos_token_id
    for key, value in zip(("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"),
                          config.eos_token_id):
        fields[key] = value
    return fields


def save_gguf(path: StrPath, config: BitNetConfig, params: dict[str, Param],
              qtype: str = "TQ2_0", *, tokenizer: Tokenizer | None = None) -> None:
    """Write a BitNet model as a llama.cpp ``bitnet`` GGUF file, atomically.

    The embedding (and an untied ``lm_head``, as ``output``) keep their ``Dense`` dtype
    (F32/F16/BF16), norms are F32, projections ``qtype`` with the tensor scale rounded to fp16
    in every block (relative change at most 2^-11; no ``.scale`` tensors), hyperparameters the
    ``bitnet.*`` keys, ``hidden_act`` the ``bitnet.hidden_activation`` key. A tokenizer with a
    GGUF form (a GGUF-sourced one, or a byte-level BPE ``tokenizer.json``) is written as
    ``tokenizer.ggml.*`` ("gpt2" model), the token list padded to ``vocab_size`` as llama.cpp's
    converter does; otherwise (no tokenizer, or one of another kind) the file gets a placeholder
    byte-level vocabulary (``ids_only_tokenizer``; a model of more than 256 tokens), which
    llama.cpp needs to load it, and is to be driven by token ids.

    llama.cpp caveats: its ``bitnet`` graph has built the FFN with SiLU whatever the file says
    (llama-cpp-python 0.3.36 does: ``LLM_FFN_SILU`` in ``src/models/bitnet.cpp``), so llama.cpp
    runs a "relu2" model (BitNet b1.58's) wrongly: compare against llama.cpp on a "silu" model.
    It also always uses ``token_embd`` as the output head and has no ``output`` tensor, so it
    refuses an untied model's file (wrong number of tensors); and its blocks need ``hidden_size
    == num_attention_heads * head_dim``.

    Args:
        path: destination; replaced only once the new file is complete.
        config, params: the model (``check_params``'s layout), numpy or cupy.
        qtype: "TQ2_0" or "TQ1_0", for every projection.
        tokenizer: a ``Tokenizer`` or None.

    Raises:
        ImportError: the ``gguf`` package is missing.
        ValueError: params that fail ``check_params``, an unknown ``qtype``, a projection whose
            in_features is not a multiple of 256 (ggml's block), an int8 ``lm_head``, a scale
            fp16 cannot hold, a tokenizer larger than ``vocab_size``.
    """
    gguf = _gguf()
    if qtype not in ("TQ1_0", "TQ2_0"):
        raise ValueError(f"qtype must be 'TQ1_0' or 'TQ2_0', got {qtype!r}")
    check_params(config, params)
    raw = gguf.GGMLQuantizationType[qtype]
    prepared: list[tuple[str, np.ndarray, Any]] = []
    for name, (kind, _) in expected_shapes(config).items():
        key = gguf_name(name) + ".weight"
        value = params[name]
        if kind == "ternary":
            assert isinstance(value, PackedWeight)
            K = value.shape[0]
            if K % 256:
                raise ValueError(f"params[{name!r}]: in_features = {K} is not a multiple of "
                                 f"256, which ggml's {qtype} blocks need (hidden_size and "
                                 "intermediate_size must be multiples of 256)")
            host = PackedWeight("ternary", value.shape, _host(value.data), _host(value.scale))
            try:
                prepared.append((key, to_gguf(host, qtype), raw))
            except ValueError as exc:
                raise ValueError(f"params[{name!r}]: {exc}") from None
        elif kind == "norm":
            prepared.append((key, np.ascontiguousarray(_host(value), dtype=np.float32), None))
        else:
            assert isinstance(value, Dense)
            bf16 = value.dtype == "bfloat16"
            prepared.append((key, np.ascontiguousarray(_host(value.data)),
                             gguf.GGMLQuantizationType.BF16 if bf16 else None))
    head = params.get("lm_head")
    if isinstance(head, PackedWeight):
        raise ValueError("params['lm_head'] is an int8 PackedWeight, which this GGUF layout "
                         "cannot hold; save the Dense head")
    fields = _tokenizer_fields(config, tokenizer)
    with atomic_path(path, ".gguf") as tmp:
        w = gguf.GGUFWriter(tmp, ARCH)
        w.add_context_length(config.max_position_embeddings)
        w.add_embedding_length(config.hidden_size)
        w.add_block_count(config.num_hidden_layers)
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_rope_dimension_count(config.head_dim)
        w.add_rope_freq_base(config.rope_theta)
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
        w.add_vocab_size(config.vocab_size)
        w.add_string(ACT_KEY, config.hidden_act)
        w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}"])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value in fields.items():
            _add_field(w, gguf, key, value)
        for key, arr, rt in prepared:
            w.add_tensor(key, arr, raw_dtype=rt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def _add_field(w: Any, gguf: Any, key: str, value: Any) -> None:
    if key == "tokenizer.ggml.token_type":
        w.add_token_types([int(v) for v in value])  # int32, as llama.cpp reads it
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        raise ValueError(f"tokenizer metadata {key!r}: cannot write a {type(value).__name__}")
